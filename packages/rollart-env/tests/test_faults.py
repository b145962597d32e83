"""Fault injection: seeded plans, start-up delay, log-normal latency, crashes and hangs."""

from __future__ import annotations

import asyncio
import statistics
import time

import pytest
from pydantic import ValidationError

from rollart_core.errors import EnvError
from rollart_env import FaultSpec, FaultyEnv, FrozenLakeConfig, FrozenLakeEnv, InjectedCrash, plan_episode
from rollart_env.faults import _lognormal


def test_plans_are_seeded_and_match_the_probabilities() -> None:
    spec = FaultSpec(seed=3, crash_prob=0.1, hang_prob=0.05, fault_within_calls=3)
    plans = [plan_episode(spec, s) for s in range(4000)]
    assert plans == [plan_episode(spec, s) for s in range(4000)]
    crash = sum(p.fault == "crash" for p in plans) / 4000
    hang = sum(p.fault == "hang" for p in plans) / 4000
    assert 0.08 < crash < 0.12 and 0.035 < hang < 0.065
    assert {p.at_call for p in plans if p.fault != "none"} == {0, 1, 2}
    assert plans != [plan_episode(spec.model_copy(update={"seed": 4}), s) for s in range(4000)]


def test_lognormal_latency_has_the_median_and_a_heavy_tail() -> None:
    import random

    rng = random.Random(0)
    xs = sorted(_lognormal(rng, 0.1, 1.0) for _ in range(20000))
    assert 0.09 < statistics.median(xs) < 0.11
    assert xs[int(0.99 * len(xs))] > 8 * 0.1  # p99 ≈ e^2.33 ≈ 10x the median


async def test_crash_and_hang_happen_exactly_where_planned() -> None:
    spec = FaultSpec(seed=1, crash_prob=0.3, hang_prob=0.3, fault_within_calls=2)
    seen = {"crash": 0, "hang": 0, "none": 0}
    for seed in range(40):
        plan = plan_episode(spec, seed)
        env = FaultyEnv(inner=FrozenLakeEnv(FrozenLakeConfig(hole_prob=0.0, max_steps=20)), spec=spec)
        seen[plan.fault] += 1

        async def episode(env: FaultyEnv = env, seed: int = seed) -> None:
            await env.reset(seed)
            await env.step("R")
            await env.step("D")

        if plan.fault == "crash":
            with pytest.raises(InjectedCrash, match=f"call {plan.at_call}"):
                await episode()
            assert isinstance(InjectedCrash("x"), EnvError)
        elif plan.fault == "hang":
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(episode(), timeout=0.2)
            assert env.calls == plan.at_call + 1
        else:
            await episode()
    assert all(seen.values())


async def test_start_delay_is_paid_once_and_concurrently() -> None:
    spec = FaultSpec(start_delay_s=0.3)
    envs = [FaultyEnv(inner=FrozenLakeEnv(), spec=spec, instance=i) for i in range(10)]
    t0 = time.perf_counter()
    await asyncio.gather(*(e.start() for e in envs))
    elapsed = time.perf_counter() - t0
    assert 0.3 <= elapsed < 1.0  # ten 0.3 s starts overlap
    t0 = time.perf_counter()
    await envs[0].reset(1)  # already started: no second delay
    assert time.perf_counter() - t0 < 0.1


async def test_wrapper_keeps_the_inner_env_semantics() -> None:
    cfg = FrozenLakeConfig(hole_prob=0.0, max_steps=20)
    env = FaultyEnv(inner=FrozenLakeEnv(cfg), spec=FaultSpec(step_latency_s=0.001))
    ref = FrozenLakeEnv(cfg)
    assert env.action_vocabulary == ref.action_vocabulary and env.system_prompt == ref.system_prompt
    assert await env.reset(5) == await ref.reset(5)
    for a in "RDxRD":
        assert await env.step(a) == await ref.step(a)


def test_registry_entry_point_and_config_errors() -> None:
    from rollart_core.errors import ConfigError
    from rollart_core.registry import build

    env = build("env", "faulty", {"env": {"impl": "sokoban"}, "faults": {"crash_prob": 0.5}}, "x")
    assert isinstance(env, FaultyEnv) and env.spec.crash_prob == 0.5
    with pytest.raises(ConfigError, match=r"faults\.crash_prob"):
        build("env", "faulty", {"env": {"impl": "sokoban"}, "faults": {"crash_prob": 2}}, "x")
    with pytest.raises(ValidationError, match="crash_prob \\+ hang_prob"):
        FaultSpec(crash_prob=0.6, hang_prob=0.6)


