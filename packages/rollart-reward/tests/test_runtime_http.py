"""Serverless offload over real HTTP: the reference function runtime (``rollart-reward serve``, a real
process on 127.0.0.1) and the HTTP executor — retries without double counting, malformed bodies,
function errors, circuit-breaker fallback, autoscaling up and down to zero, platform adapters, batching.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import httpx
import pytest

from rollart_core.errors import RewardError
from rollart_core.types import Trajectory
from rollart_reward.http_executor import HttpExecutor, HttpExecutorConfig
from rollart_reward.rewards import SyntheticReward
from rollart_reward.wire import idempotency_key


def traj(i: int | str, **info: Any) -> Trajectory:
    return Trajectory(traj_id=f"t{i}", task="t", env_id="e", group_id="g", seed=0, start_version=0,
                      info={"work_s": 0.02, **info})


async def until(cond: Callable[[], Awaitable[bool]], timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not await cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


def _serve_cmd() -> list[str]:
    exe = shutil.which("rollart-reward", path=os.path.dirname(sys.executable))
    return [exe] if exe else [sys.executable, "-m", "rollart_reward.cli"]


@contextlib.contextmanager
def serving(*args: str) -> Iterator[str]:
    """``rollart-reward serve --function synthetic ARGS`` as a real process; yields its URL, ends it by PID."""
    proc = subprocess.Popen([*_serve_cmd(), "serve", "--function", "synthetic", *args], stdout=subprocess.PIPE,
                            text=True)
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line.startswith("serving synthetic on http://127.0.0.1:"), line
        yield line.split()[-1]
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def runtime() -> Iterator[str]:
    with serving("--max-workers", "6", "--idle-timeout", "0.5", "--idle-policy", "fixed", "--admin",
                 "--options", json.dumps({"work_s": 0.02})) as url:
        yield url


def admin(url: str, faults: dict[str, Any] | None = None) -> None:
    httpx.post(f"{url}/admin/faults", json=faults or {}).raise_for_status()
    httpx.post(f"{url}/admin/reset").raise_for_status()


def stats(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/stats").json()


def executor(url: str, **kw: Any) -> HttpExecutor:
    cfg = {"url": url, "function": "synthetic", "timeout_s": 0.6, "cold_start_timeout_s": 0.6,
           "retries": 8, "backoff_base_s": 0.01, "backoff_max_s": 0.1, "seed": 0, **kw}
    return HttpExecutor(HttpExecutorConfig(**cfg))


async def test_retries_on_503_and_timeouts_never_double_count(runtime: str) -> None:
    admin(runtime, {"seed": 3, "error_before": 0.15, "error_after": 0.15, "delay": 0.1, "delay_s": 1.0})
    ex = executor(runtime)
    try:
        ts = [traj(f"retry{i}", score=i) for i in range(30)]
        results = await asyncio.gather(*(ex.score(t) for t in ts))
    finally:
        await ex.aclose()
    assert [r.score for r in results] == [float(i) for i in range(30)]
    s, c = stats(runtime), ex.stats()
    assert s["fault_error_before"] > 0 and s["fault_error_after"] > 0 and s["fault_delay"] > 0
    assert c["retries"] > 0 and c["http_attempts"] > 30
    # every trajectory's function ran exactly once, however often it was retried
    assert s["executions"] == 30 and s["max_executions_per_key"] == 1
    for t in ts[:5]:
        key = idempotency_key(t, "synthetic")
        assert httpx.get(f"{runtime}/executions/{key}").json()["executions"] == 1


async def test_malformed_json_is_retried_then_fails_with_body_logged(
        runtime: str, caplog: pytest.LogCaptureFixture) -> None:
    admin(runtime, {"malformed": 1.0})
    ex = executor(runtime, retries=2)
    caplog.set_level(logging.WARNING, logger="rollart_reward.http_executor")
    try:
        with pytest.raises(RewardError, match="after 3 attempts"):
            await ex.score(traj("bad-json"))
    finally:
        await ex.aclose()
    assert ex.stats()["retries"] == 2
    assert any('{"result": {"score": 1.0, "det' in r.getMessage() for r in caplog.records)
    assert stats(runtime)["executions"] == 1  # the body was garbage, but the function ran once


async def test_raising_function_fails_after_retries(runtime: str) -> None:
    admin(runtime)
    ex = executor(runtime, retries=2)
    try:
        with pytest.raises(RewardError, match="synthetic failure"):
            await ex.score(traj("boom", fail=True))
        assert (await ex.score(traj("fine"))).score == 1.0
    finally:
        await ex.aclose()
    assert ex.stats()["breaker_state"] == "closed"  # the endpoint was healthy all along
    assert stats(runtime)["function_errors"] == 3


async def test_circuit_breaker_falls_back_and_recovers(runtime: str) -> None:
    admin(runtime, {"error_before": 1.0})
    ex = executor(runtime, retries=3, breaker_failures=3, breaker_reset_s=0.5)
    ex.fallback = _Inline()
    try:
        results = [await ex.score(traj(f"cb{i}", score=7)) for i in range(5)]
        assert [r.score for r in results] == [7.0] * 5
        st = ex.stats()
        assert st["breaker_opens"] == 1 and st["fallbacks"] == 5 and st["http_attempts"] == 3
        admin(runtime)  # endpoint healthy again: after breaker_reset_s a probe closes the circuit

        async def served_remotely() -> bool:
            before = ex.stats()["http_attempts"]
            await ex.score(traj(f"probe{time.monotonic()}"))
            return ex.stats()["http_attempts"] > before and ex.breaker.state == "closed"

        await until(served_remotely, 10, "circuit to close")
    finally:
        await ex.aclose()


class _Inline:
    """Fallback executor: the same function run in-process (what HttpExecutor builds from ``fn``)."""

    def __init__(self) -> None:
        from rollart_reward.executor import InlineExecutor

        self.inner = InlineExecutor(SyntheticReward())

    async def score(self, t: Trajectory) -> Any:
        return await self.inner.score(t)

    def stats(self) -> dict[str, float]:
        return self.inner.stats()


async def test_autoscaling_up_under_burst_and_down_to_zero(runtime: str) -> None:
    admin(runtime)

    async def zero() -> bool:
        return stats(runtime)["workers"] == 0

    await until(zero, 10, "scale to zero before the burst")
    ex = executor(runtime, timeout_s=10, cold_start_timeout_s=10)
    try:
        results = await asyncio.gather(*(ex.score(traj(f"burst{i}", work_s=0.4)) for i in range(18)))
    finally:
        await ex.aclose()
    assert len(results) == 18
    s = stats(runtime)
    assert s["peak_workers"] >= 4 and s["cold_starts"] >= 4, s
    assert s["peak_workers"] <= 6  # max_workers
    assert s["busy_s"] >= 18 * 0.4 * 0.95 and 0 < s["utilisation"] <= 1
    assert ex.stats()["cold_starts"] >= 1  # reported back to the client by X-Rollart-Cold-Start
    await until(zero, 10, "scale back to zero after the burst")
    # provisioned = every worker's lifetime (cold start + calls + >= 0.5 s keep-alive each);
    # billed = per request (duration rounded up to 1 ms, plus the init of a cold call), no keep-alive
    s = stats(runtime)
    assert s["workers"] == 0 and s["calls"] == 18
    cold_init = s["cold_starts"] * s["cold_start_s_mean"]
    assert s["busy_s"] < s["billed_s"] <= s["busy_s"] + cold_init + 18 * 0.001 + 1e-6, s
    assert s["provisioned_s"] >= s["busy_s"] + s["cold_starts"] * 0.5 * 0.95 > s["billed_s"], s
    assert s["utilisation"] < s["utilisation_billed"] <= 1.0


async def test_learned_keep_alive_stops_paying_for_idle_workers_that_never_get_a_call() -> None:
    """Isolated calls (each worker stopped before the next call comes): the learned policy starts at
    the ski-rental keep-alive and, once it has seen enough such idle periods, keeps workers idle for 0 s."""
    with serving("--max-workers", "2", "--idle-timeout", "0.15", "--options", json.dumps({"work_s": 0.005})) as url:
        assert stats(url)["keep_alive_s"] >= 0.15 and stats(url)["idle_policy"] == "learned"

        async def zero() -> bool:
            return stats(url)["workers"] == 0

        ex = executor(url, timeout_s=10, cold_start_timeout_s=10)
        try:
            for i in range(18):
                await ex.score(traj(f"iso{i}"))
                await until(zero, 10, "the idle worker to be stopped")
        finally:
            await ex.aclose()
        s = stats(url)
        assert s["cold_starts"] == 18 and s["keep_alive_s"] == 0.0, s


@pytest.mark.parametrize("adapter,invocation", [("lambda", "sync"), ("fc", "sync"), ("fc", "async")])
async def test_platform_adapters(runtime: str, adapter: str, invocation: str) -> None:
    admin(runtime, {"seed": 1, "error_before": 0.2})
    ex = executor(runtime, adapter=adapter, invocation=invocation, timeout_s=5, cold_start_timeout_s=5)
    try:
        results = await asyncio.gather(*(ex.score(traj(f"{adapter}{invocation}{i}", score=i)) for i in range(6)))
        assert [r.score for r in results] == [float(i) for i in range(6)]
        with pytest.raises(RewardError, match="synthetic failure"):
            await ex.score(traj(f"{adapter}{invocation}-fail", fail=True))
    finally:
        await ex.aclose()
    assert stats(runtime)["fault_error_before"] > 0
    for i in range(6):  # retried submissions/polls never re-ran a function that succeeded
        key = idempotency_key(traj(f"{adapter}{invocation}{i}"), "synthetic")
        assert httpx.get(f"{runtime}/executions/{key}").json()["executions"] == 1


async def test_batching_groups_concurrent_calls(runtime: str) -> None:
    admin(runtime)
    ex = executor(runtime, batch_size=8, batch_wait_s=0.02, timeout_s=5, cold_start_timeout_s=5)
    try:
        results = await asyncio.gather(*(ex.score(traj(f"batch{i}", score=i)) for i in range(16)))
        failed = asyncio.gather(ex.score(traj("batch-fail", fail=True)), ex.score(traj("batch-ok")),
                                return_exceptions=True)
        bad, good = await failed
    finally:
        await ex.aclose()
    assert [r.score for r in results] == [float(i) for i in range(16)]
    assert isinstance(bad, RewardError) and good.score == 1.0
    assert ex.stats()["batches"] <= 4


def test_serve_rejects_unknown_function() -> None:
    r = subprocess.run([*_serve_cmd(), "serve", "--function", "no_such_reward"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "unknown reward implementation 'no_such_reward'" in r.stderr
