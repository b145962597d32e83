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
at once. Every worker also has a bounded wait queue (``max_queued``): when every candidate's
slots and queue are full the request is refused at once with :class:`ProxyOverloadedError`.

Recovery. A worker whose call fails with an actor-died/unavailable error is marked unhealthy.
:meth:`LLMProxy.check_health` (also run by the background loop of :meth:`LLMProxy.start_health_loop`)
probes it; once it answers it is brought back before it takes a request: an engine that reports
:class:`EngineNotStartedError` (a Ray actor restarted with ``max_restarts``: ``__init__`` ran again,
``start()`` did not, it holds the initial weights) is started, then updated to the version the proxy
serves (the last :meth:`LLMProxy.update_weights`, or the newest version its healthy workers report),
paused if the proxy is suspended, and only then marked healthy. Counted per worker in
:meth:`LLMProxy.metrics` (``restarts_seen``, ``recovered``). A worker has one recovery at a time,
joined by every caller. A request whose pool has no healthy worker (its only engine was killed and
Ray restarts it) waits for one to recover, up to ``recover_wait_s``, instead of failing at once.

Bounded memory: session stickiness is an LRU table of at most ``max_sessions`` trajectories
(:meth:`LLMProxy.end_session` drops one when its trajectory ends); per-session request sets exist
only while the session has requests in flight.

Suspend/resume and weight updates fan out to every worker; a weight update never aborts requests.
A worker that turns out to be dead during a fan-out is marked unhealthy (and recovered later onto
the new version) instead of failing the fan-out.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from rollart_core.errors import EngineError
from rollart_core.protocols import InferenceEngine, PauseMode, SupportsStream
from rollart_core.types import GenerateOutput, GenerateRequest
from rollart_proxy._fleet import WorkerFleet, WorkerHandle
from rollart_proxy.errors import ProxyOverloadedError, WorkerUnavailableError

__all__ = ["LLMProxy", "WorkerHandle"]

log = logging.getLogger(__name__)


