"""Verifiable rewards: answer extraction, exact/number match, math-verify equivalence, format, code
tests in the sandbox; the trajectory wire format; in-process executors and Ray tasks."""

from __future__ import annotations

import asyncio
import time

import pytest

from rollart_core.errors import RewardError
from rollart_core.protocols import RewardExecutor, RewardFunction
from rollart_core.registry import build
from rollart_core.types import Fate, Trajectory, Turn
from rollart_reward.executor import InlineExecutor, PoolExecutor, PoolExecutorConfig
from rollart_reward.extract import extract_answer, parse_number
from rollart_reward.rewards import (
    CodeTestsReward,
    ExactMatchReward,
    FormatConfig,
    FormatReward,
    MathVerifyReward,
    NumberMatchReward,
    SyntheticConfig,
    SyntheticReward,
)
from rollart_reward.wire import idempotency_key, trajectory_from_dict, trajectory_to_dict


def traj(response: str, **info: object) -> Trajectory:
    return Trajectory(
        traj_id="x",
        task="math",
        env_id="e",
        group_id="g",
        seed=0,
        start_version=0,
        turns=[Turn(context_ids=[1, 2], output_ids=[3], action_text=response)],
        info=dict(info),
    )


@pytest.mark.parametrize(
    "text,answer",
    [
        ("so the result is \\boxed{\\frac{1}{2}} indeed", "\\frac{1}{2}"),
        ("x \\boxed{1} then \\boxed{{2}+1}", "{2}+1"),
        ("Reasoning...\nAnswer: 42.", "42"),
        ("The final answer is $7$", "7"),
        ("we get 3 apples and then 1,250 pears", "1,250"),
        ("no digits here", None),
    ],
)
def test_extract_answer(text: str, answer: str | None) -> None:
    assert extract_answer(text) == answer


def test_parse_number() -> None:
    assert parse_number("1,000") == 1000 and parse_number("\\frac{3}{4}") == parse_number("0.75")
    assert parse_number("50%") == parse_number("0.5") and parse_number("abc") is None


async def test_exact_and_number_match() -> None:
    assert (await ExactMatchReward().score(traj("answer: Paris", answer="paris"))).score == 1.0
    assert (await ExactMatchReward().score(traj("answer: Lyon", answer="paris"))).score == 0.0
    assert (await NumberMatchReward().score(traj("so \\boxed{1000.0}", answer="1,000"))).score == 1.0
    assert (await NumberMatchReward().score(traj("it is 999", answer="1000"))).score == 0.0
    with pytest.raises(RewardError, match="no reference answer"):
        await NumberMatchReward().score(traj("42"))


@pytest.mark.parametrize(
    "pred,ref,ok",
    [
        ("1/2", "0.5", True),
        ("\\frac{1}{2}", "0.5", True),
        ("The answer is \\boxed{\\frac{1}{2}}", "1/2", True),
        ("x^2+2x+1", "(x+1)^2", True),
        ("x^2+2x+2", "(x+1)^2", False),
        ("3", "4", False),
    ],
)
async def test_math_verify_equivalences(pred: str, ref: str, ok: bool) -> None:
    r = await MathVerifyReward().score(traj(pred, answer=ref))
    assert r.details["correct"] is ok and r.score == (1.0 if ok else 0.0)


async def test_format_reward() -> None:
    f = FormatReward()
    assert (await f.score(traj("<think>hmm</think> <answer>4</answer>"))).score == 1.0
    assert (await f.score(traj("4"))).score == 0.0
    tags = FormatReward(FormatConfig(pattern=r"(?s).*", required_tags=["answer"]))
    r = await tags.score(traj("<answer>1</answer><answer>2</answer>"))
    assert r.score == 0.0 and r.details["missing_tags"] == ["answer"]
    with pytest.raises(RewardError, match="invalid pattern"):
        FormatReward(FormatConfig(pattern="("))


