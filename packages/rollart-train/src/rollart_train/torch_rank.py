"""One rank of the torch trainer: model, optimiser, packed micro-batches, losses, checkpoints.

With ``world_size == 1`` it is a plain in-process module (no process group). With ``world_size > 1``
the default process group must already be initialised (``torchrun``, or the spawned ranks of
:mod:`rollart_train._multirank`); the model is sharded with FSDP2 (``fully_shard`` per decoder layer,
then the root) on a 1-D device mesh, and every public method is collective: all ranks call it with the
same arguments. Under torchrun::

    dist.init_process_group("nccl")  # or "gloo"
    worker = TorchRankWorker(TorchTrainerConfig(world_size=dist.get_world_size(), device="cuda"),
                             model_path, rank=dist.get_rank(), world_size=dist.get_world_size())
    metrics = worker.train_step(batch, worker.config)   # the same batch on every rank
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import torch

from rollart_core.errors import ConfigError, TrainerError
from rollart_core.malloc import release_free_memory
from rollart_core.types import Trajectory
from rollart_train._attention import SEGMENT_ATTENTION, register_segment_attention
from rollart_train._checkpoint import (
    ADAPTER_DIR,
    STATE_FILE,
    commit,
    copy_model_files,
    find_checkpoint,
    read_state,
    staging_dir,
)
from rollart_train._packing import (
    MicroBatch,
    SeqData,
    assign_bins,
    build_micro_batch,
    pack_bins,
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
from rollart_train.torch_config import TorchTrainerConfig, lr_factor

__all__ = ["STATE_FILE", "TorchRankWorker", "find_checkpoint"]

log = logging.getLogger(__name__)
OPTIM_FILE = "trainer_state.pt"
_STATS = ("loss", "pg_loss", "clip_frac", "approx_kl", "behav_weight", "tis_capped_frac", "kl", "entropy")


def _any_nonzero(a: float | list[float]) -> bool:
    return any(x != 0.0 for x in a) if isinstance(a, list) else a != 0.0


def _set_threads(n: int) -> None:
    """``torch.set_num_threads(n)``, warning when it does not take: an in-process vLLM CPU engine
    replaces that function with a no-op once it has pinned torch's threads to cores, so a rank
    sharing its process computes with the engine's thread count (and other numerics)."""
    torch.set_num_threads(n)
    if torch.get_num_threads() != n:
        log.warning(
            "trainer asked for %d torch threads but runs with %d: an in-process vLLM engine in this "
            "process has pinned torch's threads; run the engine or the trainer in its own process "
            "(trainer spawn: true, or the engine with VLLM_ENABLE_V1_MULTIPROCESSING=1)",
            n,
            torch.get_num_threads(),
        )


