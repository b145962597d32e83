"""Spawned trainer ranks driven over pipes from the process that owns them (the :class:`TorchTrainer`).

Every rank is a ``spawn``-ed process running :func:`_rank_main`: it joins a process group
(gloo on CPU, NCCL on GPU; rendezvous on 127.0.0.1 and a free port; none for a single rank) and builds a
rank worker, :class:`~rollart_train.torch_rank.TorchRankWorker` by default (both through
:func:`rollart_train._rendezvous.start_rank_worker`, as a Ray group's rank actors do; the GPU check
drives :class:`~rollart_train.megatron_rank.MegatronRankWorker` ranks this way where Ray cannot
travel), then executes commands ``(method, args)`` from its pipe in order. The driver sends each command to every rank (the methods are collective), waits for all
answers and returns rank 0's. Tensors come back through torch's shared-memory pickling.

Why processes and pipes rather than Ray actors: the trainer must also work where Ray is not running
(a user's own RL stack, the unit tests), and the pipeline's default stays one in-process rank.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import traceback
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollart_core.errors import TrainerError
from rollart_core.malloc import limit_arenas
from rollart_core.types import Trajectory
from rollart_train._rendezvous import free_port, start_rank_worker
from rollart_train.torch_config import TorchTrainerConfig

if TYPE_CHECKING:
    import torch

__all__ = ["TORCH_WORKER", "SpawnedRanks", "free_port"]

log = logging.getLogger(__name__)
TORCH_WORKER = "rollart_train.torch_rank:TorchRankWorker"


def _rank_main(
    rank: int, world_size: int, port: int, conn: Any, config: Any, model_path: str, worker_path: str
) -> None:
    import torch.distributed as dist

    # the driver owns this process's life (close, or EOF when it dies): a terminal's Ctrl-C, sent to
    # the whole foreground process group, must not kill a rank mid-step while the driver shuts down
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    limit_arenas()  # before torch's threads start (rollart_core.malloc says why)
    os.environ["LOCAL_RANK"] = str(rank)
    try:
        worker = start_rank_worker(
            worker_path,
            config,
            model_path,
            rank=rank,
            world_size=world_size,  # one spawned rank alone (``spawn: true``) joins no process group
            master=("127.0.0.1", port),
            num_threads=max(1, (os.cpu_count() or 1) // world_size),
        )
        conn.send(("ok", worker.state()))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    try:
        while True:
            try:
                method, args = conn.recv()
            except EOFError:
                break
            if method == "close":
                conn.send(("ok", None))
                break
            try:
                result = getattr(worker, method)(*args)
                conn.send(("ok", result if rank == 0 else None))
            except Exception:
                conn.send(("error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _shutdown(procs: list[Any], conns: list[Any]) -> None:
    for c in conns:
        try:
            c.send(("close", ()))
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + 20
    for p in procs:
        p.join(timeout=max(0.1, deadline - time.monotonic()))
        if p.is_alive():
            p.terminate()
            p.join(timeout=5)
    for c in conns:
        c.close()


class SpawnedRanks:
    """``config.world_size`` trainer ranks in child processes, driven as one :class:`RankWorker
    <rollart_train._rendezvous.RankWorker>`: each call goes to every rank, rank 0 answers.
    ``worker``: the rank class as ``"module:Class"`` (its config has ``world_size`` and
    ``rank_timeout_s``)."""

    def __init__(
        self, config: TorchTrainerConfig | Any, model_path: str | Path, worker: str = TORCH_WORKER
    ) -> None:
        import torch.multiprocessing as mp

        self.timeout = config.rank_timeout_s
        ctx = mp.get_context("spawn")
        port = free_port()
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        for rank in range(config.world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=_rank_main,
                name=f"rollart-train-rank{rank}",
                daemon=True,
                args=(rank, config.world_size, port, child, config, str(model_path), worker),
            )
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)
        self._finalizer = weakref.finalize(self, _shutdown, self.procs, self.conns)
        try:
            self.initial_state: dict[str, Any] = self._gather("start")
        except BaseException:
            self.close()
            raise

    # the rank worker's calls (RankWorker), each sent to every rank; rank 0 answers

    def train_step(self, batch: Sequence[Trajectory], config: Any = None) -> dict[str, float]:
        return dict(self._collective("train_step", list(batch), config))

    def full_weights(self) -> dict[str, torch.Tensor] | None:
        weights: dict[str, torch.Tensor] | None = self._collective("full_weights")
        return weights

    def logprobs(self, token_ids: Sequence[int]) -> list[float]:
        return list(self._collective("logprobs", list(token_ids)))

    def save(self, path: str | Path, extra: dict[str, Any] | None = None) -> None:
        self._collective("save", str(path), extra)

    def set_version(self, version: int) -> None:
        self._collective("set_version", version)

    def set_num_threads(self, n: int) -> None:
        self._collective("set_num_threads", n)

    def state(self) -> dict[str, Any]:
        return dict(self._collective("state"))

    def _collective(self, method: str, *args: Any) -> Any:
        """``method(*args)`` on every rank (the rank processes dispatch it by name, ``_rank_main``)."""
        if not self._finalizer.alive:
            raise TrainerError("the trainer's ranks are closed")
        for rank, (c, p) in enumerate(zip(self.conns, self.procs, strict=True)):
            try:
                c.send((method, args))
            except (OSError, ValueError) as exc:  # its end of the pipe is gone: the rank died
                p.join(timeout=1)
                self.close()
                raise TrainerError(
                    f"{method}: rank {rank} died (exit code {p.exitcode}); all ranks stopped"
                ) from exc
        return self._gather(method)

    def _gather(self, what: str) -> Any:
        """Rank answers in rank order. If some rank fails while others still wait in a collective,
        the others get a short grace period, then every rank is stopped (their state diverged)."""
        deadline = time.monotonic() + self.timeout
        results: dict[int, tuple[str, Any]] = {}
        failed_at: float | None = None
        while len(results) < len(self.conns):
            for rank, (c, p) in enumerate(zip(self.conns, self.procs, strict=True)):
                if rank in results:
                    continue
                if c.poll(0.05):
                    try:
                        results[rank] = c.recv()
                    except (EOFError, OSError):  # it died: poll() saw the pipe close
                        p.join(timeout=1)
                        results[rank] = ("error", f"process died (exit code {p.exitcode})")
                    if results[rank][0] != "ok" and failed_at is None:
                        failed_at = time.monotonic()
                elif not p.is_alive():
                    results[rank] = ("error", f"process died (exit code {p.exitcode})")
                    failed_at = failed_at or time.monotonic()
            now = time.monotonic()
            if len(results) < len(self.conns) and (
                now > deadline or (failed_at is not None and now - failed_at > 10)
            ):
                self.close()
                missing = sorted(set(range(len(self.conns))) - set(results))
                detail = "\n".join(f"rank {r}:\n{v}" for r, (st, v) in sorted(results.items()) if st != "ok")
                raise TrainerError(f"{what}: ranks {missing} did not answer; all ranks stopped\n{detail}")
        errors = [
            f"rank {r}:\n{payload}" for r, (status, payload) in sorted(results.items()) if status != "ok"
        ]
        if errors:
            raise TrainerError(f"{what} failed on {len(errors)} rank(s):\n" + "\n".join(errors))
        return results[0][1]

    @property
    def pids(self) -> list[int]:
        return [int(p.pid) for p in self.procs]

    def close(self) -> None:
        self._finalizer()
