"""A coding task: write a Python function; the answer is checked by running hidden tests.

Per seed: one problem from a small bank of parameterised templates, hidden tests computed by a
reference implementation on seeded random inputs, and a long "repository context" (generated
helper modules the solution may use), which makes this the prefill-heavy task of the workload.
The model answers with a fenced code block; the tests run in rollart-reward's sandbox
(``rollart_reward.sandbox``: a locked-down subprocess with CPU, memory and output limits, no
network). A failing attempt gets the test output back and may try again (``max_attempts``).

A reply without a code block is a format error (observation + ``format_penalty``), never an
exception.
"""

from __future__ import annotations

import asyncio
import inspect
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from rollart_core.extras import require
from rollart_core.types import StepResult

__all__ = ["PROBLEMS", "CodeTaskConfig", "CodeTaskEnv", "Problem", "make_problem"]

_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.S)
_INSTALL = "pip install 'rollart-env[code]'  (installs rollart-reward, whose sandbox runs the tests)"


@dataclass(frozen=True, slots=True)
class Problem:
    name: str
    statement: str
    func: str
    tests: str
    reference: str


def _tests(func: str, ref: Callable[..., Any], inputs: list[tuple[Any, ...]]) -> str:
    lines = [
        f"assert {func}({', '.join(map(repr, args))}) == {ref(*args)!r}, {func + repr(args)!r}"
        for args in inputs
    ]
    return "\n".join(lines)


def _sum_divisible(rng: random.Random) -> Problem:
    k = rng.randint(2, 9)
    inputs = [([rng.randint(-50, 100) for _ in range(rng.randint(0, 12))],) for _ in range(6)]
    ref = f"def sum_div(xs):\n    return sum(x for x in xs if x % {k} == 0)\n"
    return Problem(
        "sum_div",
        f"Write `sum_div(xs)` returning the sum of the integers in list `xs` divisible by {k}.",
        "sum_div",
        _tests("sum_div", lambda xs: sum(x for x in xs if x % k == 0), inputs),
        ref,
    )


def _fizz(rng: random.Random) -> Problem:
    a, b = rng.sample(range(2, 8), 2)
    words = rng.sample(["Fizz", "Buzz", "Bang", "Pop", "Zap"], 2)

    def f(n: int) -> str:
        s = (words[0] if n % a == 0 else "") + (words[1] if n % b == 0 else "")
        return s or str(n)

    inputs = [(n,) for n in rng.sample(range(1, 200), 8)] + [(a * b,)]
    ref = (
        f"def fizz(n):\n    s = ({words[0]!r} if n % {a} == 0 else '') + ({words[1]!r} if n % {b} == 0 else '')\n"
        "    return s or str(n)\n"
    )
    return Problem(
        "fizz",
        f"Write `fizz(n)`: return {words[0]!r} if n is divisible by {a}, {words[1]!r} if by {b}, "
        f"both concatenated in that order if by both, else str(n).",
        "fizz",
        _tests("fizz", f, inputs),
        ref,
    )


def _rotate(rng: random.Random) -> Problem:
    k = rng.randint(1, 5)

    def f(xs: list[int]) -> list[int]:
        return xs[-k % len(xs) :] + xs[: -k % len(xs)] if xs else []

    inputs = [([rng.randint(0, 9) for _ in range(rng.randint(0, 8))],) for _ in range(6)]
    ref = f"def rotate(xs):\n    if not xs:\n        return []\n    s = -{k} % len(xs)\n    return xs[s:] + xs[:s]\n"
    return Problem(
        "rotate",
        f"Write `rotate(xs)` returning a new list: `xs` rotated right by {k} positions "
        "(the last element moves to the front each position); [] stays [].",
        "rotate",
        _tests("rotate", f, inputs),
        ref,
    )


def _count_vowels(rng: random.Random) -> Problem:
    vowels = "".join(sorted(rng.sample("aeiouy", 4)))
    alphabet = "abcdefghijklmnopqrstuvwxyzAEIOU "
    inputs = [("".join(rng.choice(alphabet) for _ in range(rng.randint(0, 20))),) for _ in range(6)]

    def f(s: str) -> int:
        return sum(ch.lower() in vowels for ch in s)

    ref = f"def count_letters(s):\n    return sum(ch.lower() in {vowels!r} for ch in s)\n"
    return Problem(
        "count_letters",
        f"Write `count_letters(s)` returning how many characters of `s` are one of "
        f"{', '.join(vowels)} (case-insensitive).",
        "count_letters",
        _tests("count_letters", f, inputs),
        ref,
    )


def _running_max(rng: random.Random) -> Problem:
    inputs = [([rng.randint(-20, 20) for _ in range(rng.randint(0, 10))],) for _ in range(6)]

    def f(xs: list[int]) -> list[int]:
        out: list[int] = []
        for x in xs:
            out.append(max(out[-1], x) if out else x)
        return out

    ref = (
        "def running_max(xs):\n    out = []\n    for x in xs:\n"
        "        out.append(max(out[-1], x) if out else x)\n    return out\n"
    )
    return Problem(
        "running_max",
        "Write `running_max(xs)` returning the list whose i-th element is max(xs[:i+1]).",
        "running_max",
        _tests("running_max", f, inputs),
        ref,
    )


