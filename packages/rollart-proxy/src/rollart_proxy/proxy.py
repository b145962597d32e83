"""LLMProxy: per-trajectory dispatch of single turns to inference workers.

Every turn of every trajectory is one request, routed on its own: a slow trajectory never holds
a batch. Routing, in order: the task's pool (only workers of that pool), session stickiness (the
worker that served the trajectory's previous turn holds its prefix cache), then the least
outstanding requests. Each worker has an in-flight limit (back-pressure instead of an unbounded
queue). A worker that fails a request with a non-request error is retried elsewhere in its pool.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rollart_core.errors import EngineError
from rollart_core.protocols import InferenceEngine, PauseMode
from rollart_core.types import GenerateOutput, GenerateRequest

__all__ = ["LLMProxy", "WorkerHandle"]

log = logging.getLogger(__name__)


@dataclass
class WorkerHandle:
    name: str
    engine: InferenceEngine
    pool: str = "default"
    max_inflight: int = 64
    inflight: int = 0
    healthy: bool = True
    served: int = 0
    _slots: asyncio.Semaphore = field(init=False)

    def __post_init__(self) -> None:
        self._slots = asyncio.Semaphore(self.max_inflight)


class LLMProxy:
    """Routes :class:`GenerateRequest` s to workers; also fans out pause/resume/weight updates."""

    def __init__(
        self,
        workers: Mapping[str, InferenceEngine] | list[WorkerHandle],
        *,
        task_pools: Mapping[str, str] | None = None,
        max_retries: int = 2,
    ) -> None:
        if isinstance(workers, Mapping):
            handles = [WorkerHandle(n, e) for n, e in workers.items()]
        else:
            handles = list(workers)
        if not handles:
            raise EngineError("LLMProxy needs at least one worker")
        self.workers = {w.name: w for w in handles}
        self.task_pools = dict(task_pools or {})
        self.max_retries = max_retries
        self._session: dict[str, str] = {}
        self._request_worker: dict[str, str] = {}

    @classmethod
    def from_ray_actors(
        cls, actors: list[tuple[str, Any, str]], *, task_pools: Mapping[str, str] | None = None, **kwargs: Any
    ) -> LLMProxy:
        """Proxy over engines living in Ray actors: ``(name, actor handle, pool)`` each."""
        from rollart_proxy.ray_engine import RayActorEngine

        handles = [WorkerHandle(name, RayActorEngine(h, name), pool) for name, h, pool in actors]
        return cls(handles, task_pools=task_pools, **kwargs)

    def _candidates(self, task: str | None) -> list[WorkerHandle]:
        pool = self.task_pools.get(task) if task else None
        ws = [w for w in self.workers.values() if w.healthy and (pool is None or w.pool == pool)]
        if not ws:
            raise EngineError(f"no healthy worker for task {task!r} (pool {pool!r})")
        return ws

    def _pick(self, request: GenerateRequest, exclude: set[str]) -> WorkerHandle:
        cands = [w for w in self._candidates(request.task) if w.name not in exclude]
        if not cands:
            raise EngineError(f"request {request.request_id}: every worker of its pool failed")
        sticky = self._session.get(request.session_id) if request.session_id else None
        for w in cands:
            if w.name == sticky and w.inflight < w.max_inflight:
                return w
        return min(cands, key=lambda w: (w.inflight / w.max_inflight, w.served))

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        tried: set[str] = set()
        while True:
            w = self._pick(request, tried)
            async with w._slots:
                w.inflight += 1
                self._request_worker[request.request_id] = w.name
                try:
                    out = await w.engine.generate(request)
                except EngineError:
                    raise  # the request itself is bad: retrying elsewhere would fail the same way
                except Exception as exc:
                    tried.add(w.name)
                    log.warning("worker %s failed request %s: %r", w.name, request.request_id, exc)
                    if len(tried) > self.max_retries:
                        raise EngineError(f"request {request.request_id} failed on {sorted(tried)}: {exc}") from exc
                    continue
                finally:
                    w.inflight -= 1
                    self._request_worker.pop(request.request_id, None)
            w.served += 1
            if request.session_id:
                self._session[request.session_id] = w.name
            return out

    async def abort(self, request_id: str) -> None:
        name = self._request_worker.get(request_id)
        if name is not None:
            await self.workers[name].engine.abort(request_id)

    def end_session(self, session_id: str) -> None:
        self._session.pop(session_id, None)

    async def _all(self, method: str, *args: object) -> list[object]:
        return list(await asyncio.gather(*(getattr(w.engine, method)(*args) for w in self.workers.values())))

    async def pause(self, mode: PauseMode = "keep") -> None:
        await self._all("pause", mode)

    async def resume(self) -> None:
        await self._all("resume")

    async def update_weights(self, version: int) -> dict[str, float]:
        """Every worker loads ``version``; returns each worker's generation pause in seconds."""
        paused = await self._all("update_weights", version)
        return dict(zip(self.workers, (float(p) for p in paused), strict=True))  # type: ignore[arg-type]

    async def weight_versions(self) -> dict[str, int]:
        vs = await self._all("weight_version")
        return dict(zip(self.workers, (int(v) for v in vs), strict=True))  # type: ignore[call-overload]