class LLMProxy:
    """Routes :class:`GenerateRequest` s to workers; also fans out pause/resume/weight updates."""

    def __init__(
        self,
        workers: Mapping[str, InferenceEngine] | list[WorkerHandle],
        *,
        task_pools: Mapping[str, str] | None = None,
        max_retries: int = 2,
        max_sessions: int = 100_000,
        health_period_s: float = 5.0,
        probe_timeout_s: float = 10.0,
        start_timeout_s: float = 600.0,
        update_timeout_s: float = 600.0,
        recover_wait_s: float = 600.0,
        recover_poll_s: float = 1.0,
    ) -> None:
        """``max_sessions``: size of the session-stickiness LRU table. ``health_period_s``: period
        of :meth:`start_health_loop`. ``start_timeout_s`` / ``update_timeout_s``: bounds on starting
        a restarted engine and on bringing it to the served weights during recovery.
        ``recover_wait_s``: how long a request whose pool has no healthy worker waits for one to
        recover (probing every ``recover_poll_s``) before it fails; 0 fails it at once."""
        if max_sessions < 1:
            raise EngineError(f"max_sessions must be >= 1, got {max_sessions}")
        if recover_wait_s < 0 or recover_poll_s <= 0:
            raise EngineError(
                f"recover_wait_s must be >= 0 and recover_poll_s > 0, got {recover_wait_s}, {recover_poll_s}"
            )
        if isinstance(workers, Mapping):
            handles = [WorkerHandle(n, e) for n, e in workers.items()]
        else:
            handles = list(workers)
        self.fleet = WorkerFleet(
            handles,
            health_period_s=health_period_s,
            probe_timeout_s=probe_timeout_s,
            start_timeout_s=start_timeout_s,
            update_timeout_s=update_timeout_s,
        )
        """The workers and what is done to all of them at once (fan-out, health, recovery)."""
        self.task_pools = dict(task_pools or {})
        pools = {w.pool for w in handles}
        unknown = {t: p for t, p in self.task_pools.items() if p not in pools}
        if unknown:
            raise EngineError(f"tasks routed to pools without workers: {unknown} (pools: {sorted(pools)})")
        self.max_retries = max_retries
        self.max_sessions = max_sessions
        self.recover_wait_s = recover_wait_s
        self.recover_poll_s = recover_poll_s
        self._wait_logged: dict[str | None, float] = {}
        """Pool → when a request last logged that it waits for a worker of it to recover."""
        self._session: OrderedDict[str, str] = OrderedDict()
        """Session → the worker that served its last turn (LRU, at most ``max_sessions``)."""
        self._request_worker: dict[str, str] = {}
        self._session_requests: dict[str, set[str]] = {}
        """Session → its requests in flight; an entry lives only while the set is not empty."""
        self._aborted: set[str] = set()
        self._handed_back: set[str] = set()
        """Requests a removed worker hands back: they continue on another worker."""

    # the fleet's state and operations, as the proxy's (rollart_core's proxy protocols) -------------

    @property
    def workers(self) -> dict[str, WorkerHandle]:
        return self.fleet.workers

    @property
    def version(self) -> int | None:
        """The weight version served: the last :meth:`update_weights` (None: never updated)."""
        return self.fleet.version

    @property
    def suspended(self) -> bool:
        return self.fleet.suspended

    @property
    def elastic(self) -> dict[str, int]:
        """Workers added, removed and requests handed back (elastic pool)."""
        return self.fleet.elastic

    async def pause(self, mode: PauseMode = "keep") -> None:
        await self.fleet.pause(mode)

    async def suspend(self) -> None:
        """Pause every worker, keeping in-flight requests (they continue after :meth:`resume`)."""
        await self.fleet.pause("keep")

    async def resume(self) -> None:
        await self.fleet.resume()

    async def update_weights(self, version: int) -> dict[str, float]:
        """:meth:`WorkerFleet.update_weights`: each worker's generation pause in seconds."""
        return await self.fleet.update_weights(version)

    async def prefetch_weights(self, version: int) -> None:
        await self.fleet.prefetch_weights(version)

    async def weight_versions(self) -> dict[str, int]:
        return await self.fleet.weight_versions()

    async def check_health(self, timeout: float = 10.0) -> int:
        """Probe unhealthy workers and bring back those that answer; how many came back."""
        return await self.fleet.check_health(timeout)

    async def probe(self, timeout: float | None = None) -> int:
        return await self.fleet.probe(timeout)

    def start_health_loop(self, period_s: float | None = None) -> None:
        self.fleet.start_health_loop(period_s)

    async def stop_health_loop(self) -> None:
        await self.fleet.stop_health_loop()

    async def add_worker(self, worker: WorkerHandle, timeout: float | None = None) -> int:
        """:meth:`WorkerFleet.add_worker`: the version the new worker serves."""
        return await self.fleet.add_worker(worker, timeout)

    @classmethod
    def from_ray_actors(
        cls,
        actors: list[tuple[str, Any, str]],
        *,
        task_pools: Mapping[str, str] | None = None,
        max_inflight: int = 64,
        max_queued: int = 4096,
        **kwargs: Any,
    ) -> LLMProxy:
        """Proxy over engines living in Ray actors: ``(name, actor handle, pool)`` each. Actors
        created with ``max_restarts`` are recovered onto the served weights (see the module doc)."""
        from rollart_proxy.engines.ray_engine import RayActorEngine

        handles = [
            WorkerHandle(name, RayActorEngine(h, name), pool, max_inflight, max_queued)
            for name, h, pool in actors
        ]
        return cls(handles, task_pools=task_pools, **kwargs)

    # routing ---------------------------------------------------------------------------------

    def pool_of(self, task: str | None) -> str | None:
        return self.task_pools.get(task) if task else None

    def _candidates(self, task: str | None) -> list[WorkerHandle]:
        pool = self.pool_of(task)
        ws = [
            w
            for w in self.workers.values()
            if w.healthy and not w.draining and (pool is None or w.pool == pool)
        ]
        if not ws:
            raise WorkerUnavailableError(f"no healthy worker for task {task!r} (pool {pool!r})")
        return ws

    def _pick(self, request: GenerateRequest, exclude: set[str]) -> WorkerHandle:
        healthy = self._candidates(request.task)
        # a worker this request already failed on is healthy again only if it was recovered since
        cands = [w for w in healthy if w.name not in exclude] or healthy
        if not cands:
            raise WorkerUnavailableError(f"request {request.request_id}: every worker of its pool failed")
        open_ = [w for w in cands if not w.full]
        if not open_:
            raise ProxyOverloadedError(
                f"request {request.request_id}: every worker's queue is full "
                f"({', '.join(f'{w.name}: {w.inflight} in flight, {w.metrics.queued} queued' for w in cands)})"
            )
        cands = open_
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

    async def _dispatch(
        self, request: GenerateRequest, on_delta: Callable[[GenerateOutput], None] | None
    ) -> GenerateOutput:
        tried: set[str] = set()
        sid, rid = request.session_id, request.request_id
        if sid:
            self._session_requests.setdefault(sid, set()).add(rid)  # for abort by session
        attempt = request  # after a hand-back: the prompt plus the tokens so far
        done: GenerateOutput | None = None  # those tokens
        try:
            while True:
                w = await self._pick_or_wait(attempt, tried)
                streamed: list[int] = []
                try:
                    out = await self._run_on(w, attempt, on_delta, streamed)
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
                    if out.finish_reason == "abort" and rid in self._handed_back and rid not in self._aborted:
                        self._handed_back.discard(rid)  # its worker was removed: go on elsewhere
                        self.elastic["handed_back"] += 1
                        done = _joined(done, out, len(request.prompt_ids))
                        left = request.sampling.max_tokens - len(done.token_ids)
                        if left < 1:
                            done.finish_reason = "length"
                            return done
                        attempt = _continuation(request, done.token_ids, left)
                        continue  # not a failure: no try is counted
                    w.served += 1
                    if sid and not w.draining:
                        self._remember(sid, w.name)
                    return out if done is None else _joined(done, out, len(request.prompt_ids))
                tried.add(w.name)
                if len(tried) > self.max_retries:
                    raise WorkerUnavailableError(
                        f"request {request.request_id} failed on {sorted(tried)} (max_retries={self.max_retries})"
                    )
        finally:
            self._aborted.discard(rid)
            self._handed_back.discard(rid)
            pending = self._session_requests.get(sid) if sid else None
            if pending is not None:
                pending.discard(request.request_id)
                if not pending:
                    del self._session_requests[sid]  # type: ignore[arg-type]

    async def _pick_or_wait(self, request: GenerateRequest, tried: set[str]) -> WorkerHandle:
        """A worker for ``request``; when its pool has none healthy, recover them (a restarted
        engine is started and updated first) and wait up to ``recover_wait_s`` for one."""
        try:
            return self._pick(request, tried)
        except WorkerUnavailableError:
            pass
        deadline = time.monotonic() + self.recover_wait_s
        while True:
            await self.check_health()
            try:
                return self._pick(request, tried)
            except WorkerUnavailableError as exc:
                left = deadline - time.monotonic()
                if left <= 0:
                    if self.recover_wait_s == 0:
                        raise
                    raise WorkerUnavailableError(
                        f"{exc}: none recovered within recover_wait_s={self.recover_wait_s:g}"
                    ) from None
            self._log_wait(request.task)
            await asyncio.sleep(min(left, self.recover_poll_s))  # the next probe of the dead workers

    def _log_wait(self, task: str | None) -> None:
        pool = self.pool_of(task)
        now = time.monotonic()
        if now - self._wait_logged.get(pool, -1e9) >= 30.0:
            self._wait_logged[pool] = now
            down = sorted(w.name for w in self.workers.values() if not w.healthy)
            log.warning(
                "requests of task %r wait for a worker of pool %r to recover (down: %s; at most %gs)",
                task,
                pool,
                ", ".join(down),
                self.recover_wait_s,
            )

    def _remember(self, session_id: str, worker: str) -> None:
        self._session[session_id] = worker
        self._session.move_to_end(session_id)
        while len(self._session) > self.max_sessions:
            self._session.popitem(last=False)  # the least recently served trajectory

    async def _run_on(
        self,
        w: WorkerHandle,
        request: GenerateRequest,
        on_delta: Callable[[GenerateOutput], None] | None = None,
        streamed: list[int] | None = None,
    ) -> GenerateOutput:
        self._request_worker[request.request_id] = w.name  # abortable while queued, too
        w.metrics.queued += 1
        try:
            await w._slots.acquire()
        except BaseException:
            w.metrics.queued -= 1
            self._request_worker.pop(request.request_id, None)
            _note_idle(w)
            raise
        w.metrics.queued -= 1
        w.inflight += 1
        try:
            if request.request_id in self._aborted or request.request_id in self._handed_back:  # while queued
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
                    await asyncio.shield(_abort_on(w, request.request_id))
                    raise
            w.metrics.record(len(request.prompt_ids), len(out.token_ids), out.finish_reason)
            return out
        finally:
            w.inflight -= 1
            w._slots.release()
            self._request_worker.pop(request.request_id, None)
            _note_idle(w)

    @staticmethod
    async def _stream_from(
        engine: SupportsStream,
        request: GenerateRequest,
        on_delta: Callable[[GenerateOutput], None],
        streamed: list[int] | None,
    ) -> GenerateOutput:
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

    def _worker_failed(self, w: WorkerHandle, request: GenerateRequest, exc: BaseException) -> None:
        if request.session_id and self._session.get(request.session_id) == w.name:
            self._session.pop(request.session_id)
        self.fleet.mark_down(w, f"request {request.request_id}: {exc!r}")

    async def abort(self, request_id: str) -> int:
        """Abort a request by its id, or every in-flight request of a trajectory by its session id.

        Aborted requests return with ``finish_reason == "abort"`` and the tokens generated so far.
        Returns how many requests were aborted.
        """
        ids = (
            [request_id]
            if request_id in self._request_worker
            else sorted(self._session_requests.get(request_id, ()))
        )
        for rid in ids:
            self._aborted.add(rid)
            w = self.workers.get(self._request_worker.get(rid, ""))
            if w is not None:
                await w.engine.abort(rid)
        return len(ids)

    def end_session(self, session_id: str) -> None:
        """Forget a trajectory (call when it ends, whatever its fate): its stickiness is dropped.
        Requests of it still in flight finish normally (and stay abortable until then)."""
        self._session.pop(session_id, None)

    def session_counts(self) -> dict[str, int]:
        """Sizes of the per-session tables (bounded: see ``max_sessions``)."""
        return {
            "sessions": len(self._session),
            "sessions_in_flight": len(self._session_requests),
            "requests_in_flight": len(self._request_worker),
        }

    def session_worker(self, session_id: str) -> str | None:
        return self._session.get(session_id)

    async def add_actor_worker(self, name: str, actor: Any, pool: str) -> int:
        """:meth:`add_worker` for an engine in a Ray actor (as :meth:`from_ray_actors` makes them), with
        the in-flight and queue limits of the pool's other workers."""
        from rollart_proxy.engines.ray_engine import RayActorEngine

        peer = next((w for w in self.workers.values() if w.pool == pool), None)
        limits = (peer.max_inflight, peer.max_queued) if peer is not None else (64, 4096)
        return await self.add_worker(WorkerHandle(name, RayActorEngine(actor, name), pool, *limits))

    async def remove_worker(self, name: str, drain_timeout_s: float = 60.0) -> dict[str, int]:
        """Stop routing to worker ``name``; wait up to ``drain_timeout_s`` for its requests, hand the
        rest back (they continue elsewhere, see the module doc); then forget it. Returns
        ``{"drained": finished there meanwhile, "handed_back": continued elsewhere}``."""
        if drain_timeout_s < 0:
            raise EngineError(f"drain_timeout_s must be >= 0, got {drain_timeout_s}")
        w = self.workers.get(name)
        if w is None:
            raise EngineError(f"no worker {name!r} (workers: {', '.join(sorted(self.workers))})")
        if w.draining:
            raise EngineError(f"worker {name!r} is being removed already")
        if w.healthy and not [
            x
            for x in self.workers.values()
            if x.pool == w.pool and x.healthy and x is not w and not x.draining
        ]:
            raise EngineError(
                f"worker {name!r} is the last healthy worker of pool {w.pool!r}: add another one first"
            )
        w.draining = True
        self.fleet.cancel_recovery(name)  # a draining worker is not brought back
        served0, handed0 = w.served, self.elastic["handed_back"]
        if w.outstanding:
            w._idle.clear()
            try:
                await asyncio.wait_for(w._idle.wait(), drain_timeout_s)
            except TimeoutError:
                ids = [rid for rid, n in self._request_worker.items() if n == name]
                log.warning(
                    "worker %s: %d requests left after %gs: handing them back",
                    name,
                    len(ids),
                    drain_timeout_s,
                )
                self._handed_back.update(ids)
                await asyncio.gather(*(_abort_on(w, rid) for rid in ids))
                try:  # their abort returns the tokens so far, which continue elsewhere
                    await asyncio.wait_for(w._idle.wait(), self.fleet.probe_timeout_s)
                except TimeoutError:
                    log.warning("worker %s: %d requests still running after their abort", name, w.outstanding)
        self.fleet.forget(name)
        for sid in [s for s, n in self._session.items() if n == name]:
            del self._session[sid]
        out = {"drained": w.served - served0, "handed_back": self.elastic["handed_back"] - handed0}
        log.warning("worker %s removed from pool %r (%s)", name, w.pool, out)
        return out

    async def metrics(self, engine_stats: bool = True, timeout: float = 5.0) -> dict[str, dict[str, Any]]:
        """Per worker: pool, health, queue depth, tokens/s, prefill/decode tokens, time suspended."""
        out: dict[str, dict[str, Any]] = {}
        for w in self.workers.values():
            m = {
                "pool": w.pool,
                "healthy": w.healthy,
                "draining": w.draining,
                "max_inflight": w.max_inflight,
                "max_queued": w.max_queued,
                **w.metrics.snapshot(w.inflight),
            }
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


