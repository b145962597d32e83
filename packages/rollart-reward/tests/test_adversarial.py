"""Adversarial completions against every built-in reward (entry points ``rollart.reward``; the LLM judge
needs an engine): each returns a score or a clear RewardError within its timeout, never stalls the loop."""

from __future__ import annotations

import asyncio
import time
from importlib.metadata import entry_points

import pytest

from rollart_core.errors import RewardError
from rollart_core.registry import build
from rollart_core.types import RewardResult, Trajectory, Turn
from rollart_reward.executor import InlineExecutor, InlineExecutorConfig
from rollart_reward.extract import extract_answer, normalize_answer, parse_number
from rollart_reward.rewards import NumberMatchReward

REWARDS = sorted(ep.name for ep in entry_points(group="rollart.reward") if ep.name != "llm_judge")
OPTIONS = {
    "math_verify": {"timeout_s": 2, "hard_timeout_s": 10},
    "code_tests": {"timeout_s": 3, "isolation": "best_effort"},
    "format": {"timeout_s": 5},
    "synthetic": {"work_s": 0},
    "bursty": {"inner": {"impl": "exact_match"}, "work_s": 0},
}
CALL_TIMEOUT_S = 20.0
ADVERSARIAL = {
    "huge_exponent": "so the answer is \\boxed{1e999999999}",
    "power_tower": "9**9**9**9",
    "boxed_power_tower": "\\boxed{9^{9^{9^{9}}}}",
    "factorial": "\\boxed{99999999!}",
    "deep_parens": "(" * 100_000 + "1" + ")" * 100_000,
    "deep_braces": "\\boxed{" + "{" * 100_000 + "}" * 100_000 + "}",
    "megabyte": "7" * (1 << 20),
    "megabyte_code": "```python\n" + "x = 1\n" * 200_000 + "```",
    "unicode": "answer: \uff14\uff12\u200f\u202e",
    "nul_bytes": "\\boxed{4\x002}\x00```python\ndef add(a, b):\x00\n    return a + b\n```",
    "regex_backtracking": "<think>" + "</think><answer>" * 60_000,
}


def traj(response: str) -> Trajectory:
    return Trajectory(
        traj_id="adv",
        task="t",
        env_id="e",
        group_id="g",
        seed=0,
        start_version=0,
        terminated=True,
        turns=[Turn(context_ids=[1], output_ids=[2], action_text=response)],
        info={"answer": "42", "tests": "assert add(2, 3) == 5\n", "work_s": 0.0},
    )


def test_every_builtin_reward_is_covered() -> None:
    assert {"exact_match", "number_match", "math_verify", "code_tests", "format"} <= set(REWARDS)


@pytest.mark.parametrize("kind", sorted(ADVERSARIAL))
@pytest.mark.parametrize("name", REWARDS)
async def test_adversarial_completion_is_bounded(name: str, kind: str) -> None:
    ex = InlineExecutor(
        build("reward", name, OPTIONS.get(name, {}), where="test"), retries=0, timeout_s=CALL_TIMEOUT_S
    )
    ticks = 0

    async def heartbeat() -> None:  # the event loop must stay responsive while the reward works
        nonlocal ticks
        while True:
            await asyncio.sleep(0.05)
            ticks += 1

    beat = asyncio.ensure_future(heartbeat())
    t0 = time.perf_counter()
    try:
        result = await ex.score(traj(ADVERSARIAL[kind]))
        assert isinstance(result, RewardResult) and isinstance(result.score, float)
    except RewardError as exc:
        assert "timed out" in str(exc) or name in str(exc) or str(exc), exc
    finally:
        beat.cancel()
    elapsed = time.perf_counter() - t0
    assert elapsed < CALL_TIMEOUT_S + 5, f"{name} on {kind} took {elapsed:.1f} s"
    if elapsed > 1.0:
        assert ticks >= elapsed / 0.05 * 0.3, f"{name} on {kind} blocked the event loop ({ticks} ticks)"


def test_parse_number_refuses_huge_exponents_fast() -> None:
    t0 = time.perf_counter()
    assert parse_number("1e999999999") is None and parse_number("1" * 100_000) is None
    assert extract_answer("x \\boxed{1e999999999}") == "1e999999999"
    assert time.perf_counter() - t0 < 0.5
    assert parse_number("1e400") == 10**400 and parse_number("-2.5e-3") == parse_number("-1/400")
    assert parse_number("\uff14\uff12") == 42 and parse_number("\u200f42") == 42
    assert normalize_answer("\uff30aris\u200b") == "paris"


async def test_number_match_large_answer_does_not_overflow() -> None:
    t = traj("\\boxed{1e400}")
    t.info["answer"] = "1e400"
    assert (await NumberMatchReward().score(t)).score == 1.0
    t.info["answer"] = "2e400"
    assert (await NumberMatchReward().score(t)).score == 0.0


async def test_inline_executor_timeout_names_the_reward_and_the_limit() -> None:
    class Slow:
        stateless = True

        async def score(self, trajectory: Trajectory) -> RewardResult:
            await asyncio.sleep(30)
            return RewardResult(1.0, {})

    ex = InlineExecutor(InlineExecutorConfig(timeout_s=0.2, retries=3), fn=Slow())
    t0 = time.perf_counter()
    with pytest.raises(RewardError, match=r"Slow .* timed out after 0\.2 s"):
        await ex.score(traj(""))
    assert time.perf_counter() - t0 < 2 and ex.stats()["failures"] == 1
    built = build("reward_executor", "inline", {"timeout_s": 0.2}, where="test", fn=Slow())
    assert isinstance(built, InlineExecutor) and built.config.timeout_s == 0.2
