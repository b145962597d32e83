"""MegatronTrainer: megatron-core ``GPTModel`` with tensor / pipeline / data parallelism (GPU).

Extra ``[megatron]`` (``pip install 'rollart-train[megatron]'``). Launch one process per GPU with
``torchrun --nproc-per-node N``, or as the ranks of a :class:`~rollart_train.RayTrainerGroup`
(``worker: megatron``, :mod:`rollart_train.megatron_rank`); ``tensor_parallel * pipeline_parallel``
must divide N, the rest is data parallelism. Every rank builds the trainer with the same config and
calls ``train_step`` with the same batch (each data-parallel rank trains its share); ``named_weights``
yields full tensors in Hugging Face naming on global rank 0 (TP shards gathered, fused QKV / gate-up
split, pipeline stages collected), which is what the weight store wants. A single process without
torchrun forms a world of one. ``device: cpu`` runs the same model and tensor-parallel layers over gloo
with CPU stand-ins for Megatron's DDP, optimizer and schedule (:mod:`rollart_train._megatron_cpu`).

Weights are loaded from a Hugging Face Qwen2/Llama directory (``config.json`` + safetensors) through
:mod:`rollart_train.megatron_convert`. The loss is the same as the torch trainer's (PPO-clip or decoupled
PPO, KL to the behaviour policy, entropy; GRPO or GiGPO advantages; one sequence per trajectory, or per
turn for current-state-only prompts), computed on full-vocabulary logits of the last stage, under each
token's sampling temperature and token restriction with ``match_sampling``.
Checkpoints (:meth:`MegatronTrainer.save`) are a Hugging Face directory plus each rank's optimizer
state; ``resume_from`` restores weights and version on any layout, the optimizer state on the same one.
Not done yet: sequence packing (Megatron's THD layout needs Transformer Engine attention; micro-batches
are right-padded), a reference model for KL, and optimizer state across layouts.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from rollart_core.errors import TrainerError
from rollart_core.types import Trajectory
from rollart_train._checkpoint import commit, copy_model_files, find_checkpoint, read_state, staging_dir
from rollart_train._megatron_cpu import (
    CpuOptimizer,
    cuda_current_device_is_cpu,
    forward_backward_cpu,
    init_cpu_rng,
)
from rollart_train._packing import (
    MicroBatch,
    SeqData,
    build_micro_batch,
    seq_data,
    split_sequences,
    target_logits,
    target_logprobs,
    trajectory_weights,
)
from rollart_train.losses import (
    batch_advantages,
    policy_loss,
)
from rollart_train.megatron_config import MegatronTrainerConfig
from rollart_train.megatron_convert import hf_to_megatron, megatron_to_hf, merge_tp_shards
from rollart_train.megatron_model import (
    build_gpt,
    build_gpt_model_cpu_for_tests,
    causal_mask,
    global_name,
    hf_shape,
    init_parallel,
    load_local,
    read_hf,
    require_mcore,
    transformer_config,
)

__all__ = [
    "MegatronTrainer",
    "MegatronTrainerConfig",
    "build_gpt_model_cpu_for_tests",
    "init_parallel",
    "transformer_config",
]

log = logging.getLogger(__name__)
OPTIM_DIR = "megatron_optim"


class MegatronTrainer:
    Config = MegatronTrainerConfig

    def __init__(self, config: MegatronTrainerConfig | None = None, *, model_path: str | Path) -> None:
        require_mcore()
        from megatron.core import parallel_state, tensor_parallel
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        self.config = c = config or MegatronTrainerConfig()
        self.cuda = c.device == "cuda"
        if self.cuda and not torch.cuda.is_available():
            raise TrainerError(
                "MegatronTrainer with device: cuda needs CUDA GPUs (device: cpu runs it over gloo for "
                "tests; TorchTrainer trains on CPU)"
            )
        self.device = torch.device("cuda" if self.cuda else "cpu")
        self.model_path = Path(model_path)
        self.resumed_from = find_checkpoint(c.resume_from) if c.resume_from else None
        if c.num_threads:
            torch.set_num_threads(c.num_threads)
        init_parallel(c)
        if self.cuda:
            tensor_parallel.model_parallel_cuda_manual_seed(c.seed)
        else:
            init_cpu_rng(c.seed)
        hf, state = read_hf(self.resumed_from or self.model_path)
        self.hf_config = hf
        self.shape = hf_shape(hf)
        self.tcfg = transformer_config(
            hf, tp=c.tensor_parallel, pp=c.pipeline_parallel, bf16=c.bf16, cpu_init=not self.cuda
        )
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.first = parallel_state.is_pipeline_first_stage()
        self.last = parallel_state.is_pipeline_last_stage()
        align = 128 * c.tensor_parallel
        self.padded_vocab = (hf["vocab_size"] + align - 1) // align * align
        self.module = build_gpt(hf, self.tcfg, pre=self.first, post=self.last, vocab=self.padded_vocab)
        """This rank's GPTModel stage (inside Megatron DDP on CUDA)."""
        if self.cuda:
            self.module.cuda()
        self.layer_offset = get_transformer_layer_offset(self.tcfg)
        full = hf_to_megatron(state, self.shape, tied=bool(hf.get("tie_word_embeddings", False)))
        load_local(
            self.module, full, layer_offset=self.layer_offset, tp_rank=self.tp_rank, tp_size=c.tensor_parallel
        )
        del state, full
        self.model: Any
        self.optimizer: Any
        if self.cuda:
            self.model, self.optimizer = self._ddp_and_optimizer()
        else:
            self.model = self.module
            self.optimizer = CpuOptimizer(
                self.module, lr=c.lr, weight_decay=c.weight_decay, max_grad_norm=c.max_grad_norm
            )
        self.pad_id = int(hf.get("pad_token_id") or 0)
        self.version = 0
        self.counters = {"optimizer_steps": 0, "skipped_steps": 0, "samples_seen": 0, "tokens_seen": 0}
        self.extra_state: dict[str, Any] = {}
        self.optimizer_restored = False
        if self.resumed_from is not None:
            self._load_state(self.resumed_from)

    def _ddp_and_optimizer(self) -> tuple[Any, Any]:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        c = self.config
        ddp_cfg = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=c.use_distributed_optimizer,
        )
        model = DistributedDataParallel(config=self.tcfg, ddp_config=ddp_cfg, module=self.module)
        optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=c.lr,
                weight_decay=c.weight_decay,
                bf16=c.bf16,
                params_dtype=torch.bfloat16 if c.bf16 else torch.float32,
                clip_grad=c.max_grad_norm,
                use_distributed_optimizer=c.use_distributed_optimizer,
            ),
            [model],
        )
        return model, optimizer

    def _on_device(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext() if self.cuda else cuda_current_device_is_cpu()

    # training --------------------------------------------------------------------------------

    def _micro_batches(self, seqs: Sequence[SeqData]) -> tuple[list[MicroBatch], int]:
        """This data-parallel rank's share of the batch's sequences as padded micro-batches of
        ``micro_batch_size`` rows (``_packing.build_micro_batch``, as the torch trainer's), all of one
        width (pipeline p2p needs one shape); a rank with no sequence gets one zero-weight dummy."""
        mine = list(range(self.dp_rank, len(seqs), self.dp_size))
        width = max(len(s.ids) for s in seqs)
        width = (width + 7) // 8 * 8
        mbs = self.config.micro_batch_size
        parts = [mine[s : s + mbs] for s in range(0, len(mine), mbs)]
        if not parts:  # keeps this rank's collectives in step with the others
            seqs, parts = [SeqData([self.pad_id] * 2, [0, 0], [0.0, 0.0], [-1, -1], 0.0)], [[0]]
        return [
            build_micro_batch(
                seqs,
                part,
                select="loss",
                packed=False,
                pad_id=self.pad_id,
                attn_impl="eager",
                mask_dtype=torch.float32,
                width=width,
            )
            for part in parts
        ], width

    def _forward(self, mb: MicroBatch) -> torch.Tensor:
        ids = mb.input_ids.to(self.device)
        pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        with self._on_device():
            return self.model(
                input_ids=ids,
                position_ids=pos,
                attention_mask=causal_mask(ids.shape[0], ids.shape[1], ids.device),
            )

    def _token_logprobs(self, logits: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The selected targets' log-probabilities ``[n]`` and logits ``[n, V]`` (``_packing``)."""
        flat = target_logits(logits, mb.to(self.device), self.shape.vocab_size)
        return target_logprobs(flat, mb.targets), flat

    def train_step(self, batch: Sequence[Trajectory]) -> dict[str, float]:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if not batch:
            raise TrainerError("train_step called with an empty batch")
        c = self.config
        t0 = time.perf_counter()
        adv = batch_advantages(
            batch, c.advantage, gamma=c.gamma, step_weight=c.step_adv_weight, scale_by_std=c.scale_adv_by_std
        )
        # one sequence per trajectory, or per turn when each turn's prompt was the current state only
        seqs = [seq_data(t, a, c.match_sampling) for t, a in zip(*split_sequences(batch, adv), strict=True)]
        n_tokens = sum(sum(sq.mask[1:]) for sq in seqs)
        if n_tokens == 0:
            raise TrainerError("batch has no generated tokens to train on")
        if c.loss_agg == "trajectory_mean":
            trajectory_weights(batch, seqs)
        micros, width = self._micro_batches(seqs)
        fb = get_forward_backward_func() if self.cuda else forward_backward_cpu
        stale = any(v != self.version for sq in seqs for v in sq.versions if v >= 0)
        prox: list[torch.Tensor] = []
        if c.loss == "decoupled_ppo" and stale:  # proximal logprobs: the weights before this update

            def prox_step(it: Iterator[MicroBatch], model: Any) -> tuple[torch.Tensor, Any]:
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

        def step(it: Iterator[MicroBatch], model: Any) -> tuple[torch.Tensor, Any]:
            mb = next(it)
            k = next(counter)
            out = self._forward(mb)

            def loss_fn(o: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
                logp, logits = self._token_logprobs(o, mb)
                loss, st = policy_loss(
                    logp,
                    logits,
                    mb.behaviour,
                    mb.advantages,
                    mb.mask,
                    c,
                    n=n_tokens,
                    entropy_coef=c.entropy_coef,
                    proximal_logp=prox[k] if prox else None,
                    versions=mb.versions,
                    version=self.version,
                    entropy_stats=False,  # as before: no [tokens, vocab] float32 copy without a bonus
                )
                for key, v in st.items():
                    stats[key] = stats.get(key, 0.0) + float(v)
                # the schedule divides by the number of micro-batches and DDP averages over data-parallel
                # ranks; the loss is already a mean over the global batch's tokens
                return loss * len(micros) * self.dp_size, {}

            return out, loss_fn

        if self.cuda:
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
        self.counters["optimizer_steps" if ok else "skipped_steps"] += 1
        self.counters["samples_seen"] += len(batch)
        self.counters["tokens_seen"] += sum(len(sq.ids) for sq in seqs)
        reduced = self._reduce_stats(stats)
        return {
            **reduced,
            "grad_norm": float(grad_norm or 0.0),
            "update_successful": float(bool(ok)),
            "reward_mean": sum(t.reward for t in batch) / len(batch),
            "train_tokens": float(n_tokens),
            "proximal_recomputed": float(bool(prox)),
            "optimizer_steps": float(self.counters["optimizer_steps"]),
            "train_s": time.perf_counter() - t0,
            "version": float(self.version),
        }

    def _reduce_stats(self, stats: dict[str, float]) -> dict[str, float]:
        import torch.distributed as dist

        keys = ["loss", "clip_frac", "approx_kl", "behav_weight", "tis_capped_frac"]
        t = torch.tensor([stats.get(k, 0.0) for k in keys], device=self.device, dtype=torch.float64)
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
        for name, p in self.module.named_parameters():
            g = global_name(name, self.layer_offset)
            if self.config.tensor_parallel > 1:
                shards = [torch.empty_like(p.data) for _ in range(self.config.tensor_parallel)]
                dist.all_gather(shards, p.data.contiguous(), group=tp_group)
                full = merge_tp_shards(g, shards)
            else:
                full = p.data
            local.append((g, full.detach().to("cpu", copy=True)))  # never alias the live parameters
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
        ids = list(token_ids)
        if len(ids) < 2:
            return []
        seq = SeqData(ids, [1] * len(ids), [0.0] * len(ids), [-1] * len(ids), 0.0)
        mb = build_micro_batch(
            [seq],
            [0],
            select="all",
            packed=False,
            pad_id=self.pad_id,
            attn_impl="eager",
            mask_dtype=torch.float32,
        )
        with torch.no_grad():
            return self._token_logprobs(self._forward(mb), mb)[0].tolist()

    # checkpoints -----------------------------------------------------------------------------

    def _layout(self) -> dict[str, Any]:
        """What a saved optimizer state depends on: it reloads only under the same layout."""
        c = self.config
        return {
            "tensor_parallel": c.tensor_parallel,
            "pipeline_parallel": c.pipeline_parallel,
            "data_parallel": self.dp_size,
            "device": c.device,
            "distributed_optimizer": self.cuda and c.use_distributed_optimizer,
        }

    def _param_state_file(self, root: Path) -> Path:
        return root / OPTIM_DIR / f"param_state_tp{self.tp_rank}_pp{self.pp_rank}.pt"

    def save(self, path: str | Path, extra: dict[str, Any] | None = None) -> None:
        """HF directory (safetensors, config and tokenizer files, written by global rank 0) plus each
        rank's optimizer state, then ``rollart_trainer.json``. Collective. Written into a staging
        sibling and renamed when every rank has written its part."""
        import torch.distributed as dist
        from safetensors.torch import save_file

        out = Path(path)
        tmp = staging_dir(out)
        rank = dist.get_rank()
        weights = dict(self.named_weights())  # collective; the full dict on global rank 0 only
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / OPTIM_DIR).mkdir(parents=True)
            save_file(
                # own storage each: split QKV / gate-up tensors are views of one gathered tensor
                {k: v.clone(memory_format=torch.contiguous_format) for k, v in weights.items()},
                str(tmp / "model.safetensors"),
                metadata={"format": "pt"},
            )
            copy_model_files(self.resumed_from or self.model_path, tmp)
        dist.barrier()
        if not (tmp / OPTIM_DIR).is_dir():
            raise TrainerError(
                f"save {out}: rank {rank} does not see the directory global rank 0 created ({tmp}): "
                "save to a path that every rank's node shares"
            )
        torch.save(
            {"layout": self._layout(), "optimizer": self.optimizer.state_dict()},
            tmp / OPTIM_DIR / f"rank{rank}.pt",
        )
        if self._layout()["distributed_optimizer"]:  # the sharded moments: gathered on DP rank 0
            self.optimizer.save_parameter_state(str(self._param_state_file(tmp)))
        dist.barrier()
        if rank == 0:
            state = {
                "format": 1,
                "trainer": "megatron",
                "version": self.version,
                **self.counters,
                "world_size": dist.get_world_size(),
                "layout": self._layout(),
                "extra": extra if extra is not None else self.extra_state,
            }
            commit(tmp, out, state)
        dist.barrier()

    def _load_state(self, ckpt: Path) -> None:
        """Version, counters and ``extra`` from ``ckpt`` (the weights came from it already); the
        optimizer state when it was saved under this layout."""
        import torch.distributed as dist

        state = read_state(ckpt)
        self.version = int(state["version"])
        for k in self.counters:
            self.counters[k] = int(state.get(k, 0))
        self.extra_state = dict(state.get("extra") or {})
        blob_file = ckpt / OPTIM_DIR / f"rank{dist.get_rank()}.pt"
        saved = state.get("layout")
        if saved != self._layout() or not blob_file.is_file():
            log.warning(
                "%s: optimizer state not restored (saved under %s, running %s): weights and version %d "
                "restored, the optimizer starts fresh",
                ckpt,
                saved,
                self._layout(),
                self.version,
            )
            return
        # Megatron's optimizer state holds plain Python objects beside tensors (the weights-only
        # unpickler may refuse them); the file is one this trainer wrote
        blob = torch.load(blob_file, map_location="cpu", weights_only=False)
        self.optimizer.load_state_dict(blob["optimizer"])
        if saved["distributed_optimizer"]:
            self.optimizer.load_parameter_state(str(self._param_state_file(ckpt)))
        self.optimizer_restored = True
        log.info("resumed from %s at version %d", ckpt, self.version)

    def set_version(self, version: int) -> None:
        """Continue under ``version`` (a restarted worker group keeps its versions monotone)."""
        if version < 0:
            raise TrainerError(f"set_version: versions are >= 0, got {version}")
        self.version = version

    def state(self) -> dict[str, Any]:
        return {
            "version": self.version,
            **self.counters,
            "extra": self.extra_state,
            "optimizer_restored": self.optimizer_restored,
            "resumed_from": str(self.resumed_from) if self.resumed_from else None,
        }
