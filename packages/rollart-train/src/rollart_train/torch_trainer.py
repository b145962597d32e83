"""TorchTrainer: a Hugging Face causal LM trained with GRPO advantages and PPO-clip / decoupled PPO.

It implements rollart's Trainer protocol (``version``, ``train_step``, ``named_weights``, ``save``)
over one or several ranks:

- ``world_size: 1`` (default): one in-process :class:`~rollart_train.torch_rank.TorchRankWorker`,
  no process group, no extra process; with ``spawn: true`` the one rank runs in a spawned process
  (the caller's GIL and event loop stay free while it trains).
- ``world_size: N``: N spawned processes form a process group (gloo on CPU, NCCL on GPU) and shard
  the model with FSDP2; this object sends every call to all of them (:mod:`rollart_train._multirank`)
  and returns rank 0's answer. ``named_weights`` gathers full tensors (``DTensor.full_tensor``).

Checkpoints are Hugging Face directories (safetensors) plus optimiser state and counters; a trainer
built with ``resume_from`` (or :meth:`TorchTrainer.resume`) continues at the saved version with the
saved optimiser state, on any world size.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rollart_core.errors import TrainerError
from rollart_core.types import Trajectory
from rollart_train._rendezvous import RankWorker
from rollart_train.torch_config import TorchTrainerConfig
from rollart_train.torch_rank import TorchRankWorker, find_checkpoint

if TYPE_CHECKING:
    from rollart_train._multirank import SpawnedRanks

__all__ = ["TorchTrainer", "TorchTrainerConfig"]


class TorchTrainer:
    Config = TorchTrainerConfig

    def __init__(self, config: TorchTrainerConfig | None = None, *, model_path: str | Path) -> None:
        self.config = config or TorchTrainerConfig()
        self.model_path = Path(model_path)
        self._start()

    def _start(self) -> None:
        """The ranks of ``self.config``: one in process, or spawned (:class:`RankWorker` either way)."""
        c = self.config
        self._local: TorchRankWorker | None = None
        self._spawned: SpawnedRanks | None = None
        self._ranks: RankWorker
        if c.world_size == 1 and not c.spawn:
            self._ranks = self._local = TorchRankWorker(c, self.model_path)
        else:
            from rollart_train._multirank import SpawnedRanks

            self._ranks = self._spawned = SpawnedRanks(c, self.model_path)
        state = self._ranks.state()
        self.version: int = int(state["version"])
        self.resumed_state: dict[str, Any] = state
        """Counters and the ``extra`` dict of the checkpoint resumed from (empty ``extra`` otherwise)."""

    @classmethod
    def resume(
        cls,
        path: str | Path,
        config: TorchTrainerConfig | None = None,
        *,
        model_path: str | Path | None = None,
    ) -> TorchTrainer:
        """A trainer continuing from checkpoint ``path`` (or the newest ``checkpoint-<n>`` inside it)."""
        ckpt = find_checkpoint(path)
        c = (config or TorchTrainerConfig()).model_copy(update={"resume_from": str(ckpt)})
        return cls(c, model_path=model_path or ckpt)

    def load(self, path: str | Path) -> None:
        """Continue from a checkpoint written by :meth:`save` (weights, optimizer, version, counters);
        the control plane's ``SupportsResume``. The ranks are started again from it."""
        ckpt = find_checkpoint(path)
        self.close()
        self.config = self.config.model_copy(update={"resume_from": str(ckpt)})
        self._start()

    @property
    def model(self) -> torch.nn.Module:
        """The module itself (one in-process rank only)."""
        if self._local is None:
            raise TrainerError("the model lives in the spawned ranks (world_size > 1 or spawn)")
        return self._local.model

    @property
    def pids(self) -> list[int]:
        """Process ids of the spawned ranks (empty for one in-process rank)."""
        return self._spawned.pids if self._spawned is not None else []

    def logprobs(self, token_ids: Sequence[int]) -> list[float]:
        """Logprob of each token given the previous ones under the current weights (first: none)."""
        return self._ranks.logprobs(list(token_ids))

    def train_step(self, batch: Sequence[Trajectory]) -> dict[str, float]:
        if not batch:
            raise TrainerError("train_step called with an empty batch")
        metrics = self._ranks.train_step(list(batch), self.config)
        self.version = int(metrics["version"])
        return metrics

    def set_num_threads(self, n: int) -> None:
        """torch intra-op threads of every rank from now on (in process: the caller's whole process).
        Lets a caller move cores between training and generation, e.g. all of them while rollout is
        idle (Sync+) and half while both run (async) on a machine they share."""
        if n < 1:
            raise TrainerError(f"set_num_threads: need at least 1 thread, got {n}")
        self._ranks.set_num_threads(n)

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        if self._local is not None:
            return self._local.named_weights()
        weights = self._ranks.full_weights()
        if weights is None:
            raise TrainerError("rank 0 returned no weights")
        return iter(weights.items())

    def save(self, path: str | Path, extra: dict[str, Any] | None = None) -> None:
        """Checkpoint to ``path``; ``extra`` (JSON) is stored with it and comes back in
        :attr:`resumed_state` after a resume (e.g. the caller's data-loader position)."""
        self._ranks.save(str(path), extra)

    def close(self) -> None:
        """Stop the spawned ranks (nothing to do in-process). Idempotent."""
        if self._spawned is not None:
            self._spawned.close()

    def __enter__(self) -> TorchTrainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