def _digit_sum(rng: random.Random) -> Problem:
    base = rng.choice([2, 3, 5, 7, 10])
    inputs = [(rng.randint(0, 10**6),) for _ in range(6)] + [(0,)]

    def f(n: int) -> int:
        s = 0
        while n:
            n, d = divmod(n, base)
            s += d
        return s

    ref = f"def digit_sum(n):\n    s = 0\n    while n:\n        n, d = divmod(n, {base})\n        s += d\n    return s\n"
    return Problem(
        "digit_sum",
        f"Write `digit_sum(n)` returning the sum of the digits of the non-negative integer n "
        f"written in base {base}.",
        "digit_sum",
        _tests("digit_sum", f, inputs),
        ref,
    )


PROBLEMS: tuple[Callable[[random.Random], Problem], ...] = (
    _sum_divisible,
    _fizz,
    _rotate,
    _count_vowels,
    _running_max,
    _digit_sum,
)


def make_problem(rng: random.Random) -> Problem:
    return rng.choice(PROBLEMS)(rng)


def repository_context(rng: random.Random, functions: int) -> str:
    """A generated helper module, shown to the model as context (long prompts: prefill-heavy)."""
    ops = [("add", "+"), ("sub", "-"), ("mul", "*")]
    out = ["# utils.py: helpers of the repository (not importable in the sandbox: copy what you use)"]
    for i in range(functions):
        name, sym = rng.choice(ops)
        k = rng.randint(1, 99)
        out.append(f'def {name}_{i}(x):\n    """Return x {sym} {k}."""\n    return x {sym} {k}\n')
    return "\n".join(out)


class CodeTaskConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    max_attempts: int = Field(3, ge=1)
    context_functions: int = Field(40, ge=0, le=2000)
    """Helper functions in the repository context of every prompt (prompt length knob)."""
    timeout_s: float = Field(5.0, gt=0)
    """Sandbox wall-clock limit per attempt."""
    memory_mb: int = Field(512, ge=64)
    max_feedback_chars: int = Field(600, ge=0)
    """How much of the failing test output goes back to the model."""
    format_penalty: float = -0.1
    pass_reward: float = 1.0
    fail_reward: float = 0.0


class CodeTaskEnv:
    """Write the requested function in a fenced ```python block; hidden tests decide."""

    Config = CodeTaskConfig
    action_vocabulary = None
    profile = "prefill_heavy"
    """Long prompts (repository context + test feedback), few turns."""
    system_prompt = (
        "You are a careful Python programmer. Answer with the complete function in one ```python code block."
    )

    def __init__(self, config: CodeTaskConfig | None = None) -> None:
        self.config = config or CodeTaskConfig()
        self.problem: Problem | None = None
        self.attempts = 0
        self.done = True

    async def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        rng = random.Random(seed)
        self.problem = make_problem(rng)
        context = repository_context(rng, self.config.context_functions)
        self.attempts = 0
        self.done = False
        obs = f"{context}\n\nTask: {self.problem.statement}"
        return obs, {"problem": self.problem.name}

    async def _run(self, code: str, tests: str) -> Any:
        sandbox = require("rollart_reward.sandbox", _INSTALL)
        kwargs = {"timeout_s": self.config.timeout_s, "memory_mb": self.config.memory_mb}
        run_async = getattr(sandbox, "run_python_async", None)
        if run_async is not None and inspect.iscoroutinefunction(run_async):
            return await run_async(code, tests, **kwargs)
        return await asyncio.to_thread(sandbox.run_python, code, tests, **kwargs)

    async def step(self, action_text: str) -> StepResult:
        if self.done or self.problem is None:
            raise RuntimeError("step() after the episode ended; call reset()")
        cfg = self.config
        self.attempts += 1
        truncated = self.attempts >= cfg.max_attempts
        m = _FENCE.search(action_text)
        if m is None:
            self.done = truncated
            return StepResult(
                "Format error: put the whole function in one ```python code block.",
                cfg.format_penalty,
                False,
                truncated,
                {"invalid": True},
            )
        result = await self._run(m.group(1), self.problem.tests)
        info = {
            "passed": result.passed,
            "killed_reason": result.killed_reason,
            "attempts": self.attempts,
            "success": result.passed,
            "sandbox_s": result.duration_s,
        }
        if result.passed:
            self.done = True
            return StepResult("All tests passed.", cfg.pass_reward, True, False, info)
        self.done = truncated
        why = f" (killed: {result.killed_reason})" if result.killed_reason else ""
        feedback = (
            (result.stderr or result.stdout)[-cfg.max_feedback_chars :] if cfg.max_feedback_chars else ""
        )
        return StepResult(f"Tests failed{why}.\n{feedback}".rstrip(), cfg.fail_reward, False, truncated, info)

    async def close(self) -> None:
        self.done = True
