"""Code task: hidden tests run in rollart-reward's real sandbox; context length; format errors."""

from __future__ import annotations

import random

import pytest
from pydantic import ValidationError

from rollart_env.code_task import PROBLEMS, CodeTaskConfig, CodeTaskEnv, make_problem


def test_each_reference_solution_passes_its_own_tests_in_process() -> None:
    for make in PROBLEMS:
        for seed in range(5):
            p = make(random.Random(seed))
            scope: dict = {}
            exec(p.reference + "\n" + p.tests, scope)  # our own generated code, not model output


async def test_correct_solution_passes_in_the_sandbox() -> None:
    env = CodeTaskEnv(CodeTaskConfig(context_functions=5))
    obs, info = await env.reset(4)
    problem = make_problem(random.Random(4))
    assert info["problem"] == problem.name and problem.statement in obs
    res = await env.step(f"Here it is:\n```python\n{problem.reference}```\n")
    assert res.terminated and res.reward == 1.0 and res.info["passed"]


async def test_wrong_solution_gets_feedback_and_retries_until_truncated() -> None:
    env = CodeTaskEnv(CodeTaskConfig(context_functions=0, max_attempts=2))
    await env.reset(7)
    name = make_problem(random.Random(7)).func
    res = await env.step(f"```python\ndef {name}(*a):\n    return None\n```")
    assert not res.terminated and not res.truncated and res.reward == 0.0
    assert "Tests failed" in res.observation and "AssertionError" in res.observation
    res = await env.step("```py\nwhile True:\n    pass\n```")
    assert res.truncated and not res.info["passed"] and res.info["killed_reason"] is not None


async def test_missing_code_block_is_a_format_error() -> None:
    env = CodeTaskEnv(CodeTaskConfig(format_penalty=-0.4, context_functions=0))
    await env.reset(1)
    res = await env.step("def f(x): return x")
    assert "Format error" in res.observation and res.reward == -0.4 and not res.terminated


async def test_context_makes_long_prompts_and_is_deterministic() -> None:
    short, long = (
        CodeTaskEnv(CodeTaskConfig(context_functions=0)),
        CodeTaskEnv(CodeTaskConfig(context_functions=200)),
    )
    o_short, _ = await short.reset(3)
    o_long, _ = await long.reset(3)
    assert len(o_long) > 20 * len(o_short)
    assert o_long == (await CodeTaskEnv(CodeTaskConfig(context_functions=200)).reset(3))[0]
    assert CodeTaskEnv.profile == "prefill_heavy"


def test_invalid_config_names_the_field() -> None:
    with pytest.raises(ValidationError, match="max_attempts"):
        CodeTaskConfig(max_attempts=0)
