"""The function runtime's worker pool on its own: real template and forked worker processes.

Queue bound (a call beyond ``max_queue`` is refused at once, not queued), warm reuse (an idle worker
serves the next call without a cold start), a dead template fails waiting calls with an error instead
of leaving them waiting, and ``stop()`` leaves no process behind.
"""

from __future__ import annotations

import asyncio
import collections
import os
import time

import pytest

from rollart_core.types import Trajectory
from rollart_reward.metrics import UtilisationMeter
from rollart_reward.pool import Overloaded, WorkerPool
from rollart_reward.runtime import RuntimeConfig
from rollart_reward.wire import trajectory_to_dict


def running(pid: int) -> bool:
    """True while ``pid`` is a live, non-zombie process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


async def gone(pids: list[int], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while any(running(p) for p in pids):
        if time.monotonic() > deadline:
            raise TimeoutError(f"still running: {[p for p in pids if running(p)]}")
        await asyncio.sleep(0.02)


def call_body(i: int) -> dict:
    return trajectory_to_dict(
        Trajectory(
            traj_id=f"t{i}",
            task="t",
            env_id="e",
            group_id="g",
            seed=0,
            start_version=0,
            info={"score": i / 4},
        )
    )


def pool(**scaling: object) -> WorkerPool:
    config = RuntimeConfig(function="synthetic", options={"work_s": 0.01}, idle_policy="fixed", **scaling)
    return WorkerPool(config, UtilisationMeter(slots=None, billed=True), collections.Counter())


async def test_queue_bound_refuses_at_once_and_an_idle_worker_is_reused_warm() -> None:
    p = pool(max_workers=1, max_queue=1, idle_timeout_s=30)
    await p.start()
    try:
        first = asyncio.create_task(p.acquire())  # no worker yet: waits on a cold start
        await asyncio.sleep(0)
        assert p.stats()["queued"] == 1 and p.starting == 1
        with pytest.raises(Overloaded):
            await p.acquire()  # a second waiting call would exceed max_queue=1
        w = await asyncio.wait_for(first, 30)
        reply = await w.call(call_body(1), timeout=10)
        assert reply["result"] == {"score": 0.25, "details": {"work_s": 0.01}} and reply["busy_s"] >= 0.01
        p.release(w)
        assert p.stats()["idle_workers"] == 1
        again = await p.acquire()  # the idle worker, warm: no second fork
        assert again is w and p.meter.cold_starts == 1 and p.peak_workers == 1
        p.release(again)
        pids = p.stats()["pids"]
        assert running(pids["template"]) and pids["workers"] == [w.pid] and running(w.pid)
    finally:
        await p.stop()
    await gone([pids["template"], w.pid])
    assert p.stats()["workers"] == 0


async def test_a_dead_template_fails_waiting_calls_instead_of_leaving_them_waiting() -> None:
    p = pool(max_workers=2, idle_timeout_s=30)
    await p.start()
    try:
        template = p.stats()["pids"]["template"]
        os.kill(template, 9)
        await gone([template])
        with pytest.raises(RuntimeError, match="cannot start a worker: the worker template process is gone"):
            await asyncio.wait_for(p.acquire(), 10)
        assert p.counters["worker_start_failures"] == 1
        assert p.stats()["queued"] == 0 and p.starting == 0
    finally:
        await p.stop()