async def test_per_instance_faults_are_independent_of_the_seed() -> None:
    spec = FaultSpec(seed=2, crash_prob=0.5, fault_within_calls=1, per_instance=True)
    outcomes = []
    for instance in range(12):  # twelve group members on the same task seed
        env = FaultyEnv(inner=FrozenLakeEnv(), spec=spec, instance=instance)
        try:
            await env.reset(99)
            outcomes.append("ok")
        except InjectedCrash:
            outcomes.append("crash")
    assert set(outcomes) == {"ok", "crash"}
    again = FaultyEnv(inner=FrozenLakeEnv(), spec=spec, instance=0)  # deterministic per instance
    first = "ok"
    try:
        await again.reset(99)
    except InjectedCrash:
        first = "crash"
    assert first == outcomes[0]


async def test_a_rebuilt_instance_draws_fresh_faults_not_a_replay() -> None:
    spec = FaultSpec(seed=4, crash_prob=0.5, fault_within_calls=1, per_instance=True)

    async def crashes(incarnation: int) -> list[bool]:
        """Which of 12 consecutive episodes crash at reset, as the env really runs them."""
        env = FaultyEnv(inner=FrozenLakeEnv(), spec=spec, instance=7, incarnation=incarnation)
        out = []
        for ep in range(12):
            try:
                await env.reset(ep)
                out.append(False)
            except InjectedCrash:
                out.append(True)
        return out

    first = await crashes(0)
    assert first == await crashes(0)  # deterministic per (instance, incarnation)
    # the first life keeps the old keys, so plan_episode still predicts it
    assert first == [plan_episode(spec, ep, (7, ep + 1)).fault == "crash" for ep in range(12)]
    rebuilt = [await crashes(n) for n in (1, 2)]
    assert all(r != first for r in rebuilt) and rebuilt[0] != rebuilt[1]  # not a replay of the first life


async def test_straggler_numbers_its_objects_and_wraps_faulty() -> None:
    from rollart_core.errors import ConfigError
    from rollart_core.registry import build
    from rollart_env import StragglerEnv

    options = {"env": {"impl": "frozenlake"}, "faults": {"seed": 1, "step_latency_s": 0.0}}
    first, second = (build("env", "straggler", options, "x") for _ in range(2))
    assert isinstance(first, StragglerEnv) and isinstance(first.inner, FaultyEnv)
    assert second.inner.instance == first.inner.instance + 1
    assert first.inner.spec.per_instance and not FaultSpec().per_instance  # forced on
    ref = FrozenLakeEnv()
    assert first.action_vocabulary == ref.action_vocabulary and first.system_prompt == ref.system_prompt
    assert await first.reset(3) == await ref.reset(3) and await first.step("R") == await ref.step("R")
    await first.close()
    with pytest.raises(ConfigError, match=r"straggler\.options\.faults\.crash_prob"):
        build("env", "straggler", {"env": {"impl": "frozenlake"}, "faults": {"crash_prob": 2}}, "x")


async def test_straggler_paired_scope_draws_by_seed_and_rank_not_by_instance() -> None:
    from rollart_core.registry import build

    def options(scope: str | None) -> dict:
        faults = {"seed": 3, "crash_prob": 0.5, "fault_within_calls": 1}  # a crash, if any, at reset
        return {"env": {"impl": "frozenlake"}, "faults": faults, "paired_scope": scope}

    async def crashes(scope: str | None) -> list[bool]:
        out = []
        for seed in range(12):
            for _member in range(3):  # a group: three environments reset on one seed
                env = build("env", "straggler", options(scope), "x")
                try:
                    await env.reset(seed)
                    out.append(False)
                except InjectedCrash:
                    out.append(True)
        return out

    a, b = await crashes("round0/a"), await crashes("round0/b")
    assert a == b and any(a) and not all(a)  # two scopes, the same draws in the same order
    assert any(len(set(a[3 * i : 3 * i + 3])) > 1 for i in range(12))  # members of a group draw apart
    assert await crashes("round0/a") != a  # the scope's ranks go on: a second pass draws afresh
    assert await crashes(None) != await crashes(None)  # unpaired: by instance number, never repeats
