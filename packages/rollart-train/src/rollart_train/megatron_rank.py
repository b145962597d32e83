"""One rank of a Megatron worker group: :class:`MegatronRankWorker` (``RayTrainerGroup`` ``worker: megatron``).

The group (or any launcher: ``integration/gpu/megatron_check.py`` spawns ranks with
:func:`rollart_train._rendezvous.start_rank_worker`, the function the group's rank actors call) has
joined the process group already at rank 0's node address (NCCL with ``device: cuda``, gloo on CPU;
a world of one joins none and the trainer forms its own). The worker then sets up Megatron's parallel
groups from the config (``tensor_parallel``, ``pipeline_parallel``; data parallelism is the rest of
the ranks), builds a :class:`~rollart_train.megatron_trainer.MegatronTrainer` in the rank and delegates.
Every method is collective: all ranks call it with the same arguments, and the group returns rank 0's
answer.

Checkpoints (``save``) hold the full Hugging Face weights (gathered on rank 0) and each rank's
optimizer state; a rank built with ``resume_from`` (the group's restart path) restores the weights and
the version on any layout, and the optimizer state when TP / PP / DP and the device are unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from rollart_core.errors import ConfigError, TrainerError
from rollart_core.types import Trajectory
from rollart_train.megatron_config import MegatronTrainerConfig
from rollart_train.megatron_trainer import MegatronTrainer

__all__ = ["MegatronRankWorker"]


class MegatronRankWorker:
    """The rank-worker interface of :mod:`rollart_train._rendezvous` over a :class:`MegatronTrainer`."""

    def __init__(
        self, config: MegatronTrainerConfig, model_path: str | Path, *, rank: int = 0, world_size: int = 1
    ) -> None:
        import torch.distributed as dist

        if config.world_size is not None and config.world_size != world_size:
            raise ConfigError(
                f"MegatronRankWorker: config.world_size ({config.world_size}) != world_size ({world_size})"
            )
        self.config, self.rank, self.world_size = config, rank, world_size
        self.trainer = MegatronTrainer(
            config.model_copy(update={"world_size": world_size}), model_path=model_path
        )
        if dist.get_rank() != rank or dist.get_world_size() != world_size:
            raise TrainerError(
                f"rank {rank} of {world_size} joined the process group as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}"
            )

    @property
    def version(self) -> int:
        return self.trainer.version

    def parallel_layout(self) -> dict[str, int]:
        """This rank's place in the TP x PP x DP grid (``tp_rank``, ``pp_rank``, ``dp_rank``, sizes)."""
        t = self.trainer
        return {
            "rank": self.rank,
            "tp_rank": t.tp_rank,
            "pp_rank": t.pp_rank,
            "dp_rank": t.dp_rank,
            "tp": self.config.tensor_parallel,
            "pp": self.config.pipeline_parallel,
            "dp": t.dp_size,
        }

    def train_step(self, batch: Sequence[Trajectory], config: Any = None) -> dict[str, float]:
        """``config``: not taken (the Megatron trainer keeps the config it was built with)."""
        return self.trainer.train_step(batch)

    def full_weights(self) -> dict[str, torch.Tensor] | None:
        """All full tensors in HF naming, on CPU, on rank 0 (None elsewhere)."""
        weights = dict(self.trainer.named_weights())  # every rank iterates: the gathers are collective
        return weights if self.rank == 0 else None

    def logprobs(self, token_ids: Sequence[int]) -> list[float]:
        return self.trainer.logprobs(token_ids)

    def save(self, path: str | Path, extra: dict[str, Any] | None = None) -> None:
        self.trainer.save(path, extra)

    def set_version(self, version: int) -> None:
        self.trainer.set_version(version)

    def set_num_threads(self, n: int) -> None:
        torch.set_num_threads(n)

    def state(self) -> dict[str, Any]:
        return {**self.trainer.state(), "layout": self.parallel_layout()}

    def close(self) -> None:
        """Leave Megatron's parallel groups and the process group (a rank process that lives on)."""
        import torch.distributed as dist
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
