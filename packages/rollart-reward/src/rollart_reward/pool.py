"""The function runtime's worker pool: forked worker processes, one call at a time each, autoscaled.

A *template* process (:mod:`rollart_reward._worker`) imports the reward function once; every worker
is forked from it (a warm snapshot) and says hello on a unix socket. :class:`WorkerPool` starts
workers on demand up to ``max_workers`` (each start is a *cold start*), hands idle ones out most
recently used first, and stops those idle past their keep-alive down to ``min_workers``. The
keep-alive follows ``ScalingConfig.idle_policy`` (:func:`learned_keep_alive` for ``learned``).

The HTTP front, idempotency cache and invocation shapes live in :mod:`rollart_reward.runtime`.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import math
import os
import shutil
import signal
import sys
import time
import uuid
from typing import Any

from rollart_core.procdirs import owned_tempdir
from rollart_reward.metrics import UtilisationMeter

__all__ = ["Overloaded", "WorkerPool", "learned_keep_alive"]

log = logging.getLogger(__name__)


class Overloaded(Exception):
    """More calls wait for a worker than ``max_queue`` allows (429)."""


def learned_keep_alive(gaps: list[float], cold_s: float, ceiling: float) -> float:
    """The keep-alive in [0, ``ceiling``] that minimises provisioned time over the observed idle
    periods: each costs min(gap, k) seconds idle, plus a cold start (``cold_s``) if the next call came
    after k (or never: ``inf``). Candidates: 0, the ceiling and every observed gap below it.

    Runs on every worker release: one sort and a running sum, not a cost sum per candidate."""
    gs = sorted(gaps)
    best_cost, best_k = len(gs) * cold_s, 0.0  # k = 0: every period ends in a cold start
    below = 0.0  # sum of the gaps <= k
    i = 0
    for k in sorted({g for g in gs if g < ceiling} | {ceiling}):
        while i < len(gs) and gs[i] <= k:
            below += gs[i]
            i += 1
        cost = below + (len(gs) - i) * (k + cold_s)
        if cost < best_cost - 1e-12:  # a float tie keeps the shorter keep-alive
            best_cost, best_k = cost, k
    return best_k


class Worker:
    """One forked worker process, spoken to over its unix socket: one JSON line per call."""

    def __init__(
        self, pid: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, spawned: float
    ) -> None:
        self.pid, self.reader, self.writer = pid, reader, writer
        self.spawned = spawned
        self.init_s = 0.0  # cold start: fork requested -> worker ready
        self.idle_since = spawned
        self.keep_alive = 0.0  # of the current idle period
        self.calls = 0
        self.ids = 0

    async def call(self, trajectory: dict[str, Any], timeout: float) -> dict[str, Any]:
        self.ids += 1
        self.writer.write((json.dumps({"id": self.ids, "trajectory": trajectory}) + "\n").encode())
        await self.writer.drain()
        line = await asyncio.wait_for(self.reader.readline(), timeout)
        if not line:
            raise RuntimeError(f"worker {self.pid} exited")
        return json.loads(line)

    def kill(self) -> None:
        self.writer.close()
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class WorkerPool:
    """``await pool.start()`` loads the function; ``await pool.acquire()`` → a :class:`Worker` to
    ``release`` after its call (or ``retire`` if it failed); ``await pool.stop()`` kills every process.

    ``config`` is a :class:`~rollart_reward.runtime.RuntimeConfig` (function, options and scaling);
    ``meter`` gets cold starts and provisioned time, ``counters`` worker start failures."""

    def __init__(self, config: Any, meter: UtilisationMeter, counters: collections.Counter[str]) -> None:
        self.config = config
        self.meter = meter
        self.counters = counters
        self.workers: list[Worker] = []
        self.idle: list[Worker] = []
        self.waiters: collections.deque[asyncio.Future[Worker]] = collections.deque()
        self.starting = 0
        self.peak_workers = 0
        self.cold_start_s: list[float] = []
        self.template_load_s = 0.0
        self._cold_ewma = 0.0
        self._gaps: collections.deque[float] = collections.deque(maxlen=128)
        """Recent idle periods: seconds until the worker's next call (inf: stopped before one came)."""
        self._releases = 0
        self._reaper: asyncio.Task[None] | None = None
        self._spawns: set[asyncio.Task[None]] = set()
        self._hellos: dict[str, asyncio.Future[Worker]] = {}
        self._template: asyncio.subprocess.Process | None = None
        self._sockdir = ""
        self._unix: asyncio.AbstractServer | None = None

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """Start the template (the function loaded once), the idle reaper and ``min_workers`` workers."""
        await self._start_template()
        self._reaper = asyncio.create_task(self._reap_idle())
        for _ in range(self.config.min_workers):
            self._spawn()

    async def stop(self) -> None:
        if self._reaper:
            self._reaper.cancel()
        for t in list(self._spawns):
            t.cancel()
        for w in list(self.workers):
            await self.retire(w)
        if self._template is not None and self._template.returncode is None:
            self._template.kill()
            await self._template.wait()
        if self._unix is not None:
            self._unix.close()
        if self._sockdir:
            shutil.rmtree(self._sockdir, ignore_errors=True)
            self._sockdir = ""

    async def _start_template(self) -> None:
        """The process workers are forked from: imports and function loaded once (warm snapshot)."""
        c = self.config
        # removed by stop(); if this process is killed first, by the next runtime's start
        self._sockdir = owned_tempdir("rollart-rt-")
        path = os.path.join(self._sockdir, "workers.sock")
        self._unix = await asyncio.start_unix_server(self._on_worker, path, limit=64 << 20)
        t0 = time.monotonic()
        self._template = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "rollart_reward._worker",
            c.function,
            json.dumps(c.options),
            path,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        assert self._template.stdout is not None
        line = await asyncio.wait_for(self._template.stdout.readline(), 120)
        if not line or not json.loads(line).get("ready"):
            rc = await self._template.wait()
            raise RuntimeError(f"function runtime: could not load {c.function!r} (template exited {rc})")
        self.template_load_s = time.monotonic() - t0

    async def _on_worker(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hello = json.loads(await reader.readline())
        fut = self._hellos.pop(hello["hello"], None)
        if fut is None or fut.done():
            writer.close()
            os.kill(hello["pid"], signal.SIGKILL)
            return
        fut.set_result(Worker(hello["pid"], reader, writer, time.monotonic()))

    # ---------------------------------------------------------------- autoscaling
    def _spawn(self) -> None:
        self.starting += 1
        task = asyncio.create_task(self._start_worker())
        self._spawns.add(task)
        task.add_done_callback(self._spawns.discard)

    async def _start_worker(self) -> None:
        t0 = time.monotonic()
        token = uuid.uuid4().hex
        fut: asyncio.Future[Worker] = asyncio.get_running_loop().create_future()
        self._hellos[token] = fut
        try:
            tpl = self._template
            if tpl is None or tpl.returncode is not None or tpl.stdin is None:
                raise RuntimeError("the worker template process is gone")
            tpl.stdin.write((json.dumps({"fork": token}) + "\n").encode())
            await tpl.stdin.drain()
            w = await asyncio.wait_for(fut, 30)
            w.spawned = t0
            w.init_s = time.monotonic() - t0
        except BaseException as exc:
            self.starting -= 1
            self._hellos.pop(token, None)
            self.meter.add_provisioned(time.monotonic() - t0)
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                fut.result().kill()
            if not isinstance(exc, Exception):
                raise
            log.error("function runtime: worker start failed: %r", exc)
            self.counters["worker_start_failures"] += 1
            if self.waiters and not self.workers:  # nothing will ever serve them: fail them
                while self.waiters:
                    fut = self.waiters.popleft()
                    if not fut.done():
                        fut.set_exception(RuntimeError(f"cannot start a worker: {exc}"))
            return
        self.starting -= 1
        self.workers.append(w)
        self.peak_workers = max(self.peak_workers, len(self.workers))
        self.meter.cold_starts += 1
        self.cold_start_s.append(time.monotonic() - t0)
        self._cold_ewma = (
            0.8 * self._cold_ewma + 0.2 * self.cold_start_s[-1] if self._cold_ewma else self.cold_start_s[-1]
        )
        self.release(w)

    def release(self, w: Worker) -> None:
        """Hand ``w`` to the longest waiting call, or park it idle with a fresh keep-alive."""
        while self.waiters:
            fut = self.waiters.popleft()
            if not fut.done():
                fut.set_result(w)
                return
        w.idle_since = time.monotonic()
        self._releases += 1
        w.keep_alive = self.keep_alive(explore=self._releases % 8 == 0)
        self.idle.append(w)

    def keep_alive(self, explore: bool = False) -> float:
        """Keep-alive for an idle period starting now (see ``ScalingConfig.idle_policy``)."""
        c = self.config
        if c.idle_policy == "fixed":
            return c.idle_timeout_s
        ski = max(c.idle_timeout_s, self._cold_ewma)
        if c.idle_policy == "ski_rental" or explore or len(self._gaps) < 16:
            return ski
        return learned_keep_alive(list(self._gaps), self._cold_ewma, ski)

    async def acquire(self) -> Worker:
        """An idle worker, or wait for one (starting a worker if fewer are starting than wait);
        :class:`Overloaded` when ``max_queue`` calls already wait."""
        if self.idle:
            w = self.idle.pop()  # most recently used: lets the others go idle and scale down
            self._gaps.append(time.monotonic() - w.idle_since)
            return w
        if len(self.waiters) >= self.config.max_queue:
            raise Overloaded()
        fut: asyncio.Future[Worker] = asyncio.get_running_loop().create_future()
        self.waiters.append(fut)
        waiting = sum(1 for f in self.waiters if not f.done())
        if self.starting < waiting and len(self.workers) + self.starting < self.config.max_workers:
            self._spawn()
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release(fut.result())
            raise

    async def retire(self, w: Worker) -> None:
        """Stop ``w`` and book its lifetime as provisioned time."""
        if w in self.workers:
            self.workers.remove(w)
            end = time.monotonic()
            self.meter.add_provisioned(end - max(w.spawned, self.meter.t0))
        if w in self.idle:
            self.idle.remove(w)
        w.kill()

    async def _reap_idle(self) -> None:
        while True:
            await asyncio.sleep(min(0.02, self.config.idle_timeout_s / 4))
            now = time.monotonic()
            for w in list(self.idle):
                if len(self.workers) <= self.config.min_workers:
                    break
                if now - w.idle_since >= w.keep_alive:
                    self.idle.remove(w)
                    self._gaps.append(math.inf)  # no call came within its keep-alive
                    await self.retire(w)

    # ---------------------------------------------------------------- reporting
    def stats(self) -> dict[str, Any]:
        """The pool's part of ``GET /stats``."""
        return {
            "workers": len(self.workers),
            "idle_workers": len(self.idle),
            "starting": self.starting,
            "peak_workers": self.peak_workers,
            "queued": sum(1 for f in self.waiters if not f.done()),
            "template_load_s": self.template_load_s,
            "cold_start_s_mean": sum(self.cold_start_s) / len(self.cold_start_s)
            if self.cold_start_s
            else 0.0,
            "keep_alive_s": self.keep_alive(),
            "idle_policy": self.config.idle_policy,
            "pids": {
                "template": self._template.pid if self._template is not None else None,
                "workers": [w.pid for w in self.workers],
            },
        }

    def live_provisioned_s(self) -> float:
        """Provisioned seconds of the workers alive now (not yet booked by ``retire``)."""
        now = time.monotonic()
        return sum(now - max(w.spawned, self.meter.t0) for w in self.workers)

    def reset(self) -> None:
        """Forget peak and cold-start history (``POST /admin/reset``)."""
        self.peak_workers = len(self.workers)
        self.cold_start_s.clear()
