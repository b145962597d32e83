"""LLMProxy: per-trajectory dispatch of single turns to inference workers.

Every turn of every trajectory is one request, routed on its own: a slow trajectory never holds
a batch. Routing, in order:

1. the task's pool: a task is routed only to workers of the pool it declares (``task_pools``);
2. session stickiness: the worker that served the trajectory's previous turn holds its prefix
   cache; it is kept unless it is gone (unhealthy) or overloaded (all its in-flight slots taken);
3. least outstanding requests (in flight + queued, relative to the worker's limit).

Each worker has an in-flight limit (back-pressure: a request waits for a slot instead of piling up
in the engine). A worker that fails a request (:class:`WorkerUnavailableError`, or any error that
is not a request error) is marked unhealthy and the request is retried on another worker of its
pool, at most ``max_retries`` times; then the request fails with :class:`WorkerUnavailableError`
(an :class:`~rollart_core.errors.EngineError`). A request error (:class:`EngineError`) is raised
at once. Unhealthy workers are probed again by :meth:`LLMProxy.check_health`.

Suspend/resume and weight updates fan out to every worker; a weight update never aborts requests.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rollart_core.errors import EngineError
from rollart_core.protocols import InferenceEngine, PauseMode, SupportsStream
from rollart_core.types import GenerateOutput, GenerateRequest
from rollart_proxy.errors import WorkerUnavailableError
from rollart_proxy.metrics import WorkerMetrics

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
    metrics: WorkerMetrics = field(default_factory=WorkerMetrics)
    _slots: asyncio.Semaphore = field(init=False)

    def __post_init__(self) -> None:
        if self.max_inflight < 1:
            raise EngineError(f"worker {self.name}: max_inflight must be >= 1")
        self._slots = asyncio.Semaphore(self.max_inflight)

    @property
    def outstanding(self) -> int:
        return self.inflight + self.metrics.queued


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
        if len(self.workers) != len(handles):
            raise EngineError("worker names must be unique")
        self.task_pools = dict(task_pools or {})
        pools = {w.pool for w in handles}
        unknown = {t: p for t, p in self.task_pools.items() if p not in pools}
        if unknown:
            raise EngineError(f"tasks routed to pools without workers: {unknown} (pools: {sorted(pools)})")
        self.max_retries = max_retries
        self._session: dict[str, str] = {}
        self._request_worker: dict[str, str] = {}
        self._session_requests: dict[str, set[str]] = {}
        self._aborted: set[str] = set()
        self.suspended = False

    @classmethod
    def from_ray_actors(
        cls,
        actors: list[tuple[str, Any, str]],
        *,
        task_pools: Mapping[str, str] | None = None,
        max_inflight: int = 64,
        **kwargs: Any,
    ) -> LLMProxy:
        """Proxy over engines living in Ray actors: ``(name, actor handle, pool)`` each."""
        from rollart_proxy.ray_engine import RayActorEngine

        handles = [WorkerHandle(name, RayActorEngine(h, name), pool, max_inflight) for name, h, pool in actors]
        return cls(handles, task_pools=task_pools, **kwargs)

    # routing ---------------------------------------------------------------------------------

    def pool_of(self, task: str | None) -> str | None:
        return self.task_pools.get(task) if task else None

    def _candidates(self, task: str | None) -> list[WorkerHandle]:
        pool = self.pool_of(task)
        ws = [w for w in self.workers.values() if w.healthy and (pool is None or w.pool == pool)]
        if not ws:
            raise WorkerUnavailableError(f"no healthy worker for task {task!r} (pool {pool!r})")
        return ws

    def _pick(self, request: GenerateRequest, exclude: set[str]) -> WorkerHandle:
        cands = [w for w in self._candidates(request.task) if w.name not in exclude]
        if not cands:
            raise WorkerUnavailableError(f"request {request.request_id}: every worker of its pool failed")
        sticky = self._session.get(request.session_id) if request.session_id else None
        for w in cands:
            if w.name == sticky and w.inflight < w.max_inflight:
                return w
        return min(cands, key=lambda w: (w.outstanding / w.max_inflight, w.outstanding, w.served))

    # generation ------------------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        return await self._dispatch(request, None)

    async def generate_stream(self, request: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        """Like :meth:`generate`, yielding token deltas first (``finish_reason == ""``) and the
        complete output last (see :class:`~rollart_core.protocols.SupportsStream`). Engines that
        cannot stream yield only the complete output. A worker failure is retried elsewhere only
        while nothing has been yielded. Closing the iterator early aborts the request."""
        deltas: asyncio.Queue[GenerateOutput] = asyncio.Queue()
        task = asyncio.create_task(self._dispatch(request, deltas.put_nowait))
        try:
            while True:
                get = asyncio.ensure_future(deltas.get())
                await asyncio.wait({get, task}, return_when=asyncio.FIRST_COMPLETED)
                if get.done():
                    yield get.result()
                    continue
                get.cancel()
                while not deltas.empty():
                    yield deltas.get_nowait()
                yield task.result()
                return
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def _dispatch(self, request: GenerateRequest, on_delta: Callable[[GenerateOutput], None] | None
                        ) -> GenerateOutput:
        tried: set[str] = set()
        sid = request.session_id
        if sid:
            self._session_requests.setdefault(sid, set()).add(request.request_id)
        try:
            while True:
                try:
                    w = self._pick(request, tried)
                except WorkerUnavailableError:
                    # Workers marked unhealthy may have come back: probe once before failing.
                    if not await self.check_health():
                        raise
                    w = self._pick(request, tried)
                streamed: list[int] = []
                try:
                    out = await self._run_on(w, request, on_delta, streamed)
                except WorkerUnavailableError as exc:
                    self._worker_failed(w, request, exc)
                    if streamed:
                        raise  # the client has seen tokens of this attempt: a retry would repeat them
                except EngineError:
                    raise  # the request itself is bad: retrying elsewhere would fail the same way
                except Exception as exc:
                    self._worker_failed(w, request, exc)
                    if streamed:
                        raise WorkerUnavailableError(f"{w.name} failed mid-stream: {exc!r}") from exc
                else:
                    w.served += 1
                    if sid:
                        self._session[sid] = w.name
                    return out
                tried.add(w.name)
                if len(tried) > self.max_retries:
                    raise WorkerUnavailableError(
                        f"request {request.request_id} failed on {sorted(tried)} (max_retries={self.max_retries})"
                    )
        finally:
            self._aborted.discard(request.request_id)
            if sid and sid in self._session_requests:
                self._session_requests[sid].discard(request.request_id)

    async def _run_on(self, w: WorkerHandle, request: GenerateRequest,
                      on_delta: Callable[[GenerateOutput], None] | None = None,
                      streamed: list[int] | None = None) -> GenerateOutput:
        self._request_worker[request.request_id] = w.name  # abortable while queued, too
        w.metrics.queued += 1
        try:
            await w._slots.acquire()
        except BaseException:
            self._request_worker.pop(request.request_id, None)
            raise
        finally:
            w.metrics.queued -= 1
        w.inflight += 1
        try:
            if request.request_id in self._aborted:  # aborted while it waited for a slot
                out = GenerateOutput(request.request_id, [], [], [], "abort", w.name)
            else:
                try:
                    if on_delta is not None and isinstance(w.engine, SupportsStream):
                        out = await self._stream_from(w.engine, request, on_delta, streamed)
                    else:
                        out = await w.engine.generate(request)
                except asyncio.CancelledError:
                    # The caller gave up (redundant or stale trajectory). Cancelling our await does not
                    # stop a remote engine (e.g. a Ray actor call): abort it there to free its slot.
                    await asyncio.shield(self._abort_on(w, request.request_id))
                    raise
            w.metrics.record(len(request.prompt_ids), len(out.token_ids), out.finish_reason)
            return out
        finally:
            w.inflight -= 1
            w._slots.release()
            self._request_worker.pop(request.request_id, None)

    @staticmethod
    async def _stream_from(engine: SupportsStream, request: GenerateRequest,
                           on_delta: Callable[[GenerateOutput], None], streamed: list[int] | None) -> GenerateOutput:
        it = engine.generate_stream(request)
        try:
            async for part in it:
                if part.finish_reason:
                    return part
                on_delta(part)
                if streamed is not None:
                    streamed.append(len(part.token_ids))
        finally:
            await it.aclose()  # type: ignore[attr-defined]
        raise WorkerUnavailableError(f"request {request.request_id}: stream ended without a complete output")

    async def _abort_on(self, w: WorkerHandle, request_id: str) -> None:
        try:
            await w.engine.abort(request_id)
        except Exception as exc:  # it may have finished meanwhile, or the worker is gone
            log.debug("abort of %s on %s failed: %r", request_id, w.name, exc)

    def _worker_failed(self, w: WorkerHandle, request: GenerateRequest, exc: BaseException) -> None:
        w.healthy = False
        w.metrics.failures += 1
        if request.session_id and self._session.get(request.session_id) == w.name:
            self._session.pop(request.session_id)
        log.warning("worker %s failed request %s (marked unhealthy): %r", w.name, request.request_id, exc)

    async def abort(self, request_id: str) -> int:
        """Abort a request by its id, or every in-flight request of a trajectory by its session id.

        Aborted requests return with ``finish_reason == "abort"`` and the tokens generated so far.
        Returns how many requests were aborted.
        """
        ids = [request_id] if request_id in self._request_worker else sorted(self._session_requests.get(request_id, ()))
        for rid in ids:
            self._aborted.add(rid)
            name = self._request_worker.get(rid)
            if name is not None:
                await self.workers[name].engine.abort(rid)
        return len(ids)

    def end_session(self, session_id: str) -> None:
        self._session.pop(session_id, None)
        self._session_requests.pop(session_id, None)

    def session_worker(self, session_id: str) -> str | None:
        return self._session.get(session_id)

    # fan-out ---------------------------------------------------------------------------------

    def _engines_with(self, method: str) -> list[WorkerHandle]:
        return [w for w in self.workers.values() if w.healthy and hasattr(w.engine, method)]

    async def _all(self, method: str, *args: object) -> list[object]:
        ws = self._engines_with(method)
        return list(await asyncio.gather(*(getattr(w.engine, method)(*args) for w in ws)))

    async def pause(self, mode: PauseMode = "keep") -> None:
        await self._all("pause", mode)
        self.suspended = True
        for w in self.workers.values():
            w.metrics.suspend()

    async def resume(self) -> None:
        await self._all("resume")
        self.suspended = False
        for w in self.workers.values():
            w.metrics.unsuspend()

    async def suspend(self) -> None:
        """Pause every worker, keeping in-flight requests (they continue after :meth:`resume`)."""
        await self.pause("keep")

    async def update_weights(self, version: int) -> dict[str, float]:
        """Every healthy worker loads ``version``; returns each worker's generation pause in seconds.

        In-flight requests are kept; their KV is recomputed under the new weights.
        """
        ws = self._engines_with("update_weights")
        paused = await asyncio.gather(*(w.engine.update_weights(version) for w in ws))  # type: ignore[attr-defined]
        out = {}
        for w, p in zip(ws, paused, strict=True):
            out[w.name] = float(p)
            if not self.suspended:  # while suspended, the whole suspension is counted instead
                w.metrics.add_suspended(float(p))
        return out

    async def prefetch_weights(self, version: int) -> None:
        """Every healthy worker that can prepares ``version`` while it keeps generating; returns when all
        are ready to swap it in (:meth:`update_weights` then pauses only for the swap)."""
        await self._all("prefetch_weights", version)

    async def weight_versions(self) -> dict[str, int]:
        ws = [w for w in self.workers.values() if w.healthy]
        vs = await asyncio.gather(*(w.engine.weight_version() for w in ws))
        return {w.name: int(v) for w, v in zip(ws, vs, strict=True)}

    async def check_health(self, timeout: float = 10.0) -> int:
        """Probe unhealthy workers (``weight_version``); mark those that answer healthy again.

        Returns how many workers came back.
        """
        back = 0
        for w in [w for w in self.workers.values() if not w.healthy]:
            try:
                await asyncio.wait_for(w.engine.weight_version(), timeout)
            except Exception as exc:
                log.debug("worker %s still unavailable: %r", w.name, exc)
                continue
            w.healthy = True
            back += 1
        return back

    async def metrics(self, engine_stats: bool = True, timeout: float = 5.0) -> dict[str, dict[str, Any]]:
        """Per worker: pool, health, queue depth, tokens/s, prefill/decode tokens, time suspended."""
        out: dict[str, dict[str, Any]] = {}
        for w in self.workers.values():
            m = {"pool": w.pool, "healthy": w.healthy, "max_inflight": w.max_inflight,
                 **w.metrics.snapshot(w.inflight)}
            get_stats = getattr(w.engine, "get_stats", None)
            if engine_stats and w.healthy and get_stats is not None:
                try:
                    m["engine"] = await asyncio.wait_for(get_stats(), timeout)
                except Exception as exc:
                    m["engine"] = {"error": repr(exc)}
            out[w.name] = m
        out_time = time.time()
        for m in out.values():
            m["at"] = out_time
        return out
