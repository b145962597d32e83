"""ReplicatedEnv: every call hedged across replicas of a deterministic env, first answer wins; a
straggling, crashing, hanging or diverging replica is masked. Local envs first, then leased from
the EnvManager on a real Ray cluster (127.0.0.1)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from rollart_core.errors import EnvError
from rollart_env import (
    EnvManager,
    EnvManagerConfig,
    FaultSpec,
    FaultyEnv,
    FrozenLakeConfig,
    FrozenLakeEnv,
    plan_episode,
)
from rollart_env.faults import EpisodePlan
from rollart_env.replicas import ReplicatedEnv

LAKE = FrozenLakeConfig(hole_prob=0.0, max_steps=50)


def lake(**faults: float) -> FaultyEnv:
    return FaultyEnv(inner=FrozenLakeEnv(LAKE), spec=FaultSpec(**faults))


async def until(cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def test_the_fastest_replica_answers_and_results_match_a_single_env() -> None:
    env = ReplicatedEnv([lake(step_latency_s=2.0), lake()])
    single = FrozenLakeEnv(LAKE)
    t0 = time.perf_counter()
    obs, info = await env.reset(5)
    assert obs == (await single.reset(5))[0] and info["replicas"] == 2
    for a in "RRDxD":
        assert await env.step(a) == await single.step(a)
    assert time.perf_counter() - t0 < 1.5  # the slow replica (2 s a call) never held a call
    assert env.stats["hedged_calls"] == 6 and env.stats["hedge_wins"] == 6
    t0 = time.perf_counter()
    await env.close()  # cancels the slow replica's queued calls instead of waiting for them
    assert time.perf_counter() - t0 < 0.5 and env.live == 2
    with pytest.raises(EnvError, match="after close"):
        await env.step("R")


async def test_a_lagging_replica_catches_up_in_order_and_can_win_later() -> None:
    slow_first = lake(step_latency_s=0.3)
    env = ReplicatedEnv([slow_first, lake()])
    await env.reset(1)
    await env.step("R")
    # the slow replica executes its queued calls in order: its env ends up in the same state
    fast = env._replicas[1].env
    assert fast.inner.steps == 1 and slow_first.inner.steps == 0
    await until(lambda: slow_first.inner.steps == 1)
    assert slow_first.inner.pos == fast.inner.pos
    await env.close()


async def test_a_crashing_replica_is_dropped_and_masked_all_crashing_raises() -> None:
    crash = FaultSpec(crash_prob=1.0, fault_within_calls=1)  # crashes in reset
    env = ReplicatedEnv([FaultyEnv(inner=FrozenLakeEnv(LAKE), spec=crash), lake()])
    obs, info = await env.reset(3)
    assert obs and info["replicas"] == 1 and env.stats["replicas_failed"] == 1
    assert (await env.step("D")).observation
    await env.close()

    both = ReplicatedEnv([FaultyEnv(inner=FrozenLakeEnv(LAKE), spec=crash) for _ in range(2)])
    with pytest.raises(EnvError, match="injected crash"):
        await both.reset(3)
    with pytest.raises(EnvError, match="every replica"):
        await both.step("D")
    await both.close()


async def test_a_hanging_replica_is_masked_and_its_call_cancelled_on_close() -> None:
    hang = FaultSpec(hang_prob=1.0, fault_within_calls=2, seed=0)
    at = plan_episode(hang, 4).at_call
    hung = FaultyEnv(inner=FrozenLakeEnv(LAKE), spec=hang)
    env = ReplicatedEnv([hung, lake()])
    t0 = time.perf_counter()
    await env.reset(4)
    await env.step("R")
    await env.step("D")
    assert time.perf_counter() - t0 < 1.0 and hung.stats["hangs"] == 1 and at in (0, 1)
    running = [t for r in env._replicas for t in r.running]
    assert running  # the hung call (and the ones queued behind it) still run
    await env.close()
    assert all(t.done() for t in running)


class DriftingLake(FrozenLakeEnv):
    """Not deterministic given the seed (ignores it): must be detected, not trusted."""

    async def reset(self, seed: int):
        await asyncio.sleep(0.05)  # loses the race, so it is the one checked against the winner
        return await super().reset(seed + 1)


async def test_a_diverging_replica_is_dropped() -> None:
    holes = FrozenLakeConfig(size=6, hole_prob=0.3, max_steps=50)
    env = ReplicatedEnv([FrozenLakeEnv(holes), DriftingLake(holes)])
    single = FrozenLakeEnv(holes)
    assert (await single.reset(3))[0] != (await single.reset(2))[0]  # the drift is visible
    assert (await env.reset(2))[0] == (await single.reset(2))[0]
    assert await env.step("R") == await single.step("R")
    await until(lambda: env.stats["replicas_diverged"] == 1)
    assert env.live == 1 and await env.step("D") == await single.step("D")
    await env.close()


async def test_the_replicated_entry_point_builds_copies_in_process_and_masks_their_crashes() -> None:
    from rollart_core.errors import ConfigError
    from rollart_core.registry import build

    # straggler (the bench's StragglerEnv) numbers its instances: each copy draws its own crash
    inner = {
        "impl": "straggler",
        "options": {
            "env": {"impl": "frozenlake", "options": LAKE.model_dump()},
            "faults": {"crash_prob": 0.5, "fault_within_calls": 1, "seed": 3},
        },
    }
    single = FrozenLakeEnv(LAKE)
    masked = 0
    for seed in range(40):
        env = build("env", "replicated", {"env": inner, "replicas": 4}, "x")
        assert isinstance(env, ReplicatedEnv) and len(env._replicas) == 4
        faulty = [r.env.inner for r in env._replicas]  # StragglerEnv -> FaultyEnv
        assert len({f.instance for f in faulty}) == 4
        crashes = [plan_episode(f.spec, seed, (f.instance, 1)).fault == "crash" for f in faulty]
        try:
            obs, info = await env.reset(seed)
        except EnvError:
            assert all(crashes), "the reset failed although a copy was planned to survive"
        else:
            assert not all(crashes) and 4 - sum(crashes) <= info["replicas"] <= 4
            assert obs == (await single.reset(seed))[0] and await env.step("R") == await single.step("R")
            masked += any(crashes)
        await env.close()
    assert masked >= 10  # 1 - (1/2)^4 - (1/2)^4 of the resets had a crash to mask
    with pytest.raises(ConfigError, match="replicas"):
        build("env", "replicated", {"env": inner, "replicas": 0}, "x")


def test_no_replicas_is_an_error() -> None:
    with pytest.raises(ValueError, match="at least one"):
        ReplicatedEnv([])


# --- leased from the EnvManager (real Ray) --------------------------------------------------------


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    from rollart_core.config import RayConfig
    from rollart_core.resources import RayCluster

    with RayCluster(RayConfig(num_cpus=4, resources={"env": 8})) as c:
        assert c.started, "a Ray cluster was already running; this module needs its own"
        yield


def manager(
    num_envs: int, replicas: int = 2, faults: FaultSpec | None = None, scope: str = "actors", **kw
) -> EnvManager:
    group = {
        "impl": "frozenlake",
        "options": {"hole_prob": 0.0, "max_steps": 50},
        "num_envs": num_envs,
        "replicas": replicas,
        "faults": faults.model_dump() if faults else None,
        "replica_scope": scope,
    }
    base = {"envs_per_actor": 2, "step_timeout_s": 1.0, "reset_timeout_s": 1.0, "start_timeout_s": 60}
    return EnvManager(EnvManagerConfig.model_validate({"groups": {"lake": group}, **base, **kw}))


def hang_spec() -> FaultSpec:
    """A per-instance spec under which instance 0 hangs in its first step and instance 1 does not."""
    for seed in range(1000):
        spec = FaultSpec(seed=seed, hang_prob=0.5, fault_within_calls=2, per_instance=True)
        if (
            plan_episode(spec, 0, (0, 1)) == EpisodePlan("hang", 1)
            and plan_episode(spec, 0, (1, 1)).fault == "none"
        ):
            return spec
    raise AssertionError("no such seed")


@pytest.mark.ray
@pytest.mark.timeout(300)
async def test_manager_leases_replicas_on_different_actors_and_masks_a_hang(ray_cluster) -> None:
    spec = hang_spec()
    async with manager(2, faults=spec, envs_per_actor=1, step_timeout_s=5.0) as m:
        await m.wait_ready("lake", 2)
        env = await m.acquire("lake")
        assert isinstance(env, ReplicatedEnv) and m.stats["replica_leases"] == 1
        leases = [r.env for r in env._replicas]
        assert len({m.slots[e.env_id].actor.name for e in leases}) == 2  # anti-affinity
        single = FrozenLakeEnv(LAKE)
        assert (await env.reset(9))[0] == (await single.reset(9))[0]
        t0 = time.perf_counter()
        for a in "RDDR":  # instance 0 hangs in the first step: instance 1 answers every call
            assert await env.step(a) == await single.step(a)
        assert time.perf_counter() - t0 < 4.0  # below the 5 s step timeout: the hang never held a call
        await until(lambda: env.stats["replicas_failed"] == 1)  # the hung replica timed out meanwhile
        await env.close()
        assert m.stats["timeouts"] == 1 and m.stats["replacements"] == 1
        await m.wait_ready("lake", 2)  # healthy replica back in the pool, the hung one replaced


@pytest.mark.ray
@pytest.mark.timeout(300)
async def test_waiting_trajectories_come_before_extra_replicas(ray_cluster) -> None:
    async with manager(2) as m:
        await m.wait_ready("lake", 2)
        a = await m.acquire("lake")
        assert isinstance(a, ReplicatedEnv)
        b = asyncio.ensure_future(m.acquire("lake"))
        c = asyncio.ensure_future(m.acquire("lake"))
        await until(lambda: m._waiting["lake"] == 2)
        await a.close()
        got = await asyncio.gather(b, c)
        assert not any(isinstance(e, ReplicatedEnv) for e in got)  # one each, no replica for b
        assert m.stats["replica_shortfall"] == 2
        for e in got:
            await e.close()
        # with a single env there is nothing to hedge with: a plain lease
        async with manager(1) as one:
            e = await one.acquire("lake")
            assert not isinstance(e, ReplicatedEnv) and one.stats["replica_shortfall"] == 1
            await e.close()
    # the manager-wide default (env_manager.options.replicas in a run config) applies to every group
    cfg = EnvManagerConfig.model_validate(
        {"groups": {"lake": {"impl": "frozenlake", "num_envs": 2}}, "replicas": 2, "envs_per_actor": 2}
    )
    async with EnvManager(cfg) as d:
        await d.wait_ready("lake", 2)
        e = await d.acquire("lake")
        assert isinstance(e, ReplicatedEnv) and e.live == 2
        await e.close()


async def test_respawn_rebuilds_dropped_and_busy_replicas_at_the_next_reset() -> None:
    crash = FaultSpec(crash_prob=1.0, fault_within_calls=1)  # crashes in its first reset
    built: list[int] = []

    async def respawn(i: int) -> FaultyEnv:
        built.append(i)
        return lake(step_latency_s=0.5) if i == 2 else lake()

    slow = lake(step_latency_s=0.5)
    env = ReplicatedEnv([FaultyEnv(inner=FrozenLakeEnv(LAKE), spec=crash), lake(), slow], respawn=respawn)
    await env.reset(3)
    assert env.live == 2 and await env.step("D")  # replica 0 crashed; the slow one still runs its calls
    assert env._replicas[2].running
    obs, info = await env.reset(5)  # next episode: the crashed and the busy replica are rebuilt
    assert sorted(built) == [0, 2] and env.stats["replicas_respawned"] == 2 and info["replicas"] == 3
    single = FrozenLakeEnv(LAKE)
    assert obs == (await single.reset(5))[0] and await env.step("R") == await single.step("R")
    await env.close()


@pytest.mark.ray
@pytest.mark.timeout(300)
async def test_in_actor_replicas_one_lease_one_call_and_a_hang_masked(ray_cluster) -> None:
    spec = hang_spec()  # per instance: replica 0 of the one environment hangs in its first step
    async with manager(1, faults=spec, envs_per_actor=1, step_timeout_s=5.0, scope="actor") as m:
        await m.wait_ready("lake", 1)
        env = await m.acquire("lake")
        assert not isinstance(env, ReplicatedEnv) and m.stats["replica_leases"] == 0  # hedged in the actor
        single = FrozenLakeEnv(LAKE)
        assert (await env.reset(9))[0] == (await single.reset(9))[0]
        t0 = time.perf_counter()
        for a in "RDDR":
            assert await env.step(a) == await single.step(a)
        assert time.perf_counter() - t0 < 4.0 and m.stats["timeouts"] == 0  # the hang never held a call
        actor = m.slots[env.env_id].actor.handle
        info = await actor.info.remote()
        assert info["calls"] == {"reset": 1, "step": 4}  # one Ray call per env call
        assert info["replicas"]["hedged_calls"] == 5 and info["replicas"]["hedge_wins"] >= 4
        await env.close()
        env = await m.acquire("lake")  # reused: the hung replica is rebuilt at the next reset
        assert (await env.reset(2))[0] == (await single.reset(2))[0]
        assert (await actor.info.remote())["replicas"]["replicas_respawned"] == 1
        await env.close()
        hedge = await m.hedge_stats()  # the manager's view sums its actors' in-actor counters
        assert hedge["hedged_calls"] == 6 and hedge["replicas_respawned"] == 1 and hedge["hedge_wins"] >= 4