async def _abort_on(w: WorkerHandle, request_id: str) -> None:
    try:
        await w.engine.abort(request_id)
    except Exception as exc:  # it may have finished meanwhile, or the worker is gone
        log.debug("abort of %s on %s failed: %r", request_id, w.name, exc)


def _note_idle(w: WorkerHandle) -> None:
    if w.draining and w.outstanding == 0:
        w._idle.set()  # remove_worker waits for this


def _joined(first: GenerateOutput | None, rest: GenerateOutput, prompt_len: int) -> GenerateOutput:
    """One output from a request's tokens before a hand-back and its continuation's."""
    if first is None:
        return rest
    return GenerateOutput(
        rest.request_id,
        first.token_ids + rest.token_ids,
        first.logprobs + rest.logprobs,
        first.versions + rest.versions,
        rest.finish_reason,
        rest.worker,
        first.prompt_logprobs
        if first.prompt_logprobs is not None
        else _head(rest.prompt_logprobs, prompt_len),
    )


def _head(logprobs: list[float | None] | None, n: int) -> list[float | None] | None:
    return None if logprobs is None else logprobs[:n]


def _continuation(request: GenerateRequest, tokens: list[int], left: int) -> GenerateRequest:
    """The rest of ``request`` after ``tokens``: its prompt plus them, ``left`` tokens to go."""
    return GenerateRequest(
        request.request_id,
        request.prompt_ids + tokens,
        request.sampling.model_copy(update={"max_tokens": left}),
        request.session_id,
        request.task,
        request.prompt_logprobs,
    )
