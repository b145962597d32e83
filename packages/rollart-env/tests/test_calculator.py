"""Tool-use arithmetic: problems, the calculator tool, multi-turn solving, format errors."""

from __future__ import annotations

import random
import re
from fractions import Fraction

import pytest
from pydantic import ValidationError

from rollart_env.calculator import (
    CalculatorConfig,
    CalculatorEnv,
    ToolError,
    evaluate,
    format_number,
    make_problem,
)


def test_evaluate_exact_and_restricted() -> None:
    assert evaluate("2 + 3 * 4") == 14
    assert evaluate("(2 + 3) * 4") == 20
    assert evaluate("7 / 2") == Fraction(7, 2)
    assert evaluate("-3 - -4") == 1
    for bad in ["__import__('os')", "2 ** 10", "a + 1", "1 +", "", "[1]", "1e999"]:
        with pytest.raises(ToolError):
            evaluate(bad)
    with pytest.raises(ToolError, match="division by zero"):
        evaluate("1 / 0")
    with pytest.raises(ToolError, match="at most 1"):
        evaluate("1 + 2 + 3", max_ops=1)


def test_problems_deterministic_and_varied() -> None:
    cfg = CalculatorConfig()
    assert make_problem(cfg, random.Random(1)) == make_problem(cfg, random.Random(1))
    assert len({make_problem(cfg, random.Random(s))[0] for s in range(30)}) == 30


def _solve_with_tool_calls(expression: str) -> list[str]:
    """A scripted agent: reduce the innermost parentheses, then * before +/-, one op per call."""
    calls = []
    expr = expression
    while True:
        m = re.search(r"\((-?\d+) ([+\-*]) (-?\d+)\)", expr)
        m = m or re.search(r"(-?\d+) (\*) (-?\d+)", expr) or re.search(r"(-?\d+) ([+\-]) (-?\d+)", expr)
        if m is None:
            return [*calls, f"<answer>{expr.strip('()')}</answer>"]
        a, op, b = m.groups()
        value = evaluate(f"{a} {op} {b}")
        calls.append(f"<calc>{a} {op} {b}</calc>")
        expr = expr[: m.start()] + str(value) + expr[m.end() :]


async def test_multi_turn_tool_use_reaches_correct_answer() -> None:
    env = CalculatorEnv(CalculatorConfig(num_operands=5, max_turns=20))
    for seed in range(10):
        obs, info = await env.reset(seed)
        expr = info["expression"]
        assert obs.endswith(expr)
        calls = _solve_with_tool_calls(expr)
        assert len(calls) == 5  # four tool calls, one answer
        for call in calls[:-1]:
            res = await env.step(f"Let me compute. {call}")
            assert res.observation.startswith("calc: ") and not res.terminated
        res = await env.step(calls[-1])
        assert res.terminated and res.reward == 1.0 and res.info["success"] and res.info["tool_calls"] == 4


async def test_wrong_answer_and_non_number() -> None:
    env = CalculatorEnv()
    _, info = await env.reset(2)
    right = evaluate(info["expression"])
    res = await env.step(f"<answer>{right + 1}</answer>")
    assert res.terminated and res.reward == 0.0 and not res.info["success"]
    await env.reset(2)
    res = await env.step("<answer>forty</answer>")
    assert res.terminated and res.reward == 0.0 and "not a number" in res.observation


async def test_format_error_and_tool_error_are_observations() -> None:
    env = CalculatorEnv(CalculatorConfig(format_penalty=-0.5, tool_error_penalty=-0.2))
    await env.reset(0)
    res = await env.step("I think it's about 12")
    assert "Format error" in res.observation and res.reward == -0.5 and not res.terminated
    res = await env.step("<calc>1 / 0</calc>")
    assert res.observation == "calc error: division by zero" and res.reward == -0.2
    res = await env.step("<calc>import os</calc>")
    assert res.observation.startswith("calc error") and not res.terminated


async def test_first_tag_wins_and_truncation() -> None:
    env = CalculatorEnv(CalculatorConfig(max_turns=2))
    await env.reset(0)
    res = await env.step("<calc>2 * 3</calc> then <answer>1</answer>")
    assert res.observation == "calc: 2 * 3 = 6" and not res.truncated
    res = await env.step("<calc>1 + 1</calc>")
    assert res.truncated and not res.terminated


def test_invalid_config_names_the_field() -> None:
    with pytest.raises(ValidationError, match="operators"):
        CalculatorConfig(operators="+^")
    with pytest.raises(ValidationError, match="num_operands"):
        CalculatorConfig(num_operands=1)


@pytest.mark.parametrize(
    "expr",
    ["1e308 / 0.3", "1e308 * 1e308", "9" * 199, "1e-300 / 1e300", "1e59 * 1e59", "1e999", "1 / 0", "\x00"],
)
def test_huge_tiny_and_overflowing_numbers_are_tool_errors(expr: str) -> None:
    with pytest.raises(ToolError):
        evaluate(expr)


async def test_calculator_overflow_is_an_observation_never_an_exception() -> None:
    """The action that used to raise OverflowError (HTTP 500, fate env_failed) is the tool's answer."""
    env = CalculatorEnv(CalculatorConfig(max_ops_per_call=3, tool_error_penalty=-0.2))
    await env.reset(0)
    for action in ["<calc>1e308 / 0.3</calc>", "<calc>1e308 * 1e308 * 10</calc>", "<calc>1e-300 / 3</calc>"]:
        res = await env.step(action)
        assert res.observation.startswith("calc error: ") and res.reward == -0.2 and not res.terminated
    res = await env.step("<answer>1e308</answer>")
    assert res.terminated and res.reward == 0.0 and not res.info["success"]


def test_format_number_small_values() -> None:
    assert format_number(Fraction(1, 3)) == "0.333333"
    assert format_number(Fraction(1, 10**9)) == "0"
    assert format_number(Fraction(-1, 10**9)) == "0"
    assert format_number(Fraction(7, 2)) == "3.5"
