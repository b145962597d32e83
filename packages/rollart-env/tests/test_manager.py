"""EnvManager on a real Ray cluster (127.0.0.1): lifecycles, timeouts, crashes, hangs, actor death,
slow start-up, replacement."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator

import pytest

from rollart_core.errors import ConfigError, EnvError, EnvTimeoutError
from rollart_env import EnvManager, EnvManagerConfig, FrozenLakeConfig, FrozenLakeEnv, plan_episode
from rollart_env.faults import FaultSpec

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

LAKE = {"impl": "frozenlake", "options": {"hole_prob": 0.0, "max_steps": 50}}


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    from rollart_core.config import RayConfig
    from rollart_core.resources import RayCluster

    with RayCluster(RayConfig(num_cpus=4, resources={"env": 8})) as c:
        assert c.started, "a Ray cluster was already running; this module needs its own"
        yield


def manager(**kw) -> EnvManager:
    groups = kw.pop("groups", {"lake": {**LAKE, "num_envs": 2}})
    base = {"envs_per_actor": 4, "step_timeout_s": 5, "reset_timeout_s": 5, "start_timeout_s": 60}
    return EnvManager(EnvManagerConfig.model_validate({"groups": groups, **base, **kw}))


@pytest.fixture
async def lake_manager(ray_cluster) -> AsyncIterator[EnvManager]:
    async with manager() as m:
        yield m


async def until(cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


async def test_lease_matches_a_local_env_and_is_reused(lake_manager: EnvManager) -> None:
    m = lake_manager
    env = await m.acquire("lake")
    local = FrozenLakeEnv(FrozenLakeConfig(hole_prob=0.0, max_steps=50))
    assert env.action_vocabulary == local.action_vocabulary and env.system_prompt == local.system_prompt
    obs, info = await env.reset(7)
    l_obs, l_info = await local.reset(7)
    assert obs == l_obs and info["map"] == l_info["map"] and info["env_id"] == env.env_id
    for a in "RRDxD":
        assert await env.step(a) == await local.step(a)
    await env.close()
    await env.close()  # idempotent
    with pytest.raises(EnvError, match="after close"):
        await env.step("R")
    # both slots are leased round-robin and come back healthy
    ids = set()
    for _ in range(4):
        e = await m.acquire("lake")
        await e.reset(1)
        ids.add(e.env_id)
        await e.close()
    assert len(ids) == 2 and m.stats["replacements"] == 0 and m.stats["envs_started"] == 2


async def test_crash_is_env_error_and_the_env_is_replaced(ray_cluster) -> None:
    spec = FaultSpec(seed=0, crash_prob=1.0, fault_within_calls=2)
    async with manager(groups={"lake": {**LAKE, "num_envs": 1, "faults": spec.model_dump()}}) as m:
        env = await m.acquire("lake")
        plan = plan_episode(spec, 3)
        with pytest.raises(EnvError, match="InjectedCrash: injected crash"):
            await env.reset(3)
            await env.step("R")
        first = env.env_id
        await env.close()
        assert m.stats["replacements"] == 1 and m.stats["retired_raised"] == 1
        nxt = await m.acquire("lake")  # a fresh environment took its place
        assert nxt.env_id != first
        assert plan.fault == "crash"


async def test_hang_times_out_and_the_hung_call_is_cancelled(ray_cluster) -> None:
    spec = FaultSpec(seed=0, hang_prob=1.0, fault_within_calls=1)  # hangs in reset
    async with manager(
        groups={"lake": {**LAKE, "num_envs": 1, "faults": spec.model_dump()}}, reset_timeout_s=0.5
    ) as m:
        env = await m.acquire("lake")
        t0 = time.perf_counter()
        with pytest.raises(EnvTimeoutError, match="reset exceeded"):
            await env.reset(1)
        assert time.perf_counter() - t0 < 3
        await env.close()
        actor = m.actors[0].handle
        # the replacement starts; the hung coroutine in the actor is cancelled
        await m.wait_ready("lake", 1)
        info = await actor.info.remote()
        assert info["running"] == 0 and info["envs"] == 1
        assert m.stats["timeouts"] == 1 and m.stats["replacements"] == 1


async def test_episode_timeout(ray_cluster) -> None:
    spec = FaultSpec(step_latency_s=0.3)
    async with manager(
        groups={"lake": {**LAKE, "num_envs": 1, "faults": spec.model_dump()}}, episode_timeout_s=1.0
    ) as m:
        env = await m.acquire("lake")
        await env.reset(1)
        with pytest.raises(EnvTimeoutError, match="episode timeout"):
            for _ in range(10):
                await env.step("R")
        await env.close()
        assert m.stats["replacements"] == 1


async def _wait_dead(handle, timeout_s: float = 30.0) -> None:
    from ray.exceptions import RayActorError

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            await handle.info.remote()
        except RayActorError:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"killed actor still answers after {timeout_s}s")


async def test_actor_death_fails_its_envs_and_the_run_goes_on(ray_cluster) -> None:
    import ray

    async with manager(groups={"lake": {**LAKE, "num_envs": 4}}, envs_per_actor=2) as m:
        await m.wait_ready("lake", 4)
        assert m.snapshot()["actors_alive"] == 2
        leased = [await m.acquire("lake") for _ in range(2)]
        for e in leased:
            await e.reset(1)
        victim = m.slots[leased[0].env_id].actor
        ray.kill(victim.handle)
        # ray.kill is asynchronous: calls sent right after it can still run. Wait until the
        # actor answers with RayActorError (bounded), then drive the manager's own calls.
        await _wait_dead(victim.handle)
        failed = 0
        for e in leased:
            try:
                await e.step("R")
            except EnvError as exc:
                failed += 1
                assert "died" in str(exc) or "lost" in str(exc)
            await e.close()
        assert failed >= 1 and m.stats["actor_deaths"] == 1
        # every environment of the dead actor was replaced, on live actors
        await m.wait_ready("lake", 4)
        assert all(s.actor.alive for s in m.slots.values())
        e = await m.acquire("lake")
        assert (await e.reset(2))[0]
        await e.close()


async def test_slow_start_does_not_block_other_environments(ray_cluster) -> None:
    groups = {
        "slow": {**LAKE, "num_envs": 2, "faults": {"start_delay_s": 60.0}},  # "container pull"
        "fast": {**LAKE, "num_envs": 2},
    }
    async with manager(groups=groups, envs_per_actor=8) as m:
        assert len(m.actors) == 1  # both groups share one actor
        t0 = time.perf_counter()
        for _ in range(3):
            e = await m.acquire("fast")
            await e.reset(1)
            await e.step("D")
            await e.close()
        assert time.perf_counter() - t0 < 20
        assert m.snapshot()["slots"].get("starting") == 2


async def test_cancelled_call_drains_before_reuse(ray_cluster) -> None:
    spec = FaultSpec(step_latency_s=0.5)
    async with manager(groups={"lake": {**LAKE, "num_envs": 1, "faults": spec.model_dump()}}) as m:
        env = await m.acquire("lake")
        await env.reset(1)
        task = asyncio.ensure_future(env.step("R"))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await env.close()
        assert m.slots[env.env_id].state == "draining"
        again = await m.acquire("lake")  # ready once the cancelled step has returned
        assert again.env_id == env.env_id and m.stats["replacements"] == 0
        await again.close()


async def test_bad_configs_are_clear_errors(ray_cluster) -> None:
    with pytest.raises(ConfigError, match=r"groups\.lake\.options\.size"):
        await manager(groups={"lake": {"impl": "frozenlake", "options": {"size": 1}}}).start()
    with pytest.raises(ConfigError, match="no 'gpu-pool' resource"):
        await manager(pool="gpu-pool").start()
    with pytest.raises(ConfigError, match="unknown env"):
        await manager(groups={"x": {"impl": "no-such-env"}}).start()
    async with manager() as m:
        with pytest.raises(ConfigError, match="unknown env group"):
            await m.acquire("nope")


async def test_group_whose_starts_keep_failing_is_reported(ray_cluster) -> None:
    async with manager(
        groups={"bad": {"impl": "gymnasium", "options": {"env_id": "NoSuchEnv-v0"}, "num_envs": 1}},
        max_start_failures=2,
    ) as m:
        with pytest.raises(EnvError, match=r"cannot start environments.*cannot make"):
            await m.acquire("bad")
        assert m.stats["start_failures"] == 2
