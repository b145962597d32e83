"""The rank actor of :class:`~rollart_train.ray_group.RayTrainerGroup`: one rank's rendezvous and
its rank worker's collective calls, in a Ray actor (imports neither ray nor torch until called)."""

from __future__ import annotations

import os
import time
from typing import Any

from rollart_core.malloc import limit_arenas
from rollart_train._rendezvous import RankWorker, free_port, start_rank_worker


class _RankActor:
    """One rank in its Ray actor: rendezvous, then the rank worker's methods (collective)."""

    def __init__(self, rank: int) -> None:
        limit_arenas()  # before the rank's threads start (rollart_core.malloc says why)
        self.rank = rank
        self._worker: RankWorker | None = None
        self.store: Any = None

    def identity(self) -> tuple[int, str]:
        import ray

        return os.getpid(), ray.get_runtime_context().get_node_id()

    def address(self) -> tuple[str, int]:
        """This node's IP and a port free on it (rank 0: the process group's rendezvous)."""
        import ray

        ip = ray.util.get_node_ip_address()
        return ip, free_port(ip)

    def setup(
        self,
        worker_path: str,
        config: Any,
        model_path: str,
        world_size: int,
        master: tuple[str, int],
        store: Any,
        version: int | None,
        num_threads: int,
    ) -> dict[str, Any]:
        self._worker = start_rank_worker(
            worker_path,
            config,
            model_path,
            rank=self.rank,
            world_size=world_size,
            master=master,
            version=version,
            num_threads=num_threads,
        )
        self.store = store
        return self._worker.state()

    @property
    def worker(self) -> RankWorker:
        if self._worker is None:
            raise RuntimeError(f"rank {self.rank}: setup() was not called")
        return self._worker

    # The rank worker's collective methods: every rank runs each, rank 0 answers for the group.

    def train_step(self, batch: Any) -> Any:
        return self._answer(self.worker.train_step(batch))

    def full_weights(self) -> Any:
        return self._answer(self.worker.full_weights())

    def logprobs(self, ids: list[int]) -> Any:
        return self._answer(self.worker.logprobs(ids))

    def set_num_threads(self, n: int) -> None:
        self.worker.set_num_threads(n)

    def save(self, path: str, extra: Any) -> None:
        self.worker.save(path, extra)

    def _answer(self, result: Any) -> Any:
        return result if self.rank == 0 else None

    def push_weights(self, version: int) -> dict[str, float] | None:
        t0 = time.perf_counter()
        weights = self.worker.full_weights()  # collective; the full dict on rank 0 only
        if self.rank != 0 or weights is None:
            return None
        gathered = time.perf_counter()
        self.store.push(version, weights).result()
        return {
            "push_s": time.perf_counter() - t0,
            "push_gather_s": gathered - t0,
            "push_bytes": float(sum(t.numel() * t.element_size() for t in weights.values())),
        }
