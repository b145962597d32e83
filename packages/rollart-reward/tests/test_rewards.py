"""Tests for the built-in reward functions and the inline reward executor."""

from __future__ import annotations

import asyncio
import math
import time

import pytest
from pydantic import ValidationError

from rollart_core.errors import RewardError
from rollart_core.types import RewardResult, Trajectory
from rollart_reward import EnvReturnReward, InlineExecutor, SuccessReward
from rollart_reward.builtin import SuccessConfig


def make_traj(
    *,
    terminated: bool = False,
    truncated: bool = False,
    info: dict | None = None,
    env_return: float = 0.0,
    traj_id: str = "t0",
) -> Trajectory:
    return Trajectory(
        traj_id=traj_id,
        task="frozenlake",
        env_id="e0",
        group_id="g0",
        seed=0,
        start_version=0,
        terminated=terminated,
        truncated=truncated,
        info=dict(info or {}),
        env_return=env_return,
    )


# SuccessReward ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "terminated,truncated,info,expected_ok",
    [
        (True, False, {"success": True}, True),
        (True, False, {"success": 1}, True),
        (True, False, {"success": False}, False),
        (True, False, {}, False),
        (False, True, {"success": True}, False),  # success flag but not terminated
        (False, False, {"success": True}, False),
        (False, True, {}, False),
    ],
)
async def test_success_reward_default_config(terminated, truncated, info, expected_ok) -> None:
    res = await SuccessReward().score(make_traj(terminated=terminated, truncated=truncated, info=info))
    assert isinstance(res, RewardResult)
    assert res.score == (1.0 if expected_ok else 0.0)
    assert res.details["success"] is expected_ok


async def test_success_reward_respects_config_values() -> None:
    fn = SuccessReward(SuccessConfig(success=2.5, failure=-0.75))
    ok = await fn.score(make_traj(terminated=True, info={"success": True}))
    bad = await fn.score(make_traj(terminated=True, info={"success": False}))
    trunc = await fn.score(make_traj(truncated=True, info={"success": True}))
    assert ok.score == 2.5
    assert bad.score == -0.75
    assert trunc.score == -0.75


def test_success_config_rejects_unknown_field() -> None:
    with pytest.raises(ValidationError) as ei:
        SuccessConfig(succes=1.0)
    assert "succes" in str(ei.value)


async def test_success_reward_does_not_mutate_trajectory() -> None:
    t = make_traj(terminated=True, info={"success": True}, env_return=0.3)
    await SuccessReward().score(t)
    assert t.info == {"success": True} and t.reward == 0.0 and t.env_return == 0.3


# EnvReturnReward --------------------------------------------------------------------------------


@pytest.mark.parametrize("ret", [0.0, 1.0, -2.5, 0.125, 17.0])
async def test_env_return_reward(ret: float) -> None:
    res = await EnvReturnReward().score(make_traj(env_return=ret, terminated=True))
    assert res.score == ret
    assert res.details["env_return"] == ret


async def test_env_return_reward_ignores_success_flag() -> None:
    res = await EnvReturnReward().score(make_traj(env_return=0.0, terminated=True, info={"success": True}))
    assert res.score == 0.0


# InlineExecutor ---------------------------------------------------------------------------------


class Flaky:
    """Raises ``fail_times`` times, then returns ``score``; counts every call and the work done."""

    def __init__(self, fail_times: int, score: float = 0.5, work_s: float = 0.0) -> None:
        self.fail_times = fail_times
        self.score_value = score
        self.work_s = work_s
        self.calls = 0

    async def score(self, trajectory: Trajectory) -> RewardResult:
        self.calls += 1
        if self.work_s:
            await asyncio.sleep(self.work_s)  # simulated work inside the reward, not a wait
        if self.calls <= self.fail_times:
            raise ValueError(f"boom {self.calls}")
        return RewardResult(self.score_value, {"calls": self.calls})


async def test_executor_passes_through_success() -> None:
    fn = Flaky(0, score=0.75)
    ex = InlineExecutor(fn, retries=3)
    res = await ex.score(make_traj())
    assert res.score == 0.75
    assert fn.calls == 1
    assert ex.calls == 1
    assert ex.failures == 0


@pytest.mark.parametrize("fail_times,retries", [(1, 1), (2, 2), (2, 5), (4, 4)])
async def test_executor_retries_until_success(fail_times: int, retries: int) -> None:
    fn = Flaky(fail_times, score=0.25)
    ex = InlineExecutor(fn, retries=retries)
    res = await ex.score(make_traj())
    assert res.score == 0.25
    assert res.details["calls"] == fail_times + 1
    assert fn.calls == fail_times + 1
    assert ex.calls == fail_times + 1
    assert ex.failures == fail_times


