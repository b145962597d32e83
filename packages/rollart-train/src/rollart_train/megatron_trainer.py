"""MegatronTrainer: megatron-core ``GPTModel`` with tensor / pipeline / data parallelism (GPU).

Extra ``[megatron]`` (``pip install 'rollart-train[megatron]'``). Launch one process per GPU with
``torchrun --nproc-per-node N``; ``tensor_parallel * pipeline_parallel`` must divide N, the rest is
data parallelism. Every rank builds the trainer with the same config and calls ``train_step`` with the
same batch (each data-parallel rank trains its share); ``named_weights`` yields full tensors in Hugging
Face naming on global rank 0 (TP shards gathered, fused QKV / gate-up split, pipeline stages collected),
which is what the weight store wants. A single process without torchrun forms a world of one.

Weights are loaded from a Hugging Face Qwen2/Llama directory (``config.json`` + safetensors) through
:mod:`rollart_train.megatron_convert`. The loss is the same as the torch trainer's (PPO-clip or decoupled
PPO, KL to the behaviour policy, entropy), computed on full-vocabulary logits of the last stage.
Not done yet: sequence packing (Megatron's THD layout needs Transformer Engine attention; micro-batches
are right-padded), a reference model for KL, and resumable optimizer checkpoints across layouts.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from rollart_core.errors import ConfigError, TrainerError
from rollart_core.extras import require
from rollart_core.types import Trajectory
from rollart_train.losses import (
    decoupled_ppo_loss,
    entropy_from_logits,
    grpo_advantages,
    kl_penalty,
    masked_mean,
)
from rollart_train.megatron_convert import (
    GptShape,
    hf_to_megatron,
    megatron_to_hf,
    merge_tp_shards,
    split_tp_shard,
)

__all__ = ["MegatronTrainer", "MegatronTrainerConfig", "build_gpt_model_cpu_for_tests", "transformer_config"]

INSTALL = "pip install 'rollart-train[megatron]'"


class MegatronTrainerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    tensor_parallel: int = Field(1, ge=1)
    pipeline_parallel: int = Field(1, ge=1)
    lr: float = Field(1e-5, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float = Field(1.0, gt=0)
    loss: Literal["ppo_clip", "decoupled_ppo"] = "ppo_clip"
    """As TorchTrainer: decoupled_ppo recomputes proximal logprobs for tokens of older versions."""
    clip_eps: float = Field(0.2, gt=0)
    clip_eps_high: float | None = None
    tis_cap: float | None = Field(None, gt=0)
    tis_mode: Literal["truncate", "mask"] = "truncate"
    kl_coef: float = Field(0.0, ge=0)
    """KL to the behaviour policy (no reference model in this trainer yet)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    entropy_coef: float = Field(0.0, ge=0)
    scale_adv_by_std: bool = True
    micro_batch_size: int = Field(4, ge=1)
    """Sequences per micro-batch (right-padded to the batch's longest, a multiple of 8)."""
    bf16: bool = True
    use_distributed_optimizer: bool = True
    seed: int = 0


def _mcore() -> Any:
    return require("megatron.core", INSTALL)


def transformer_config(
    hf: dict[str, Any], *, tp: int = 1, pp: int = 1, bf16: bool = False, cpu_init: bool = False
) -> Any:
    """Megatron ``TransformerConfig`` equivalent to a Hugging Face Qwen2/Llama ``config.json``."""
    _mcore()
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    if hf.get("model_type") not in ("qwen2", "llama"):
        raise ConfigError(f"MegatronTrainer supports qwen2/llama checkpoints, not {hf.get('model_type')!r}")
    heads = hf["num_attention_heads"]
    return TransformerConfig(
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        ffn_hidden_size=hf["intermediate_size"],
        kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads,
        normalization="RMSNorm",
        layernorm_epsilon=hf.get("rms_norm_eps", 1e-6),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=hf.get("model_type") == "qwen2" or bool(hf.get("attention_bias")),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_cpu_initialization=cpu_init,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )


def _build(hf: dict[str, Any], tcfg: Any, *, pre: bool, post: bool, vocab: int) -> Any:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return GPTModel(
        config=tcfg,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=vocab,
        max_sequence_length=hf.get("max_position_embeddings", 4096),
        pre_process=pre,
        post_process=post,
        parallel_output=False,
        share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings", False)),
        position_embedding_type="rope",
        rotary_base=int(hf.get("rope_theta", 10000)),
    )


def _read_hf(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    cfg = json.loads((path / "config.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    if not tensors:
        raise TrainerError(f"no safetensors weights in {path}")
    return cfg, tensors


def _causal_mask(b: int, s: int, device: torch.device) -> torch.Tensor:
    return torch.triu(torch.ones(s, s, dtype=torch.bool, device=device), diagonal=1)[None, None].expand(
        b, 1, s, s
    )


def build_gpt_model_cpu_for_tests(path: Path, hf_state: dict[str, torch.Tensor]) -> Any:
    """A tiny GPTModel on CPU (world of one over gloo) with converted HF weights: checks the conversion
    against the real megatron-core modules. CPU patches: the RNG tracker without CUDA
    (``inference_rng_tracker``) and ``torch.cuda.current_device`` answering ``"cpu"`` during forward."""
    _mcore()
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from rollart_train._multirank import free_port

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    hf = json.loads((path / "config.json").read_text())
    model = _build(hf, transformer_config(hf, cpu_init=True), pre=True, post=True, vocab=hf["vocab_size"])
    shape = GptShape.from_hf_config(_Obj(hf))
    full = hf_to_megatron(hf_state, shape, tied=bool(hf.get("tie_word_embeddings", False)))
    _load_local(model, full, layer_offset=0, tp_rank=0, tp_size=1)
    model.eval()

    class _Wrapped(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = model

        def forward(
            self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: Any
        ) -> torch.Tensor:
            mask = _causal_mask(input_ids.shape[0], input_ids.shape[1], input_ids.device)
            # megatron-core places RoPE frequencies and its scratch buffers on torch.cuda.current_device()
            real = torch.cuda.current_device
            torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
            try:
                return self.inner(input_ids=input_ids, position_ids=position_ids, attention_mask=mask)
            finally:
                torch.cuda.current_device = real  # type: ignore[method-assign]

    return _Wrapped()


class _Obj:
    def __init__(self, d: dict[str, Any]) -> None:
        self.__dict__.update(d)


def _global_name(local: str, offset: int) -> str:
    """A pipeline stage's local parameter name with its layer index made global."""
    parts = local.split(".")
    if local.startswith("decoder.layers."):
        parts[2] = str(int(parts[2]) + offset)
    return ".".join(parts)


def _load_local(
    model: torch.nn.Module, full: dict[str, torch.Tensor], *, layer_offset: int, tp_rank: int, tp_size: int
) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            g = _global_name(name, layer_offset)
            if g not in full:
                raise TrainerError(f"no converted weight for Megatron parameter {g}")
            shard = split_tp_shard(g, full[g], tp_rank, tp_size)
            if g.endswith(("word_embeddings.weight", "output_layer.weight")) and shard.shape[0] != p.shape[0]:
                padded = shard.new_zeros(p.shape)
                padded[: shard.shape[0]] = shard
                shard = padded
            if shard.shape != p.shape:
                raise TrainerError(f"{g}: converted shape {tuple(shard.shape)} != parameter {tuple(p.shape)}")
            p.copy_(shard.to(p.dtype))


class MegatronTrainer:
    Config = MegatronTrainerConfig

    def __init__(self, config: MegatronTrainerConfig | None = None, *, model_path: str | Path) -> None:
        _mcore()
        import torch.distributed as dist
        from megatron.core import parallel_state, tensor_parallel
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        self.config = c = config or MegatronTrainerConfig()
        if not torch.cuda.is_available():
            raise TrainerError("MegatronTrainer needs CUDA GPUs (use TorchTrainer on CPU)")
        self.model_path = Path(model_path)
        if not dist.is_initialized():
            if "WORLD_SIZE" not in os.environ:
                from rollart_train._multirank import free_port

                os.environ.update(
                    MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1"
                )
            dist.init_process_group("nccl")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count())))
        if dist.get_world_size() % (c.tensor_parallel * c.pipeline_parallel):
            raise ConfigError("tensor_parallel * pipeline_parallel must divide the world size")
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(c.tensor_parallel, c.pipeline_parallel)
        tensor_parallel.model_parallel_cuda_manual_seed(c.seed)
        hf, state = _read_hf(self.model_path)
        self.hf_config = hf
        self.shape = GptShape.from_hf_config(_Obj(hf))
        self.tcfg = transformer_config(hf, tp=c.tensor_parallel, pp=c.pipeline_parallel, bf16=c.bf16)
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.first = parallel_state.is_pipeline_first_stage()
        self.last = parallel_state.is_pipeline_last_stage()
        align = 128 * c.tensor_parallel
        self.padded_vocab = (hf["vocab_size"] + align - 1) // align * align
        model = _build(hf, self.tcfg, pre=self.first, post=self.last, vocab=self.padded_vocab).cuda()
        self.layer_offset = get_transformer_layer_offset(self.tcfg)
        full = hf_to_megatron(state, self.shape, tied=bool(hf.get("tie_word_embeddings", False)))
        _load_local(
            model, full, layer_offset=self.layer_offset, tp_rank=self.tp_rank, tp_size=c.tensor_parallel
        )
        del state, full
        ddp_cfg = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=c.use_distributed_optimizer,
        )
        self.model = DistributedDataParallel(config=self.tcfg, ddp_config=ddp_cfg, module=model)
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=c.lr,
                weight_decay=c.weight_decay,
                bf16=c.bf16,
                params_dtype=torch.bfloat16 if c.bf16 else torch.float32,
                clip_grad=c.max_grad_norm,
                use_distributed_optimizer=c.use_distributed_optimizer,
            ),
            [self.model],
        )
        self.pad_id = int(hf.get("pad_token_id") or 0)
        self.version = 0

    # training --------------------------------------------------------------------------------

    def _micro_batches(
        self, batch: Sequence[Trajectory], adv: list[float]
    ) -> tuple[list[dict[str, torch.Tensor]], int]:
        mine = list(range(self.dp_rank, len(batch), self.dp_size))
        width = max(len(t.token_ids()) for t in batch)
        width = (width + 7) // 8 * 8  # one shape for every micro-batch (pipeline p2p needs it)
        micros = []
        mbs = self.config.micro_batch_size
        for s in range(0, max(len(mine), 1), mbs):
            idx = mine[s : s + mbs]
            n = max(len(idx), 1)
            ids = torch.full((n, width), self.pad_id, dtype=torch.long)
            mask = torch.zeros((n, width))
            beh = torch.zeros((n, width))
            ver = torch.full((n, width), -1, dtype=torch.long)
            a = torch.zeros((n, width))
            for r, i in enumerate(idx):
                t = batch[i]
                tok = t.token_ids()
                ids[r, : len(tok)] = torch.tensor(tok)
                mask[r, : len(tok)] = torch.tensor(t.loss_mask(), dtype=torch.float32)
                beh[r, : len(tok)] = torch.tensor(t.behaviour_logprobs())
                ver[r, : len(tok)] = torch.tensor(t.token_versions())
                a[r, :] = adv[i]
            micros.append({"ids": ids, "mask": mask, "beh": beh, "ver": ver, "adv": a})
        return micros, width

    def _forward(self, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        ids = mb["ids"].cuda()
        pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        return self.model(
            input_ids=ids, position_ids=pos, attention_mask=_causal_mask(*ids.shape, ids.device)
        )

    def _token_logprobs(
        self, logits: torch.Tensor, mb: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logits = logits[:, :-1, : self.shape.vocab_size].float()
        logp_all = torch.log_softmax(logits, -1)
        tgt = mb["ids"][:, 1:].cuda()
        return logp_all.gather(-1, tgt.unsqueeze(-1)).squeeze(-1), logits

    def train_step(self, batch: Sequence[Trajectory]) -> dict[str, float]:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if not batch:
            raise TrainerError("train_step called with an empty batch")
        if any(len(t.sequences()) > 1 for t in batch):
            raise TrainerError(
                "MegatronTrainer trains one sequence per trajectory; per-turn sequences "
                "(task context: last_turn) need the torch trainer for now"
            )
        c = self.config
        t0 = time.perf_counter()
        adv = grpo_advantages(batch, scale_by_std=c.scale_adv_by_std)
        n_tokens = sum(t.num_generated() for t in batch)
        if n_tokens == 0:
            raise TrainerError("batch has no generated tokens to train on")
        micros, width = self._micro_batches(batch, adv)
        fb = get_forward_backward_func()
        stale = any(v != self.version for t in batch for v in t.token_versions() if v >= 0)
        prox: list[torch.Tensor] = []
        if c.loss == "decoupled_ppo" and stale:  # proximal logprobs: the weights before this update

            def prox_step(it: Iterator[dict[str, torch.Tensor]], model: Any) -> tuple[torch.Tensor, Any]:
                mb = next(it)
                out = self._forward(mb)

                def keep(o: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
                    prox.append(self._token_logprobs(o, mb)[0].detach())
                    return o.sum() * 0.0, {}

                return out, keep

            with torch.no_grad():
                fb(
                    forward_step_func=prox_step,
                    data_iterator=iter(micros),
                    model=[self.model],
                    num_microbatches=len(micros),
                    seq_length=width,
                    micro_batch_size=c.micro_batch_size,
                    forward_only=True,
                )
        stats: dict[str, float] = {}
        counter = iter(range(len(micros)))

        def step(it: Iterator[dict[str, torch.Tensor]], model: Any) -> tuple[torch.Tensor, Any]:
            mb = next(it)
            k = next(counter)
            out = self._forward(mb)

            def loss_fn(o: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
                logp, logits = self._token_logprobs(o, mb)
                mask, beh = mb["mask"][:, 1:].cuda(), mb["beh"][:, 1:].cuda()
                ver, a = mb["ver"][:, 1:].cuda(), mb["adv"][:, 1:].cuda()
                p = beh if not prox else torch.where(ver == self.version, beh, prox[k])
                loss, st = decoupled_ppo_loss(
                    logp,
                    p,
                    beh,
                    a,
                    mask,
                    clip_eps=c.clip_eps,
                    clip_eps_high=c.clip_eps_high,
                    tis_cap=c.tis_cap if c.loss == "decoupled_ppo" else None,
                    tis_mode=c.tis_mode,
                    n=n_tokens,
                )
                ent = entropy_from_logits(logits) if c.entropy_coef > 0 else None
                if ent is not None:
                    loss = loss - c.entropy_coef * masked_mean(ent, mask, n_tokens)
                if c.kl_coef > 0:
                    loss = loss + c.kl_coef * masked_mean(
                        kl_penalty(logp, beh, c.kl_estimator), mask, n_tokens
                    )
                for key, v in st.items():
                    stats[key] = stats.get(key, 0.0) + float(v)
                stats["loss"] = stats.get("loss", 0.0) + float(loss.detach())
                # the schedule divides by the number of micro-batches and DDP averages over data-parallel
                # ranks; the loss is already a mean over the global batch's tokens
                return loss * len(micros) * self.dp_size, {}

            return out, loss_fn

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        fb(
            forward_step_func=step,
            data_iterator=iter(micros),
            model=[self.model],
            num_microbatches=len(micros),
            seq_length=width,
            micro_batch_size=c.micro_batch_size,
            forward_only=False,
        )
        ok, grad_norm, _ = self.optimizer.step()
        self.version += 1
        reduced = self._reduce_stats(stats)
        return {
            **reduced,
            "grad_norm": float(grad_norm or 0.0),
            "update_successful": float(bool(ok)),
            "reward_mean": sum(t.reward for t in batch) / len(batch),
            "train_tokens": float(n_tokens),
            "proximal_recomputed": float(bool(prox)),
            "train_s": time.perf_counter() - t0,
            "version": float(self.version),
        }

    def _reduce_stats(self, stats: dict[str, float]) -> dict[str, float]:
        import torch.distributed as dist

        keys = ["loss", "clip_frac", "approx_kl", "behav_weight", "tis_capped_frac"]
        t = torch.tensor([stats.get(k, 0.0) for k in keys], device="cuda", dtype=torch.float64)
        dist.all_reduce(
            t
        )  # DP ranks hold disjoint token sums; other ranks add 0 (only last stages fill stats)
        tp = self.config.tensor_parallel
        return {k: float(v) / tp for k, v in zip(keys, t.tolist(), strict=True)}

    # weights ---------------------------------------------------------------------------------

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors in HF naming on global rank 0 (collective: every rank must iterate)."""
        import torch.distributed as dist
        from megatron.core import parallel_state

        tp_group = parallel_state.get_tensor_model_parallel_group()
        local: list[tuple[str, torch.Tensor]] = []
        for name, p in self.model.module.named_parameters():
            g = _global_name(name, self.layer_offset)
            if self.config.tensor_parallel > 1:
                shards = [torch.empty_like(p.data) for _ in range(self.config.tensor_parallel)]
                dist.all_gather(shards, p.data.contiguous(), group=tp_group)
                full = merge_tp_shards(g, shards)
            else:
                full = p.data
            local.append((g, full.detach().cpu()))
        hf = list(megatron_to_hf(local, self.shape))
        if self.config.pipeline_parallel > 1:
            stages: list[Any] = [None] * self.config.pipeline_parallel
            dist.all_gather_object(
                stages,
                hf if self.tp_rank == 0 and self.dp_rank == 0 else None,
                group=parallel_state.get_pipeline_model_parallel_group(),
            )
            hf = [kv for s in stages if s for kv in s]
        if dist.get_rank() == 0:
            yield from hf

    def logprobs(self, token_ids: Sequence[int]) -> list[float]:
        """Logprobs under the current weights (no pipeline parallelism: one stage holds the whole model)."""
        if self.config.pipeline_parallel > 1:
            raise TrainerError("logprobs() needs pipeline_parallel = 1")
        with torch.no_grad():
            mb = {"ids": torch.tensor([list(token_ids)])}
            return self._token_logprobs(self._forward(mb), mb)[0][0].tolist()

    def save(self, path: str | Path) -> None:
        """HF directory (safetensors, rank 0) plus each rank's optimiser state (same layout to resume)."""
        import torch.distributed as dist
        from safetensors.torch import save_file

        out = Path(path)
        weights = dict(self.named_weights())
        if dist.get_rank() == 0:
            out.mkdir(parents=True, exist_ok=True)
            save_file(
                {k: v.contiguous() for k, v in weights.items()},
                str(out / "model.safetensors"),
                metadata={"format": "pt"},
            )
            for f in (
                "config.json",
                "tokenizer.json",
                "tokenizer_config.json",
                "chat_template.jinja",
                "generation_config.json",
            ):
                if (self.model_path / f).is_file():
                    shutil.copy(self.model_path / f, out / f)
            (out / "rollart_trainer.json").write_text(
                json.dumps({"version": self.version, "trainer": "megatron"})
            )
        dist.barrier()
        (out / "megatron_optim").mkdir(parents=True, exist_ok=True)
        torch.save(self.optimizer.state_dict(), out / "megatron_optim" / f"rank{dist.get_rank()}.pt")
