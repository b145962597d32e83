"""The proxy's workers (:class:`WorkerHandle`) and what is done to all of them at once
(:class:`WorkerFleet`): pause/resume and weight updates fanned out, health probes and recovery, and
workers added while the proxy serves. :class:`~rollart_proxy.proxy.LLMProxy` owns one fleet and
routes requests over its workers; how recovery works: :mod:`rollart_proxy.proxy`.

Elastic workers. :meth:`WorkerFleet.add_worker` brings a new engine up the way recovery brings back a
restarted one (started if it is not, updated to the served version, paused if the proxy is suspended)
and only then lets it take requests; it joins a weight update before or after, never halfway.
:meth:`LLMProxy.remove_worker <rollart_proxy.proxy.LLMProxy.remove_worker>` stops routing to a worker,
waits up to ``drain_timeout_s`` for its requests to finish, then hands the rest back: each is aborted
there and continues on another worker of its pool from the tokens it already has (prompt + those tokens,
the rest of its ``max_tokens``; the logprobs and per-token versions of both parts are kept). The last
worker of a pool is never removed."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from rollart_core.errors import EngineError, WeightSyncError
from rollart_core.protocols import InferenceEngine, PauseMode
from rollart_proxy.errors import EngineNotStartedError, WorkerUnavailableError
from rollart_proxy.metrics import WorkerMetrics

__all__ = ["WorkerFleet", "WorkerHandle"]

# the logger these records had before they moved out of rollart_proxy.proxy: configuration by name holds
log = logging.getLogger("rollart_proxy.proxy")


@dataclass
class WorkerHandle:
    name: str
    engine: InferenceEngine
    pool: str = "default"
    max_inflight: int = 64
    max_queued: int = 4096
    """Requests that may wait for one of its in-flight slots; beyond, the proxy refuses requests."""
    inflight: int = 0
    healthy: bool = True
    served: int = 0
    draining: bool = False
    """Being removed (``LLMProxy.remove_worker``): it takes no new request."""
    metrics: WorkerMetrics = field(default_factory=WorkerMetrics)
    _slots: asyncio.Semaphore = field(init=False)
    _idle: asyncio.Event = field(init=False, default_factory=asyncio.Event)
    """Set when a draining worker has nothing in flight or queued."""

    def __post_init__(self) -> None:
        if self.max_inflight < 1:
            raise EngineError(f"worker {self.name}: max_inflight must be >= 1")
        if self.max_queued < 0:
            raise EngineError(f"worker {self.name}: max_queued must be >= 0")
        self._slots = asyncio.Semaphore(self.max_inflight)

    @property
    def outstanding(self) -> int:
        return self.inflight + self.metrics.queued

    @property
    def full(self) -> bool:
        """No free slot and no room in the wait queue."""
        return self.inflight >= self.max_inflight and self.metrics.queued >= self.max_queued


class WorkerFleet:
    """The workers of one proxy and their shared state: the served version, the suspension, the update
    lock, recoveries in progress, the health loop. ``owner``: a fleet over a subset of another fleet's
    handles (the PD router's per-pool views) recovers its workers through that one, which knows the
    served version."""

    def __init__(
        self,
        handles: list[WorkerHandle],
        *,
        health_period_s: float = 5.0,
        probe_timeout_s: float = 10.0,
        start_timeout_s: float = 600.0,
        update_timeout_s: float = 600.0,
    ) -> None:
        if not handles:
            raise EngineError("LLMProxy needs at least one worker")
        self.workers = {w.name: w for w in handles}
        if len(self.workers) != len(handles):
            raise EngineError("worker names must be unique")
        self.health_period_s = health_period_s
        self.probe_timeout_s = probe_timeout_s
        self.start_timeout_s = start_timeout_s
        self.update_timeout_s = update_timeout_s
        self.suspended = False
        self.version: int | None = None
        """The weight version served: the last :meth:`update_weights` (None: never updated)."""
        self.elastic = {"added": 0, "removed": 0, "handed_back": 0}
        self.owner: WorkerFleet | None = None
        self._update_lock = asyncio.Lock()
        self._recoveries: dict[str, asyncio.Future[bool]] = {}
        """Worker → its recovery in progress: one at a time per worker, joined by every caller."""
        self._health_task: asyncio.Task[None] | None = None

    def mark_down(self, w: WorkerHandle, why: str) -> None:
        w.metrics.failures += 1
        if w.healthy:
            log.warning("worker %s marked unhealthy: %s", w.name, why)
        w.healthy = False

    def cancel_recovery(self, name: str) -> None:
        run = self._recoveries.pop(name, None)
        if run is not None:
            run.cancel()

    def forget(self, name: str) -> WorkerHandle:
        """Take worker ``name`` out of the fleet (its recovery, if one runs, is cancelled)."""
        self.cancel_recovery(name)
        w = self.workers.pop(name)
        self.elastic["removed"] += 1
        return w

    # fan-out ---------------------------------------------------------------------------------

    def _engines_with(self, method: str) -> list[WorkerHandle]:
        return [w for w in self.workers.values() if w.healthy and hasattr(w.engine, method)]

    async def _fan_out(
        self, ws: list[WorkerHandle], call: Callable[[WorkerHandle], Awaitable[Any]]
    ) -> list[tuple[WorkerHandle, Any]]:
        """``call`` on every worker of ``ws`` at once. A worker found dead is marked unhealthy and left
        out (recovery brings it back to the current state); any other error is raised."""
        results = await asyncio.gather(*(call(w) for w in ws), return_exceptions=True)
        out: list[tuple[WorkerHandle, Any]] = []
        first: BaseException | None = None
        for w, r in zip(ws, results, strict=True):
            if isinstance(r, WorkerUnavailableError):
                self.mark_down(w, repr(r))
            elif isinstance(r, BaseException):
                first = first or r
            else:
                out.append((w, r))
        if first is not None:
            raise first
        return out

    async def _all(self, method: str, *args: object) -> list[object]:
        ws = self._engines_with(method)
        return [r for _, r in await self._fan_out(ws, lambda w: getattr(w.engine, method)(*args))]

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

        In-flight requests are kept; their KV is recomputed under the new weights. A worker whose
        update fails or takes over ``update_timeout_s`` is taken out (and restarted where its engine
        can be) while the others go on; recovery brings it back on the served version. When no
        worker could update, :class:`WeightSyncError` names each one and what it failed at.
        """
        async with self._update_lock:  # a worker being recovered joins before or after, never halfway
            ws = self._engines_with("update_weights")
            done = await self._weights_fan_out(ws, "update_weights", version)
            self.version = version if self.version is None else max(self.version, version)
        out = {}
        for w, p in done:
            out[w.name] = float(p)
            if not self.suspended:  # while suspended, the whole suspension is counted instead
                w.metrics.add_suspended(float(p))
        return out

    async def prefetch_weights(self, version: int) -> None:
        """Every healthy worker that can prepares ``version`` while it keeps generating; returns when all
        are ready to swap it in (:meth:`update_weights` then pauses only for the swap). A worker that
        fails or takes over ``update_timeout_s`` is taken out as in :meth:`update_weights`, without a
        restart (what it serves is untouched): recovery updates it."""
        await self._weights_fan_out(self._engines_with("prefetch_weights"), "prefetch_weights", version)

    async def _weights_fan_out(
        self, ws: list[WorkerHandle], method: str, version: int
    ) -> list[tuple[WorkerHandle, Any]]:
        """``method(version)`` on every worker of ``ws`` at once, each within ``update_timeout_s``."""
        stage = "update" if method == "update_weights" else "prefetch"

        async def one(w: WorkerHandle) -> Any:
            try:
                return await asyncio.wait_for(getattr(w.engine, method)(version), self.update_timeout_s)
            except TimeoutError:
                raise WeightSyncError(
                    f"{w.name}: {stage} to version {version} took over update_timeout_s={self.update_timeout_s:g}"
                ) from None

        results = await asyncio.gather(*(one(w) for w in ws), return_exceptions=True)
        done = [(w, r) for w, r in zip(ws, results, strict=True) if not isinstance(r, BaseException)]
        failed = [(w, r) for w, r in zip(ws, results, strict=True) if isinstance(r, BaseException)]
        for w, exc in failed:
            if isinstance(exc, WorkerUnavailableError):
                self.mark_down(w, repr(exc))  # dead: recovery brings it back on the served version
        broken = [(w, e) for w, e in failed if not isinstance(e, WorkerUnavailableError)]
        if broken and not done:
            raise WeightSyncError(
                f"no engine could {stage} to version {version}: "
                + "; ".join(
                    str(e) if isinstance(e, WeightSyncError) else f"{w.name}: {e!r}" for w, e in broken
                )
            ) from broken[0][1]
        for w, exc in broken:  # the others have it: take this one out (recovery updates it again)
            self.mark_down(w, f"{stage} to version {version} failed: {exc!r}")
            w.metrics.update_failures += 1
            restart = getattr(w.engine, "restart", None)
            if restart is not None and stage == "update":  # its weights may be half-loaded: a fresh start
                try:
                    await restart()
                except Exception as rexc:
                    log.warning("worker %s: restart after a failed %s failed: %r", w.name, stage, rexc)
        return done

    async def weight_versions(self) -> dict[str, int]:
        ws = [w for w in self.workers.values() if w.healthy]
        done = await self._fan_out(ws, lambda w: w.engine.weight_version())
        return {w.name: int(v) for w, v in done}

    # health and recovery ---------------------------------------------------------------------

    async def check_health(self, timeout: float = 10.0) -> int:
        """Probe unhealthy workers; bring back those that answer (see :mod:`rollart_proxy.proxy`: a
        restarted engine is started and updated to the served version first). Returns how many came back."""
        if self.owner is not None:
            return await self.owner.check_health(timeout)
        runs = []
        for w in [w for w in self.workers.values() if not w.healthy]:
            run = self._recoveries.get(w.name)
            if run is None:  # one recovery per worker at a time, joined by every caller
                run = self._recoveries[w.name] = asyncio.ensure_future(self._recover(w, timeout))
            runs.append(run)
        back = await asyncio.gather(*(asyncio.shield(r) for r in runs))  # a caller's cancel: not the run's
        return sum(back)

    async def _recover(self, w: WorkerHandle, timeout: float) -> bool:
        try:
            have = await self._bring_up(w, timeout, restarted=True)
        except Exception as exc:
            log.info("worker %s not recovered yet: %r", w.name, exc)
            return False
        finally:
            self._recoveries.pop(w.name, None)
        w.metrics.recovered += 1
        log.warning("worker %s recovered (version %s)", w.name, have)
        return True

    async def _bring_up(self, w: WorkerHandle, timeout: float, *, restarted: bool) -> int:
        """Start ``w``'s engine if it is not, bring it to the served version, pause it if the proxy is
        suspended, then mark it healthy. Returns the version it serves; raises naming the stage."""
        try:
            await asyncio.wait_for(w.engine.weight_version(), timeout)
        except EngineNotStartedError:
            if restarted:
                w.metrics.restarts_seen += 1
                log.warning("worker %s was restarted (engine not started): starting it", w.name)
            start = getattr(w.engine, "start", None)
            if start is None:
                raise WorkerUnavailableError(f"{w.name}: engine not started, and it has no start()") from None
            await asyncio.wait_for(start(), self.start_timeout_s)
        async with self._update_lock:
            target = await self._served_version(w, timeout)
            have = int(await asyncio.wait_for(w.engine.weight_version(), timeout))
            if target is not None and have < target:
                update = getattr(w.engine, "update_weights", None)
                if update is None:
                    raise WeightSyncError(f"{w.name} serves version {have}, not {target}, and cannot update")
                log.info("worker %s: bringing it from version %d to %d", w.name, have, target)
                try:
                    await asyncio.wait_for(update(target), self.update_timeout_s)
                except TimeoutError:
                    raise WeightSyncError(
                        f"{w.name}: update to version {target} took over update_timeout_s={self.update_timeout_s:g}"
                    ) from None
                have = int(await asyncio.wait_for(w.engine.weight_version(), timeout))
                if have != target:
                    raise WeightSyncError(f"{w.name} reports version {have} after updating to {target}")
            if self.suspended and hasattr(w.engine, "pause"):
                await asyncio.wait_for(w.engine.pause("keep"), timeout)
                w.metrics.suspend()
            w.healthy = True
        return have

    # elastic workers ---------------------------------------------------------------------------

    async def add_worker(self, worker: WorkerHandle, timeout: float | None = None) -> int:
        """Add ``worker`` while the proxy serves: it takes requests only once it is started and serves
        the proxy's version (see the module doc). Returns that version. On any failure the worker is
        not added and the error names it and the stage."""
        if worker.name in self.workers:
            raise EngineError(f"a worker named {worker.name!r} exists already")
        t = self.probe_timeout_s if timeout is None else timeout
        worker.healthy, worker.draining = False, False
        try:
            have = await self._bring_up(worker, t, restarted=False)
        except TimeoutError:
            raise EngineError(f"adding worker {worker.name}: no answer within {t:g}s") from None
        except EngineError:
            raise
        except Exception as exc:
            raise EngineError(f"adding worker {worker.name}: {exc!r}") from exc
        self.workers[worker.name] = worker  # after the bring-up: no request, update or probe saw it half-way
        self.elastic["added"] += 1
        log.warning("worker %s added to pool %r (version %s)", worker.name, worker.pool, have)
        return have

    async def _served_version(self, exclude: WorkerHandle, timeout: float) -> int | None:
        """What a recovering worker must serve: the proxy's version, or the newest a healthy worker reports."""
        others = [w for w in self.workers.values() if w.healthy and w is not exclude]
        vs = await asyncio.gather(
            *(asyncio.wait_for(w.engine.weight_version(), timeout) for w in others), return_exceptions=True
        )
        known = [int(v) for v in vs if not isinstance(v, BaseException)]
        if self.version is not None:
            known.append(self.version)
        return max(known, default=None)

    async def probe(self, timeout: float | None = None) -> int:
        """Ask every healthy worker for its version; mark the dead (or restarted) ones unhealthy.
        Returns how many were marked. A slow answer is not a death: only logged."""
        t = self.probe_timeout_s if timeout is None else timeout
        ws = [w for w in self.workers.values() if w.healthy and w.name not in self._recoveries]
        rs = await asyncio.gather(
            *(asyncio.wait_for(w.engine.weight_version(), t) for w in ws), return_exceptions=True
        )
        n = 0
        for w, r in zip(ws, rs, strict=True):
            if isinstance(r, WorkerUnavailableError):
                self.mark_down(w, f"health probe: {r!r}")
                n += 1
            elif isinstance(r, BaseException):
                log.warning("health probe of %s: %r", w.name, r)
        return n

    def start_health_loop(self, period_s: float | None = None) -> None:
        """Every ``period_s`` (default ``health_period_s``): :meth:`probe`, then :meth:`check_health`.
        Needs a running event loop; stop it with :meth:`stop_health_loop`."""
        if self._health_task is not None and not self._health_task.done():
            return
        period = self.health_period_s if period_s is None else period_s
        if period <= 0:
            raise EngineError(f"health loop period must be > 0, got {period}")
        self._health_task = asyncio.create_task(self._health_loop(period), name="llmproxy-health")

    async def stop_health_loop(self) -> None:
        task, self._health_task = self._health_task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _health_loop(self, period_s: float) -> None:
        while True:
            try:
                await self.probe()
                await self.check_health(self.probe_timeout_s)
            except Exception:  # the loop must outlive any one round
                log.exception("health loop round failed")
            await asyncio.sleep(period_s)  # the period between rounds, not a wait for a condition