async def test_code_tests_reward_runs_in_sandbox() -> None:
    tests = "assert add(2, 3) == 5\n"
    good = "Here you go:\n```python\ndef add(a, b):\n    return a + b\n```"
    loop = "```python\ndef add(a, b):\n    while True:\n        pass\n```"
    reward = build(
        "reward", "code_tests", {"timeout_s": 5.0}, where="test"
    )  # a loaded machine: bwrap + 2 interpreters
    r_good, r_bad, r_loop = await asyncio.gather(
        reward.score(traj(good, tests=tests)),
        reward.score(traj("def add(a, b): return a * b", tests=tests)),
        reward.score(traj(loop, tests="add(1, 2)\n")),
    )
    assert r_good.score == 1.0 and r_bad.score == 0.0 and r_loop.score == 0.0
    assert r_loop.details["killed_reason"] in ("timeout", "cpu_time")
    assert isinstance(reward, CodeTestsReward) and isinstance(reward, RewardFunction)


def test_wire_round_trip_and_idempotency_key() -> None:
    t = traj("hello", answer="1", nested={"a": [1, 2]})
    t.fate, t.reward, t.timings = Fate.FINISHED, 0.5, {"env": 1.0}
    back = trajectory_from_dict(trajectory_to_dict(t))
    assert back == t
    assert idempotency_key(t) == idempotency_key(back)  # attempt-independent
    other = traj("hello")
    other.traj_id = "y"
    assert idempotency_key(other) != idempotency_key(t)
    with pytest.raises(RewardError, match="malformed trajectory"):
        trajectory_from_dict({"traj_id": "x", "bogus": 1})


async def test_inline_and_pool_executors_metrics() -> None:
    inline = InlineExecutor(SyntheticReward(), retries=2)
    assert isinstance(inline, RewardExecutor)
    with pytest.raises(RewardError, match="after 3 attempts"):
        await inline.score(traj("", fail=True, work_s=0.0))
    assert inline.stats()["failures"] == 3 and inline.stats()["retries"] == 2
    pool = PoolExecutor(PoolExecutorConfig(workers=2), fn=SyntheticReward())
    await asyncio.gather(*(pool.score(traj("", work_s=0.1)) for _ in range(4)))
    s = pool.stats()
    assert s["calls"] == 4 and s["peak_in_flight"] == 2 and s["queue_delay_s_max"] >= 0.09
    assert 0.5 < s["utilisation"] <= 1.0  # 4 x 0.1 s busy over 2 slots x ~0.2 s


async def test_synthetic_cpu_mode_burns_a_fixed_amount_of_cpu_time() -> None:
    """``cpu`` mode is real computation (CPU time of the calling thread), ``sleep`` mode is none."""
    cpu = SyntheticReward(SyntheticConfig(mode="cpu", work_s=0.1))
    t_cpu, t_wall = time.thread_time(), time.perf_counter()
    assert (await cpu.score(traj(""))).details == {"work_s": 0.1}
    assert time.thread_time() - t_cpu >= 0.1 and time.perf_counter() - t_wall >= 0.1
    t_cpu = time.thread_time()
    await SyntheticReward(SyntheticConfig(mode="sleep", work_s=0.1)).score(traj(""))
    assert time.thread_time() - t_cpu < 0.05
    with pytest.raises(ValueError, match="mode"):
        SyntheticConfig(mode="burn")


@pytest.mark.ray
def test_ray_executor_runs_tasks_and_retries() -> None:
    from rollart_core.config import RayConfig
    from rollart_core.resources import RayCluster
    from rollart_reward.ray_executor import RayExecutor, RayExecutorConfig

    with RayCluster(RayConfig(num_cpus=2)):
        ex = RayExecutor(RayExecutorConfig(function="synthetic", options={"work_s": 0.05}, retries=1))

        async def main() -> None:
            results = await asyncio.gather(*(ex.score(traj("", score=i)) for i in range(4)))
            assert [r.score for r in results] == [0.0, 1.0, 2.0, 3.0]
            with pytest.raises(RewardError, match="synthetic failure"):
                await ex.score(traj("", fail=True))

        asyncio.run(main())
    s = ex.stats()
    assert s["calls"] == 6 and s["failures"] == 2 and s["busy_s"] >= 0.2