@pytest.mark.parametrize("retries", [0, 1, 3])
async def test_executor_always_failing_raises_reward_error(retries: int) -> None:
    fn = Flaky(10**9)
    ex = InlineExecutor(fn, retries=retries)
    with pytest.raises(RewardError) as ei:
        await ex.score(make_traj(traj_id="traj-xyz"))
    assert fn.calls == retries + 1
    assert ex.calls == retries + 1
    assert ex.failures == retries + 1
    assert "traj-xyz" in str(ei.value)
    assert f"boom {retries + 1}" in str(ei.value)  # the last error is reported


async def test_executor_too_few_retries_fails() -> None:
    fn = Flaky(3)
    ex = InlineExecutor(fn, retries=2)
    with pytest.raises(RewardError):
        await ex.score(make_traj())
    assert fn.calls == 3
    # a second trajectory: the function now succeeds on its first call; counters accumulate
    res = await ex.score(make_traj())
    assert res.score == 0.5
    assert fn.calls == 4
    assert ex.calls == 4
    assert ex.failures == 3


async def test_executor_failures_accumulate_across_trajectories() -> None:
    ex = InlineExecutor(Flaky(10**9), retries=1)
    for i in range(3):
        with pytest.raises(RewardError):
            await ex.score(make_traj(traj_id=f"t{i}"))
    assert ex.failures == 6
    assert ex.calls == 6


async def test_executor_busy_time_grows() -> None:
    work = 0.01
    fn = Flaky(1, work_s=work)
    ex = InlineExecutor(fn, retries=1)
    assert ex.busy_s == 0.0
    t0 = time.perf_counter()
    await ex.score(make_traj())
    wall = time.perf_counter() - t0
    first = ex.busy_s
    # two attempts (one failing), each doing `work` seconds of work; never more than the wall time
    assert 2 * work * 0.9 <= first <= wall + 1e-6
    await ex.score(make_traj())
    assert ex.busy_s >= first + work * 0.9


async def test_executor_works_with_builtin_reward() -> None:
    ex = InlineExecutor(SuccessReward(), retries=0)
    res = await ex.score(make_traj(terminated=True, info={"success": True}))
    assert res.score == 1.0
    assert ex.calls == 1 and ex.failures == 0


@pytest.mark.parametrize(
    "gaps,cold,ceiling,expected",
    [
        ([math.inf] * 20, 0.05, 0.2, 0.0),  # no idle worker ever got a call: keep none
        ([0.03] * 20, 0.05, 0.2, 0.03),  # every idle worker is called again after 30 ms: keep 30 ms
        ([0.03] * 15 + [math.inf] * 5, 0.05, 0.2, 0.03),  # mostly reused: 15 x 0.02 saved > 5 x 0.03 spent
        ([0.03] * 10 + [math.inf] * 10, 0.05, 0.2, 0.0),  # half reused: 10 x 0.02 saved < 10 x 0.03 spent
        ([0.03] * 5 + [math.inf] * 15, 0.02, 0.2, 0.0),  # cheap cold starts, rare reuse: keep none
        ([0.5] * 20, 1.0, 0.2, 0.0),  # gaps beyond the ceiling (ski rental) cannot be caught: keep none
    ],
)
def test_learned_keep_alive_minimises_provisioned_time(
    gaps: list[float], cold: float, ceiling: float, expected: float
) -> None:
    from rollart_reward.pool import learned_keep_alive

    assert learned_keep_alive(gaps, cold, ceiling) == pytest.approx(expected)


async def test_a_cancelled_caller_is_not_kept_running_by_the_timeout() -> None:
    """The executor's per-call timeout must let a cancellation through even when it arrives as the
    call completes (asyncio.wait_for on 3.11 can swallow it: a bench worker looping on score() was
    cancelled and ran on forever)."""
    import asyncio

    from rollart_core.types import RewardResult, Trajectory
    from rollart_reward.executor import InlineExecutor

    class Instant:  # a reward that completes on its first resume
        stateless = True

        async def score(self, trajectory: Trajectory) -> RewardResult:
            await asyncio.sleep(0)
            return RewardResult(1.0)

    ex = InlineExecutor(Instant())
    t = Trajectory("c", "t", "e", "g", 0, 0)

    async def loop_forever() -> None:
        while True:
            await ex.score(t)

    for k in range(40):
        task = asyncio.create_task(loop_forever())
        for _ in range(k % 7 + 1):
            await asyncio.sleep(0)
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=5)
        assert done and task.cancelled(), f"round {k}: the cancelled loop kept running"
