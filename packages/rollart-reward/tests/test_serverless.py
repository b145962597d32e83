"""The ``serverless`` reward executor with real processes: it starts ``rollart-reward serve`` (a local child,
or the child of a real Ray actor), scores through it, restarts it after ``kill -9`` (in-flight calls
still succeed), gives up with a named error once the restart budget is spent, and ``aclose()`` leaves
no process behind (serve, template and worker PIDs all checked).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from rollart_core.errors import ConfigError, RewardError
from rollart_core.registry import build
from rollart_core.types import Trajectory
from rollart_reward.cli import _parser
from rollart_reward.rewards import SyntheticConfig, SyntheticReward
from rollart_reward.runtime import ScalingConfig
from rollart_reward.serverless import RewardRef, ServerlessExecutor, reward_of, serve_command

pytestmark = pytest.mark.timeout(180)


def traj(i: int | str, **info: Any) -> Trajectory:
    return Trajectory(
        traj_id=f"t{i}",
        task="t",
        env_id="e",
        group_id="g",
        seed=0,
        start_version=0,
        info={"work_s": 0.01, **info},
    )


def executor(launch: str = "local", **options: Any) -> ServerlessExecutor:
    opts = {
        "launch": launch,
        "runtime": {"max_workers": 4, "idle_timeout_s": 5},
        "http": {"fallback": "none", "timeout_s": 10, "cold_start_timeout_s": 10, "backoff_max_s": 0.2},
        **options,
    }
    return build(
        "reward_executor",
        "serverless",
        opts,
        "reward_executor.options",
        fn=build("reward", "synthetic", {"work_s": 0.01}, "reward.options"),
    )


def runtime_stats(ex: ServerlessExecutor) -> dict[str, Any]:
    r = httpx.get(f"{ex.url}/stats", headers={"Authorization": f"Bearer {ex.api_key}"}, timeout=5)
    r.raise_for_status()
    return r.json()


def runtime_pids(ex: ServerlessExecutor) -> list[int]:
    pids = runtime_stats(ex)["pids"]
    assert ex.pid is not None and pids["template"] is not None
    return [ex.pid, pids["template"], *pids["workers"]]


def running(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


async def until(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def all_gone(pids: list[int]) -> None:
    await until(
        lambda: not any(running(p) for p in pids),
        15,
        f"processes {[p for p in pids if running(p)]} to be gone",
    )


async def test_starts_a_runtime_scores_through_it_and_aclose_leaves_no_process() -> None:
    ex = executor()
    try:
        assert (ex.function, ex.options) == ("synthetic", {"work_s": 0.01})  # found from the task's fn
        results = await asyncio.gather(*(ex.score(traj(f"ok{i}", score=i)) for i in range(12)))
        assert [r.score for r in results] == [float(i) for i in range(12)]
        assert ex.url.startswith("http://127.0.0.1:")
        pids = runtime_pids(ex)
        assert len(pids) >= 3 and all(running(p) for p in pids)  # serve, template, >= 1 worker
        assert (
            httpx.post(f"{ex.url}/invoke", json={"trajectory": {}}).status_code == 401
        )  # a token by default
        s = await ex.astats()
        assert s["runtime_calls"] == 12 and s["runtime_executions"] == 12 and s["runtime_cold_starts"] >= 1
        assert 0 < s["runtime_utilisation"] <= 1 and s["runtime_restarts"] == 0
    finally:
        await ex.aclose()
    await all_gone(pids)
    await ex.aclose()  # idempotent
    assert ex.stats()["runtime_calls"] == 12  # the stopped runtime's counters are kept
    with pytest.raises(RewardError, match="closed"):
        await ex.score(traj("after-close"))


async def test_kill_9_mid_run_restarts_the_runtime_and_in_flight_calls_succeed() -> None:
    ex = executor(restarts=2)
    try:
        await ex.start()
        first_pids = runtime_pids(ex)
        old_pid = ex.pid
        assert old_pid is not None
        calls = [asyncio.create_task(ex.score(traj(f"kill{i}", score=i, work_s=0.5))) for i in range(6)]
        await until(lambda: runtime_stats(ex)["in_flight"] > 0, 20, "calls running in the runtime")
        os.kill(old_pid, signal.SIGKILL)
        results = await asyncio.wait_for(asyncio.gather(*calls), 60)
        assert [r.score for r in results] == [float(i) for i in range(6)]
        assert ex.restarts == 1 and ex.deaths == 1 and ex.pid != old_pid
        assert (await ex.score(traj("after-restart", score=9))).score == 9.0
        await all_gone(first_pids)  # the dead runtime's template and workers followed it
        pids = runtime_pids(ex)
    finally:
        await ex.aclose()
    await all_gone(pids)


async def test_restart_budget_spent_fails_naming_the_stage_and_url() -> None:
    ex = executor(restarts=0)
    try:
        await ex.score(traj("before"))
        url, pid = ex.url, ex.pid
        assert pid is not None
        pids = runtime_pids(ex)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(
            RewardError,
            match=f"reward stage: the function runtime at {url} died and its restart "
            r"budget \(0\) is spent",
        ):
            await asyncio.wait_for(ex.score(traj("after", work_s=0.01)), 60)
        await all_gone(pids)
    finally:
        await ex.aclose()


async def test_url_mode_connects_to_a_runtime_it_does_not_own() -> None:
    owner = executor()
    try:
        await owner.start()
        guest = build(
            "reward_executor", "serverless", {"url": owner.url, "http": {"api_key": owner.api_key}}, "x"
        )
        try:
            assert (await guest.score(traj("guest", score=3))).score == 3.0
        finally:
            await guest.aclose()
        assert runtime_stats(owner)["executions"] == 1  # guest's aclose stopped nothing
    finally:
        await owner.aclose()


def test_options_url_excludes_own_runtime_options_and_bad_options_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="url is set, but \\['host', 'runtime'\\]"):
        build(
            "reward_executor",
            "serverless",
            {"url": "http://127.0.0.1:1", "host": "127.0.0.2", "runtime": {"max_workers": 2}},
            "x",
        )
    with pytest.raises(ConfigError, match="no_such_option"):
        build("reward_executor", "serverless", {"no_such_option": 1}, "x", fn=SyntheticReward())
    with pytest.raises(ConfigError, match="no reward function to serve"):
        build("reward_executor", "serverless", {}, "x")
    with pytest.raises(ConfigError, match="host 'node' needs Ray"):
        ServerlessExecutor(
            ServerlessExecutor.Config(launch="local", host="node"), fn=SyntheticReward()
        )._new_handle()


def test_reward_served_is_the_tasks_function() -> None:
    fn = SyntheticReward(SyntheticConfig(work_s=0.2))
    assert reward_of(None, fn) == ("synthetic", {"work_s": 0.2})
    assert reward_of(RewardRef(impl="exact_match", options={"a": 1}), fn) == ("exact_match", {"a": 1})

    class Local(SyntheticReward):
        pass

    with pytest.raises(ConfigError, match="cannot be imported by the runtime"):
        reward_of(None, Local())


def test_every_scaling_option_reaches_the_serve_command() -> None:
    scaling = ScalingConfig(
        min_workers=1,
        max_workers=3,
        idle_timeout_s=0.7,
        idle_policy="fixed",
        call_timeout_s=9,
        max_queue=11,
        cache_size=12,
        max_body_bytes=4096,
        body_timeout_s=2.5,
        max_batch=13,
        max_async_tasks=14,
    )
    argv = serve_command("synthetic", {"work_s": 0.1}, "127.0.0.1", 0, scaling)
    args = _parser().parse_args(argv[argv.index("serve") :])
    assert (
        args.min_workers,
        args.max_workers,
        args.idle_timeout,
        args.idle_policy,
        args.call_timeout,
        args.max_queue,
        args.cache_size,
        args.max_body_bytes,
        args.body_timeout,
        args.max_batch,
        args.max_async_tasks,
    ) == (1, 3, 0.7, "fixed", 9.0, 11, 12, 4096, 2.5, 13, 14)
    assert "--api-key" not in argv  # the token travels in the environment, not on a visible command line


def test_fault_injection_reaches_the_serve_command() -> None:
    """``runtime.faults`` of a runtime the executor starts (chaos runs) arrives as ``--faults`` JSON."""
    from rollart_reward.runtime import FaultConfig

    scaling = ScalingConfig(faults={"seed": 7, "error_before": 0.1, "delay": 0.1, "delay_s": 3.0})
    argv = serve_command("synthetic", {}, "127.0.0.1", 0, scaling)
    args = _parser().parse_args(argv[argv.index("serve") :])
    assert FaultConfig.model_validate(json.loads(args.faults)) == scaling.faults
    assert (
        json.loads(
            _parser()
            .parse_args(
                serve_command("synthetic", {}, "127.0.0.1", 0, ScalingConfig())[argv.index("serve") :]
            )
            .faults
        )
        == FaultConfig().model_dump()
    )  # none by default


# ---------------------------------------------------------------- the Ray actor path
@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    from rollart_core.resources import LOOPBACK_ENV

    ray = pytest.importorskip("ray")
    saved = {k: os.environ.get(k) for k in LOOPBACK_ENV}
    os.environ.update(LOOPBACK_ENV)
    started = not ray.is_initialized()
    if started:
        ray.init(
            num_cpus=2, resources={"reward_cpu": 1}, include_dashboard=False, _node_ip_address="127.0.0.1"
        )
    try:
        yield ray
    finally:
        if started:
            ray.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.mark.ray
async def test_ray_actor_on_the_pool_runs_the_runtime_restarts_it_and_aclose_stops_it(
    ray_cluster: Any,
) -> None:
    ex = executor(launch="auto", pool="reward_cpu", num_cpus=0.5, restarts=1)
    try:
        assert (await ex.score(traj("ray0", score=5))).score == 5.0
        handle = ex._handle
        assert handle is not None and handle.where == "Ray actor"
        assert ray_cluster.available_resources().get("reward_cpu", 0) == pytest.approx(
            1 - 0.001
        )  # on the pool
        actors = [handle.actor]
        pids = runtime_pids(ex)
        assert os.getppid() != pids[0] and pids[0] != os.getpid()  # the serve process is the actor's child
        os.kill(pids[0], signal.SIGKILL)
        results = await asyncio.wait_for(
            asyncio.gather(*(ex.score(traj(f"ray{i}", score=i)) for i in range(4))), 90
        )
        assert [r.score for r in results] == [0.0, 1.0, 2.0, 3.0] and ex.restarts == 1
        await all_gone(pids)
        pids = runtime_pids(ex)
        actors.append(ex._handle.actor)  # type: ignore[union-attr]
        assert actors[0] is not actors[1]
    finally:
        await ex.aclose()
    await all_gone(pids)
    for actor in actors:  # both runtimes' actors are killed, their pool resource is free again
        with pytest.raises(ray_cluster.exceptions.RayActorError):
            await asyncio.wait_for(actor.alive.remote(), 30)
    await until(
        lambda: ray_cluster.available_resources().get("reward_cpu", 0) == 1, 30, "the pool to be free"
    )
