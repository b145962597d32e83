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
    return Trajectory(
        traj_id=f"t{i}",
        task="t",
        env_id="e",
        group_id="g",
        seed=0,
        start_version=0,
        info={"work_s": 0.02, **info},
    )


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
def serving(*args: str, env: dict[str, str] | None = None) -> Iterator[str]:
    """``rollart-reward serve --function synthetic ARGS`` as a real process; yields its URL, ends it by PID."""
    proc = subprocess.Popen(
        [*_serve_cmd(), "serve", "--function", "synthetic", *args],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
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
    with serving(
        "--max-workers",
        "6",
        "--idle-timeout",
        "0.5",
        "--idle-policy",
        "fixed",
        "--admin",
        "--max-body-bytes",
        str(1 << 20),
        "--max-batch",
        "64",
        "--options",
        json.dumps({"work_s": 0.02}),
    ) as url:
        yield url


def admin(url: str, faults: dict[str, Any] | None = None) -> None:
    httpx.post(f"{url}/admin/faults", json=faults or {}).raise_for_status()
    httpx.post(f"{url}/admin/reset").raise_for_status()


def stats(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/stats").json()


def executor(url: str, **kw: Any) -> HttpExecutor:
    cfg = {
        "url": url,
        "function": "synthetic",
        "timeout_s": 0.6,
        "cold_start_timeout_s": 0.6,
        "retries": 8,
        "backoff_base_s": 0.01,
        "backoff_max_s": 0.1,
        "seed": 0,
        **kw,
    }
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
    assert c["http_timeouts"] >= s["fault_delay"]  # every held-back answer was a client timeout
    # every trajectory's function ran exactly once, however often it was retried
    assert s["executions"] == 30 and s["max_executions_per_key"] == 1
    for t in ts[:5]:
        key = idempotency_key(t, "synthetic")
        assert httpx.get(f"{runtime}/executions/{key}").json()["executions"] == 1


async def test_malformed_json_is_retried_then_fails_with_body_logged(
    runtime: str, caplog: pytest.LogCaptureFixture
) -> None:
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
    with serving(
        "--max-workers", "2", "--idle-timeout", "0.15", "--options", json.dumps({"work_s": 0.005})
    ) as url:
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
        results = await asyncio.gather(
            *(ex.score(traj(f"{adapter}{invocation}{i}", score=i)) for i in range(6))
        )
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
        failed = asyncio.gather(
            ex.score(traj("batch-fail", fail=True)), ex.score(traj("batch-ok")), return_exceptions=True
        )
        bad, good = await failed
    finally:
        await ex.aclose()
    assert [r.score for r in results] == [float(i) for i in range(16)]
    assert isinstance(bad, RewardError) and good.score == 1.0
    assert ex.stats()["batches"] <= 4


def test_serve_rejects_unknown_function() -> None:
    r = subprocess.run(
        [*_serve_cmd(), "serve", "--function", "no_such_reward"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2 and "unknown reward implementation 'no_such_reward'" in r.stderr


# ---------------------------------------------------------------- the hardened HTTP surface
def wire(i: int | str, **info: Any) -> dict[str, Any]:
    from rollart_reward.wire import trajectory_to_dict

    return trajectory_to_dict(traj(i, **info))


def test_bearer_token_401_without_it_200_with_it() -> None:
    with serving("--options", json.dumps({"work_s": 0.0}), env={"ROLLART_REWARD_API_KEY": "s3cret"}) as url:
        body = {"key": "tok1", "trajectory": wire("tok1", score=2)}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = httpx.post(f"{url}/invoke", json=body, headers=headers)
            assert r.status_code == 401 and "bearer token" in r.json()["error"], (headers, r.text)
        assert httpx.get(f"{url}/stats").status_code == 401
        assert httpx.get(f"{url}/healthz").status_code == 200  # liveness stays open
        r = httpx.post(f"{url}/invoke", json=body, headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200 and r.json()["result"]["score"] == 2.0
        stats = httpx.get(f"{url}/stats", headers={"Authorization": "Bearer s3cret"}).json()
        assert stats["unauthorized"] == 4 and stats["executions"] == 1


async def test_http_executor_sends_the_token_and_a_401_is_not_retried() -> None:
    with serving("--options", json.dumps({"work_s": 0.0}), "--api-key", "k1") as url:
        ex = executor(url, api_key="k1")
        bad = executor(url, api_key="other")
        try:
            assert (await ex.score(traj("auth-ok", score=4))).score == 4.0
            with pytest.raises(RewardError, match="HTTP 401"):
                await bad.score(traj("auth-bad"))
        finally:
            await ex.aclose()
            await bad.aclose()
        assert bad.stats()["http_attempts"] == 1


_VALID = {"traj_id": "v", "task": "t", "env_id": "e", "group_id": "g", "seed": 0, "start_version": 0}
_FC = "/2023-03-30/functions/synthetic/invocations"
_LAMBDA = "/2015-03-31/functions/synthetic/invocations"
BAD_BODIES: list[tuple[str, str, bytes | Any, dict[str, str], int]] = [
    # (name, path, body (bytes raw, else JSON), headers, expected status)
    ("not-json", "/invoke", b"{nope", {}, 400),
    ("not-utf8", "/invoke", b"\xff\xfe\xfa", {}, 400),
    ("deeply-nested", "/invoke", b"[" * 100_000 + b"]" * 100_000, {}, 400),
    ("number-body", "/invoke", 5, {}, 400),
    ("list-body", "/invoke", [1, 2], {}, 400),
    ("null-body", "/invoke", None, {}, 400),
    ("no-trajectory", "/invoke", {"key": "k"}, {}, 400),
    ("trajectory-number", "/invoke", {"trajectory": 5}, {}, 400),
    ("trajectory-string", "/invoke", {"trajectory": "x"}, {}, 400),
    ("trajectory-empty", "/invoke", {"trajectory": {}}, {}, 400),
    ("unknown-field", "/invoke", {"trajectory": {**_VALID, "bogus": 1}}, {}, 400),
    ("seed-string", "/invoke", {"trajectory": {**_VALID, "seed": "x"}}, {}, 400),
    ("turns-number", "/invoke", {"trajectory": {**_VALID, "turns": 3}}, {}, 400),
    ("turn-not-object", "/invoke", {"trajectory": {**_VALID, "turns": [7]}}, {}, 400),
    ("turn-ids-strings", "/invoke", {"trajectory": {**_VALID, "turns": [{"context_ids": ["a"]}]}}, {}, 400),
    ("bad-fate", "/invoke", {"trajectory": {**_VALID, "fate": "eaten"}}, {}, 400),
    ("info-list", "/invoke", {"trajectory": {**_VALID, "info": []}}, {}, 400),
    ("key-number", "/invoke", {"key": 5, "trajectory": _VALID}, {}, 400),
    ("key-too-long", "/invoke", {"key": "k" * 1000, "trajectory": _VALID}, {}, 400),
    ("items-number", "/invoke", {"items": 5}, {}, 400),
    ("items-bad-item", "/invoke", {"items": [{"trajectory": _VALID}, 5]}, {}, 400),
    ("items-too-many", "/invoke", {"items": [{"trajectory": _VALID}] * 65}, {}, 413),
    ("too-large", "/invoke", b'{"trajectory": "' + b"x" * (2 << 20) + b'"}', {}, 413),
    ("lambda-not-json", _LAMBDA, b"{", {}, 400),
    ("lambda-number", _LAMBDA, 5, {}, 400),
    ("lambda-no-trajectory", _LAMBDA, {}, {}, 400),
    ("lambda-bad-invocation", _LAMBDA, {"trajectory": _VALID}, {"X-Amz-Invocation-Type": "Maybe"}, 400),
    ("lambda-event-no-key", _LAMBDA, {"trajectory": _VALID}, {"X-Amz-Invocation-Type": "Event"}, 400),
    ("fc-not-json", _FC, b"]", {}, 400),
    ("fc-trajectory-list", _FC, {"trajectory": [1]}, {}, 400),
    ("fc-bad-invocation", _FC, {"trajectory": _VALID}, {"x-fc-invocation-type": "Later"}, 400),
    ("fc-async-no-task-id", _FC, {"trajectory": _VALID}, {"x-fc-invocation-type": "Async"}, 400),
    ("admin-faults-bad", "/admin/faults", {"error_before": 7}, {}, 400),
]


@pytest.mark.parametrize("name,path,body,headers,expected", BAD_BODIES, ids=[b[0] for b in BAD_BODIES])
def test_malformed_bodies_are_4xx_with_a_message(
    runtime: str, name: str, path: str, body: Any, headers: dict[str, str], expected: int
) -> None:
    admin(runtime)
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(
        f"{runtime}{path}",
        content=content,
        headers={"Content-Type": "application/json", **headers},
        timeout=30,
    )
    assert r.status_code == expected, (name, r.status_code, r.text[:300])
    message = r.json()
    assert isinstance(message, dict) and any(isinstance(v, str) and v for v in message.values()), r.text[:300]
    # the server still answers, and a good call still works
    assert httpx.get(f"{runtime}/healthz").status_code == 200
    ok = httpx.post(f"{runtime}/invoke", json={"trajectory": wire(f"after-{name}", score=1.5)}, timeout=30)
    assert ok.status_code == 200 and ok.json()["result"]["score"] == 1.5


async def test_a_key_cannot_be_pre_seeded_with_another_trajectory(runtime: str) -> None:
    admin(runtime)
    genuine, forged = wire("seed-me", score=1), wire("seed-me", score=0, forged=True)
    key = "victim-key"
    async with httpx.AsyncClient(base_url=runtime, timeout=30) as client:
        r = await client.post("/invoke", json={"key": key, "trajectory": forged})  # the attacker goes first
        assert r.status_code == 200 and r.json()["result"]["score"] == 0.0
        r = await client.post("/invoke", json={"key": key, "trajectory": genuine})
        assert r.status_code == 409 and "different trajectory" in r.json()["error"]
        r = await client.post(
            "/invoke", json={"key": key, "trajectory": forged}
        )  # a true retry still replays
        assert r.status_code == 200 and r.json()["result"]["score"] == 0.0
        # while running, too: a second body under a running call's key is refused, not joined
        slow, other = wire("running", score=3, work_s=0.5), wire("running", score=4)
        first = asyncio.create_task(client.post("/invoke", json={"key": "k-running", "trajectory": slow}))
        await until(lambda: _running_calls(runtime), 10, "the first call to run")
        second = await client.post("/invoke", json={"key": "k-running", "trajectory": other})
        assert second.status_code == 409
        assert (await first).json()["result"]["score"] == 3.0
        # the same for async task ids (FC) and Event keys (Lambda)
        fc = {"x-fc-invocation-type": "Async", "x-fc-async-task-id": "task-seed"}
        assert (await client.post(_FC, json={"trajectory": forged}, headers=fc)).status_code == 202
        assert (await client.post(_FC, json={"trajectory": genuine}, headers=fc)).status_code == 409
        assert (await client.post(_FC, json={"trajectory": forged}, headers=fc)).status_code == 202
        ev = {"X-Amz-Invocation-Type": "Event"}
        assert (
            await client.post(_LAMBDA, json={"key": "ev-seed", "trajectory": forged}, headers=ev)
        ).status_code == 202
        r = await client.post(_LAMBDA, json={"key": "ev-seed", "trajectory": genuine}, headers=ev)
        assert r.status_code == 409
    s = stats(runtime)
    assert s["key_conflicts"] >= 2 and httpx.get(f"{runtime}/executions/{key}").json()["executions"] == 1


async def _running_calls(url: str) -> bool:
    return stats(url)["in_flight"] > 0


async def test_async_task_table_forgets_finished_tasks_and_is_bounded() -> None:
    with serving(
        "--max-workers", "2", "--max-async-tasks", "8", "--options", json.dumps({"work_s": 0.0})
    ) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            fc = {"x-fc-invocation-type": "Async"}

            async def settled() -> bool:
                return stats(url)["async_tasks_running"] == 0

            for i in range(40):  # one at a time: each finishes before the next
                r = await client.post(
                    _FC,
                    json={"trajectory": wire(f"a{i}", score=i)},
                    headers={**fc, "x-fc-async-task-id": f"task{i}"},
                )
                assert r.status_code == 202
                ev = await client.post(
                    _LAMBDA,
                    json={"key": f"ev{i}", "trajectory": wire(f"ev{i}")},
                    headers={"X-Amz-Invocation-Type": "Event"},
                )
                assert ev.status_code == 202
                # the table bounds running tasks (429 beyond): let this pair finish before the next,
                # else a loaded machine keeps 8 running and the loop measures the other bound
                await until(settled, 20, "async tasks to finish")

            await until(settled, 20, "async tasks to finish")
            s = stats(url)
            assert s["async_tasks_held"] <= 8 and s["executions"] == 80, s
            newest = (await client.get("/2023-03-30/functions/synthetic/async-tasks/task39")).json()
            assert newest["status"] == "Succeeded" and json.loads(newest["returnPayload"])["score"] == 39.0
            assert (await client.get("/2023-03-30/functions/synthetic/async-tasks/task0")).status_code == 404
            # running tasks are bounded too: beyond the limit a new one is refused with 429
            statuses = [
                (
                    await client.post(
                        _FC,
                        json={"trajectory": wire(f"slow{i}", work_s=1.0)},
                        headers={**fc, "x-fc-async-task-id": f"slow{i}"},
                    )
                ).status_code
                for i in range(10)
            ]
            assert statuses.count(202) == 8 and statuses[8:] == [429, 429], statuses
