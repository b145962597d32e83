"""Starting one trainer rank: join the process group at rank 0's address, then build the rank worker.

Every way rollart starts ranks goes through :func:`start_rank_worker`: the rank actors of a
:class:`~rollart_train.RayTrainerGroup`, the spawned ranks of a multi-rank
:class:`~rollart_train.TorchTrainer` (:mod:`rollart_train._multirank`) and the ranks that
``integration/gpu/megatron_check.py`` spawns on a GPU machine (where Ray cannot travel), so the code a
GPU check runs is the code the group runs. The rendezvous is torchrun's: ``MASTER_ADDR``,
``MASTER_PORT``, ``RANK`` and ``WORLD_SIZE`` in the environment and ``init_method="env://"``.

A rank worker (:class:`RankWorker`) is any class built as ``cls(config, model_path, rank=r,
world_size=n)`` whose methods are collective (every rank calls them with the same arguments). Three
drivers call them: in process (one rank of a :class:`~rollart_train.TorchTrainer`), over pipes
(:class:`~rollart_train._multirank.SpawnedRanks`, itself a :class:`RankWorker` for its caller) and as
a Ray actor's methods (:class:`~rollart_train._rank_actor._RankActor`).
"""

from __future__ import annotations

import datetime
import importlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from rollart_core.serving import free_port
from rollart_core.types import Trajectory

if TYPE_CHECKING:
    import torch

__all__ = ["RankWorker", "backend_for", "free_port", "join_process_group", "load", "start_rank_worker"]


class RankWorker(Protocol):
    """One trainer rank's collective calls; rank 0's answer is the group's (others may return None)."""

    def train_step(self, batch: Sequence[Trajectory], config: Any = None) -> dict[str, float]:
        """One optimizer step (or several: mini-batches, epochs) on ``batch``; ``config``: the trainer's
        current config where the worker takes one (options changed since it started)."""
        ...

    def full_weights(self) -> dict[str, torch.Tensor] | None:
        """Every full tensor in Hugging Face naming, on CPU, on rank 0 (None elsewhere)."""
        ...

    def logprobs(self, token_ids: Sequence[int]) -> list[float]: ...

    def save(self, path: str | Path, extra: dict[str, Any] | None = None) -> None: ...

    def set_version(self, version: int) -> None: ...

    def set_num_threads(self, n: int) -> None: ...

    def state(self) -> dict[str, Any]:
        """``version`` and counters (and what the worker adds, e.g. its parallel layout)."""
        ...


def load(path: str) -> Any:
    """The object a ``"module:attr"`` path names."""
    module, attr = path.split(":")
    return getattr(importlib.import_module(module), attr)


def backend_for(config: Any) -> str:
    """The collective back-end for a rank config: its ``dist_backend`` unless ``auto`` (the torch
    config has none), else NCCL on CUDA and gloo on CPU."""
    choice = getattr(config, "dist_backend", "auto")
    if choice != "auto":
        return str(choice)
    return "nccl" if config.device == "cuda" else "gloo"


def join_process_group(
    *, rank: int, world_size: int, master: tuple[str, int], backend: str, timeout_s: float
) -> None:
    """``torch.distributed.init_process_group`` at ``master`` (rank 0's node address and port)."""
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR=master[0], MASTER_PORT=str(master[1]), RANK=str(rank), WORLD_SIZE=str(world_size)
    )
    dist.init_process_group(
        backend,
        init_method="env://",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def start_rank_worker(
    worker_path: str,
    config: Any,
    model_path: str | Path,
    *,
    rank: int,
    world_size: int,
    master: tuple[str, int],
    version: int | None = None,
    num_threads: int = 1,
) -> RankWorker:
    """Set threads and device, join the process group (none for a world of one: the worker decides),
    build the rank worker ``worker_path`` names, and continue it under ``version`` if given."""
    import torch

    torch.set_num_threads(config.num_threads or num_threads)
    if config.device == "cuda":
        # one GPU per rank where each rank sees its own; ranks sharing one GPU (gloo) all use it
        torch.cuda.set_device(rank % torch.cuda.device_count())
    if world_size > 1:
        join_process_group(
            rank=rank,
            world_size=world_size,
            master=master,
            backend=backend_for(config),
            timeout_s=config.rank_timeout_s,
        )
    worker = load(worker_path)(config, model_path, rank=rank, world_size=world_size)
    if version is not None:
        worker.set_version(version)
    return worker