class TorchRankWorker:
    def __init__(
        self, config: TorchTrainerConfig, model_path: str | Path, *, rank: int = 0, world_size: int = 1
    ) -> None:
        c = self.config = config
        self.rank, self.world_size = rank, world_size
        self.model_path = Path(model_path)
        if c.num_threads:
            _set_threads(c.num_threads)
        torch.manual_seed(c.seed)
        self.device = torch.device(
            f"cuda:{rank % max(torch.cuda.device_count(), 1)}"
            if c.device == "cuda" and world_size > 1
            else c.device
        )
        self.compute_dtype = getattr(torch, c.dtype)
        self.param_dtype = (
            torch.float32 if (c.dtype == "bfloat16" and c.mixed_precision) else self.compute_dtype
        )
        self.resumed_from = find_checkpoint(c.resume_from) if c.resume_from else None
        self.model = self._load(self.resumed_from or self.model_path, policy=True)
        self.model.train()
        self.ref_model = None
        if c.kl_coef > 0 and c.kl_reference == "reference":
            self.ref_model = self._load(Path(c.ref_model_path) if c.ref_model_path else self.model_path)
            self.ref_model.eval()
            self.ref_model.requires_grad_(False)
        # with LoRA only the adapters train: the frozen base gets neither gradients nor AdamW state
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=c.lr,
            betas=c.betas,
            weight_decay=c.weight_decay,
        )
        self.pad_id = int(self.model.config.pad_token_id or 0)
        self.attn_impl = str(getattr(self.model.config, "_attn_implementation", None) or "sdpa")
        self.version = 0
        self.counters = {"optimizer_steps": 0, "samples_seen": 0, "tokens_seen": 0, "skipped_steps": 0}
        self.extra_state: dict[str, Any] = {}
        self.entropy_coef = c.entropy_coef
        """The entropy bonus in use: ``entropy_coef``, moved step by step under ``entropy_target``."""
        if self.resumed_from is not None:
            self._load_state(self.resumed_from)

    # model -----------------------------------------------------------------------------------

    def _load(self, path: Path, policy: bool = False) -> Any:
        """The model at ``path`` (a transformers ``PreTrainedModel``, typed ``Any``: its ``config`` and
        FSDP's methods are attributes mypy cannot see); the ``policy`` gets its LoRA adapters (from
        ``path/adapter`` when a checkpoint holds them) before it is moved and sharded."""
        from transformers import AutoModelForCausalLM

        kw: dict[str, Any] = {"dtype": self.param_dtype}
        attn = self.config.attn_implementation
        if (attn is None and self.config.packing) or attn == SEGMENT_ATTENTION:
            attn = register_segment_attention()
        if attn:
            kw["attn_implementation"] = attn
        model: Any = AutoModelForCausalLM.from_pretrained(path, **kw)
        if policy and self.config.lora is not None:
            from rollart_train.lora import apply_lora, load_adapter_files

            apply_lora(model, self.config.lora)
            if (path / ADAPTER_DIR).is_dir():
                load_adapter_files(model, path / ADAPTER_DIR, self.config.lora)
        if self.device.type != "cpu":
            model.to(self.device)
        if self.world_size > 1:
            self._shard(model)
        return model

    def _shard(self, model: torch.nn.Module) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(self.device.type, (self.world_size,))
        mp = (
            MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)
            if self.param_dtype != self.compute_dtype
            else MixedPrecisionPolicy()
        )
        layers = getattr(getattr(model, "model", None), "layers", None)
        if layers is None:
            raise TrainerError(
                f"{type(model).__name__}: expected decoder layers at model.model.layers to shard"
            )
        for layer in layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.world_size == 1 and self.param_dtype != self.compute_dtype:
            return torch.autocast(self.device.type, dtype=self.compute_dtype)
        return contextlib.nullcontext()

    def _logits(self, model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
        """float32 logits ``[n, V]`` of the positions that predict the selected targets, under each
        token's sampling temperature and allowed-token restriction when present."""
        with self._autocast():
            segments = {} if mb.cu_seqlens is None else {"cu_seq_lens_q": mb.cu_seqlens}
            out = model(
                input_ids=mb.input_ids,
                position_ids=mb.position_ids,
                attention_mask=mb.attention_mask,
                use_cache=False,
                logits_to_keep=mb.pred_index if mb.packed else 0,
                **segments,
            )
        return target_logits(out.logits, mb)

    def _micro(self, seqs: Sequence[SeqData], idx: Sequence[int], select: str) -> MicroBatch:
        mask_dtype = self.compute_dtype if self.param_dtype == self.compute_dtype else torch.float32
        return build_micro_batch(
            seqs,
            idx,
            select=select,
            packed=self.config.packing,
            pad_id=self.pad_id,
            attn_impl=self.attn_impl,
            mask_dtype=mask_dtype,
        ).to(self.device)

    def _dummy(self) -> MicroBatch:
        """A micro-batch with one zero-weight target: keeps ranks' collectives in step."""
        s = SeqData([self.pad_id, self.pad_id], [0, 0], [0.0, 0.0], [-1, -1], 0.0)
        return self._micro([s], [0], "all")

    @torch.no_grad()
    def logprobs(self, token_ids: Sequence[int]) -> list[float]:
        """Logprob of each token given the previous ones under the current weights (first: none)."""
        ids = list(token_ids)
        if len(ids) < 2:
            return []
        was_training = self.model.training
        self.model.eval()
        try:
            s = SeqData(ids, [1] * len(ids), [0.0] * len(ids), [-1] * len(ids), 0.0)
            mb = self._micro([s], [0], "all")
            lp = target_logprobs(self._logits(self.model, mb), mb.targets)
        finally:
            self.model.train(was_training)
        return lp.tolist()

    # training --------------------------------------------------------------------------------

    def _plan(self, seqs: list[SeqData], parts: list[list[int]]) -> list[list[MicroBatch]]:
        """Per mini-batch, this rank's micro-batches (padded with dummies to the same count on every rank)."""
        c = self.config
        lengths = [len(s.ids) for s in seqs]
        plan = []
        for part in parts:
            budget = c.micro_batch_tokens if c.packing else 1 << 62
            bins = [
                [part[i] for i in b]
                for b in pack_bins([lengths[i] for i in part], budget, c.micro_batch_size)
            ]
            per_rank = assign_bins(bins, lengths, self.world_size)
            n = max(len(b) for b in per_rank)
            mine = [self._micro(seqs, b, "loss") for b in per_rank[self.rank]]
            plan.append(mine + [self._dummy() for _ in range(n - len(mine))])
        return plan

    def _set_lr(self, factor: float) -> float:
        lr = self.config.lr * factor
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        return lr

    def train_step(
        self, batch: Sequence[Trajectory], config: TorchTrainerConfig | None = None
    ) -> dict[str, float]:
        try:
            return self._train_step(batch, config)
        finally:  # the step's activations and gradients are freed: give their pages back
            release_free_memory()

    def _train_step(
        self, batch: Sequence[Trajectory], config: TorchTrainerConfig | None = None
    ) -> dict[str, float]:
        if not batch:
            raise TrainerError("train_step called with an empty batch")
        c = self.config = config or self.config
        t0 = time.perf_counter()
        adv = batch_advantages(
            batch, c.advantage, gamma=c.gamma, step_weight=c.step_adv_weight, scale_by_std=c.scale_adv_by_std
        )
        # one sequence per trajectory, or per turn when each turn's prompt was the current state only
        seq_trajs, seq_adv = split_sequences(batch, adv)
        seqs = [seq_data(t, a, c.match_sampling) for t, a in zip(seq_trajs, seq_adv, strict=True)]
        n_tokens = sum(sum(s.mask[1:]) for s in seqs)
        if n_tokens == 0:
            raise TrainerError("batch has no generated tokens to train on")
        if c.loss_agg == "trajectory_mean":
            trajectory_weights(batch, seqs)
        train_idx = [i for i, s in enumerate(seqs) if any(s.mask[1:])]
        if c.skip_zero_adv:
            informative = [i for i in train_idx if _any_nonzero(seq_adv[i])]
            train_idx = informative or train_idx[:1]  # keep one sequence: the step still runs
        k = min(c.mini_batches, len(train_idx))
        parts = [train_idx[j * len(train_idx) // k : (j + 1) * len(train_idx) // k] for j in range(k)]
        part_tokens = [sum(sum(seqs[i].mask[1:]) * seqs[i].weight for i in p) for p in parts]
        plan = self._plan(seqs, parts)
        versions = torch.tensor(
            [v for s in seqs for v, m in zip(s.versions[1:], s.mask[1:], strict=True) if m]
        )
        stale = bool((versions != self.version).any())
        # proximal / reference logprobs: the weights before this step's first update
        prox = self._no_grad_logprobs(self.model, plan) if c.loss == "decoupled_ppo" and stale else None
        ref = self._no_grad_logprobs(self.ref_model, plan) if self.ref_model is not None else None
        lr = self._set_lr(lr_factor(c, self.version))
        if c.entropy_target is None:
            self.entropy_coef = c.entropy_coef
        entropy_coef = self.entropy_coef
        sums = torch.zeros(len(_STATS), dtype=torch.float64)
        grad_norms: list[float] = []
        for _epoch in range(c.ppo_epochs):
            for p, micros in enumerate(plan):
                self.optimizer.zero_grad(set_to_none=True)
                for m, mb in enumerate(micros):
                    self._sync_grads(m == len(micros) - 1)
                    loss, stats = self._micro_loss(
                        mb,
                        part_tokens[p],
                        None if prox is None else prox[p][m],
                        None if ref is None else ref[p][m],
                        entropy_coef,
                    )
                    (
                        loss * self.world_size
                    ).backward()  # FSDP averages over ranks; the loss is already a global mean
                    sums += torch.tensor(
                        [float(stats[s]) * part_tokens[p] for s in _STATS], dtype=torch.float64
                    )
                grad_norms.append(self._step())
        sums = self._all_reduce(sums)
        total_w = float(sum(part_tokens)) * c.ppo_epochs
        means = {s: float(v) / total_w for s, v in zip(_STATS, sums.tolist(), strict=True)}
        if c.entropy_target is not None:  # the same all-reduced entropy on every rank
            move = c.entropy_coef_step if means["entropy"] < c.entropy_target else -c.entropy_coef_step
            self.entropy_coef = min(max(self.entropy_coef + move, c.entropy_coef), c.entropy_coef_max)
        self.version += 1
        self.counters["samples_seen"] += len(batch)
        self.counters["tokens_seen"] += sum(len(s.ids) for s in seqs)
        lag = (self.version - 1 - versions).double()
        rewards = [t.reward for t in batch]
        return {
            **means,
            "entropy_coef": entropy_coef,
            "grad_norm": grad_norms[-1],
            "grad_norm_max": max(grad_norms),
            "lr": lr,
            "reward_mean": sum(rewards) / len(rewards),
            "train_tokens": float(n_tokens),
            "packed_tokens": float(sum(len(seqs[i].ids) for i in train_idx)),
            "micro_batches": float(sum(len(m) for m in plan)),
            "token_lag_mean": float(lag.mean()),
            "token_lag_max": float(lag.max()),
            "stale_token_frac": float((lag > 0).double().mean()),
            "proximal_recomputed": float(prox is not None),
            "optimizer_steps": float(self.counters["optimizer_steps"]),
            "skipped_steps": float(self.counters["skipped_steps"]),
            "train_s": time.perf_counter() - t0,
            "version": float(self.version),
        }

    def _sync_grads(self, sync: bool) -> None:
        if self.world_size > 1:
            self.model.set_requires_gradient_sync(sync)  # reduce-scatter only after the last micro-batch

    @torch.no_grad()
    def _no_grad_logprobs(
        self, model: torch.nn.Module, plan: list[list[MicroBatch]]
    ) -> list[list[torch.Tensor]]:
        out = []
        for micros in plan:
            row = []
            for mb in micros:
                row.append(target_logprobs(self._logits(model, mb), mb.targets))
            out.append(row)
        return out

    def _micro_loss(
        self,
        mb: MicroBatch,
        n: float,
        prox: torch.Tensor | None,
        ref: torch.Tensor | None,
        entropy_coef: float,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        logits = self._logits(self.model, mb)
        logp = target_logprobs(logits, mb.targets)
        return policy_loss(
            logp,
            logits,
            mb.behaviour,
            mb.advantages,
            mb.mask,
            self.config,
            n=n,
            entropy_coef=entropy_coef,
            proximal_logp=prox,
            versions=mb.versions,
            version=self.version,
            ref_logp=ref,
        )

    def _step(self) -> float:
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        value = float(norm)
        if not torch.isfinite(norm):
            log.warning("non-finite gradient norm %s: optimiser step skipped", value)
            self.optimizer.zero_grad(set_to_none=True)
            self.counters["skipped_steps"] += 1
            return value
        self.optimizer.step()
        self.counters["optimizer_steps"] += 1
        return value

    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return t
        import torch.distributed as dist

        buf = t.to(self.device)
        dist.all_reduce(buf)
        return buf.cpu()

    # weights and checkpoints -----------------------------------------------------------------

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors in HF naming (collective with several ranks: every rank must iterate). With
        LoRA served as an adapter: the adapters alone, PEFT-named, ``alpha / r`` folded into ``lora_B``
        (:func:`rollart_train.lora.served_adapter`); served merged: the full weights with the adapters
        folded in (:func:`rollart_train.lora.merged_weights`)."""
        if self.config.lora is not None:
            from rollart_train.lora import merged_weights, served_adapter

            served = served_adapter if self.config.lora.serve == "adapter" else merged_weights
            yield from served(self.model)
            return
        for name, t in self.model.state_dict().items():
            yield name, (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()

    def full_weights(self) -> dict[str, torch.Tensor] | None:
        """All full tensors on CPU on rank 0 (None elsewhere)."""
        out = {n: t.cpu() for n, t in self.named_weights()}
        return out if self.rank == 0 else None

    def save(self, path: str | Path, extra: dict[str, Any] | None = None) -> None:
        """HF directory (safetensors + config + tokenizer) plus optimiser state and counters.
        Written to a sibling temporary directory and renamed: a crash never leaves a half checkpoint."""
        from huggingface_hub import save_torch_state_dict
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        sd = cast(dict[str, torch.Tensor], get_model_state_dict(self.model, options=opts))
        osd = get_optimizer_state_dict(self.model, self.optimizer, options=opts)
        if self.rank != 0:
            return
        out = Path(path)
        tmp = staging_dir(out)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        if self.config.lora is not None:
            from rollart_train.lora import PEFT_PREFIX, adapter_config, is_lora_name, save_adapter_files

            lora = self.config.lora
            adapters = {PEFT_PREFIX + n: t for n, t in sd.items() if is_lora_name(n)}
            sd = {n: t for n, t in sd.items() if not is_lora_name(n)}  # the root stays a plain HF model
            cfg = adapter_config(lora.rank, lora.alpha, lora.target_modules, self.model_path)
            save_adapter_files(adapters, cfg, tmp / ADAPTER_DIR)
        save_torch_state_dict(sd, tmp, safe_serialization=True)
        self.model.config.save_pretrained(tmp)
        src = (
            self.resumed_from
            if self.resumed_from and not (self.model_path / "tokenizer.json").is_file()
            else self.model_path
        )
        copy_model_files(src, tmp, skip=("config.json",))
        torch.save({"optimizer": osd, "rng": torch.get_rng_state()}, tmp / OPTIM_FILE)
        state = {
            "format": 1,
            "version": self.version,
            **self.counters,
            "world_size": self.world_size,
            "entropy_coef": self.entropy_coef,
            "lora": None if self.config.lora is None else self.config.lora.model_dump(),
            "extra": extra if extra is not None else self.extra_state,
        }
        commit(tmp, out, state)

    def _load_state(self, ckpt: Path) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        state = read_state(ckpt)
        if (state.get("lora") is None) != (self.config.lora is None):
            raise ConfigError(
                f"{ckpt}: checkpoint of {'LoRA' if state.get('lora') else 'full'} fine-tuning, but the "
                f"trainer's lora is {self.config.lora}: resume with the same trainer lora setting"
            )
        blob = torch.load(ckpt / OPTIM_FILE, map_location="cpu", weights_only=True)
        set_optimizer_state_dict(
            self.model,
            self.optimizer,
            optim_state_dict=blob["optimizer"],
            options=StateDictOptions(full_state_dict=True),
        )
        torch.set_rng_state(blob["rng"])
        self.version = int(state["version"])
        for k in self.counters:
            self.counters[k] = int(state.get(k, 0))
        self.extra_state = dict(state.get("extra") or {})
        self.entropy_coef = float(state.get("entropy_coef", self.config.entropy_coef))
        log.info("resumed from %s at version %d", ckpt, self.version)

    def set_num_threads(self, n: int) -> None:
        _set_threads(n)

    def set_version(self, version: int) -> None:
        """Continue under ``version`` (a restarted worker group rebases the weights restored from an
        older checkpoint onto the version it had reached, so versions stay monotone)."""
        if version < 0:
            raise TrainerError(f"set_version: versions are >= 0, got {version}")
        self.version = version

    def state(self) -> dict[str, Any]:
        return {
            "version": self.version,
            **self.counters,
            "extra": self.extra_state,
            "entropy_coef": self.entropy_coef,
            "resumed_from": str(self.resumed_from) if self.resumed_from else None,
        }
