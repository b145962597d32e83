"""Built-in verifiable rewards: answer match, math equivalence, code tests, format, synthetic load.

Every reward reads the model's response and the reference from the trajectory:

- response: ``trajectory.info["response"]`` if set, else the last turn's ``action_text``
  (``response_from="all_turns"`` joins every turn's text);
- reference: ``trajectory.info[<answer_key>]`` (``"answer"`` by default; ``"tests"`` for code).

A missing reference is a :class:`~rollart_core.errors.RewardError` (a broken dataset must not look like
a wrong answer).
"""

from __future__ import annotations

import asyncio
import re
import time
from fractions import Fraction
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rollart_core.errors import RewardError
from rollart_core.types import RewardResult, Trajectory
from rollart_reward import _bounded
from rollart_reward.extract import MAX_ANSWER_CHARS, extract_answer, normalize_answer, parse_number

__all__ = [
    "CodeTestsReward",
    "ExactMatchReward",
    "FormatReward",
    "MathVerifyReward",
    "NumberMatchReward",
    "SyntheticReward",
    "response_text",
]


class _Base(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    answer_key: str = "answer"
    """Key of the reference answer in ``trajectory.info``."""
    response_from: Literal["last_turn", "all_turns"] = "last_turn"
    """Which turns' ``action_text`` make up the response when ``info['response']`` is absent."""
    correct: float = 1.0
    wrong: float = 0.0


def response_text(traj: Trajectory, response_from: str = "last_turn") -> str:
    """The model's response text of a trajectory (see the module docstring)."""
    if isinstance(traj.info.get("response"), str):
        return traj.info["response"]
    if not traj.turns:
        return ""
    if response_from == "all_turns":
        return "\n".join(t.action_text for t in traj.turns)
    return traj.turns[-1].action_text


def _reference(traj: Trajectory, key: str) -> Any:
    if key not in traj.info:
        raise RewardError(f"trajectory {traj.traj_id}: no reference answer at info[{key!r}]")
    return traj.info[key]


class ExactMatchConfig(_Base):
    extract: bool = True
    """Extract the final answer (boxed / 'answer:' / last number) before comparing."""


class ExactMatchReward:
    """``correct`` if the (extracted, normalised) answer equals the reference string."""

    Config = ExactMatchConfig
    stateless = True

    def __init__(self, config: ExactMatchConfig | None = None) -> None:
        self.config = config or ExactMatchConfig()

    async def score(self, trajectory: Trajectory) -> RewardResult:
        c = self.config
        text = response_text(trajectory, c.response_from)
        pred = extract_answer(text) if c.extract else text
        ref = str(_reference(trajectory, c.answer_key))
        ok = pred is not None and normalize_answer(pred) == normalize_answer(ref)
        return RewardResult(c.correct if ok else c.wrong, {"extracted": pred, "correct": ok})


class NumberMatchConfig(_Base):
    rel_tol: float = Field(1e-6, ge=0)
    """Relative tolerance for non-integer answers."""


class NumberMatchReward:
    """``correct`` if the extracted answer is numerically equal to the reference (1,000 = 1000.0 = 1e3)."""

    Config = NumberMatchConfig
    stateless = True

    def __init__(self, config: NumberMatchConfig | None = None) -> None:
        self.config = config or NumberMatchConfig()

    async def score(self, trajectory: Trajectory) -> RewardResult:
        c = self.config
        pred = extract_answer(response_text(trajectory, c.response_from))
        ref = parse_number(str(_reference(trajectory, c.answer_key)))
        if ref is None:
            raise RewardError(
                f"trajectory {trajectory.traj_id}: reference {trajectory.info[c.answer_key]!r} "
                "is not a number"
            )
        got = parse_number(pred) if pred is not None else None
        # exact rational arithmetic: a float() of a large answer (1e400) would overflow
        ok = got is not None and (
            got == ref or abs(got - ref) <= Fraction(c.rel_tol) * max(abs(ref), Fraction(1, 10**12))
        )
        return RewardResult(c.correct if ok else c.wrong, {"extracted": pred, "correct": ok})


class MathVerifyConfig(_Base):
    timeout_s: int = Field(5, ge=1)
    """math-verify's own parsing/verification timeout (SIGALRM, in the worker process's main thread)."""
    hard_timeout_s: float = Field(30.0, gt=0)
    """Wall-clock limit of one check, enforced by killing the worker process (sympy evaluating
    ``9**9**9**9`` never returns to SIGALRM). Includes the worker's first start (importing sympy)."""


def _as_math(text: str) -> str:
    """math-verify finds bare expressions only inside math delimiters: add them when missing."""
    return text if ("$" in text or "\\(" in text or "\\[" in text or "\\boxed" in text) else f"${text}$"


class MathVerifyReward:
    """Mathematical equivalence of the answer and the reference via ``math-verify`` (sympy):
    ``1/2`` = ``0.5`` = ``\\frac{1}{2}``, ``x^2+2x+1`` = ``(x+1)^2``."""

    Config = MathVerifyConfig
    stateless = True

    def __init__(self, config: MathVerifyConfig | None = None) -> None:
        self.config = config or MathVerifyConfig()

    def equivalent(self, pred: str, ref: str) -> bool:
        """In this process (blocking, bounded only by math-verify's SIGALRM on the main thread)."""
        return math_equivalent(pred, ref, self.config.timeout_s)

    async def score(self, trajectory: Trajectory) -> RewardResult:
        c = self.config
        text = response_text(trajectory, c.response_from)
        pred = extract_answer(text, last_number=False) or text[-MAX_ANSWER_CHARS - 1 :].strip()
        ref = str(_reference(trajectory, c.answer_key))
        if len(pred) > MAX_ANSWER_CHARS:
            return RewardResult(c.wrong, {"extracted": None, "correct": False, "error": "answer too long"})
        ok = await _bounded.call(
            "rollart_reward.rewards:math_equivalent",
            pred,
            ref,
            c.timeout_s,
            timeout_s=c.hard_timeout_s,
            what=f"math_verify (hard_timeout_s={c.hard_timeout_s:g})",
        )
        return RewardResult(c.correct if ok else c.wrong, {"extracted": pred, "correct": ok})


def math_equivalent(pred: str, ref: str, timeout_s: int | None) -> bool:
    """math-verify equivalence; ``timeout_s`` (SIGALRM) applies only on the main thread."""
    import threading

    from math_verify import parse, verify

    timeout = timeout_s if threading.current_thread() is threading.main_thread() else None
    gold = parse(_as_math(ref), parsing_timeout=timeout)
    got = parse(_as_math(pred), parsing_timeout=timeout)
    if not gold or not got:
        return normalize_answer(pred) == normalize_answer(ref)
    return bool(verify(gold, got, timeout_seconds=timeout))


class CodeTestsConfig(_Base):
    answer_key: str = "tests"
    """Key of the test cases in ``trajectory.info``: a list of ``{"call", "args", "kwargs", "expected"}`` /
    ``{"stdin", "stdout"}`` dicts, or test code (see :func:`rollart_reward.sandbox.parse_tests`)."""
    timeout_s: float = Field(5.0, gt=0)
    memory_mb: int = Field(512, ge=32)
    max_output_bytes: int = Field(65536, ge=1024)
    isolation: Literal["require", "best_effort"] = "require"
    """``require``: refuse to run (a RewardError naming what is missing) unless bubblewrap namespaces work
    here; ``best_effort``: fall back to rlimits (``details['isolation']`` says which level ran)."""
    partial_credit: bool = False
    """Score ``wrong + (correct - wrong) * tests_passed / tests_total`` instead of all-or-nothing."""


_FENCE = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)
MAX_CODE_CHARS = 1 << 20
"""Longest response the code reward looks for code in (a longer one scores ``wrong``)."""


class CodeTestsReward:
    """Runs the response's code (last fenced block, or the whole text) against the reference test cases
    in the sandbox (:mod:`rollart_reward.sandbox`); a harness process, not the code, judges each case.
    ``correct`` iff every case passed."""

    Config = CodeTestsConfig
    stateless = True

    def __init__(self, config: CodeTestsConfig | None = None) -> None:
        self.config = config or CodeTestsConfig()

    async def score(self, trajectory: Trajectory) -> RewardResult:
        from rollart_reward.sandbox import run_python_async

        c = self.config
        text = response_text(trajectory, c.response_from)
        blocks = _FENCE.findall(text) if len(text) <= MAX_CODE_CHARS else []
        code = blocks[-1] if blocks else text
        if len(code) > MAX_CODE_CHARS:
            return RewardResult(
                c.wrong,
                {
                    "passed": False,
                    "error": f"code longer than {MAX_CODE_CHARS} chars",
                    "tests_passed": 0,
                    "tests_total": 0,
                },
            )
        tests = _reference(trajectory, c.answer_key)
        if not isinstance(tests, str | list):
            tests = str(tests)
        r = await run_python_async(
            code,
            tests,
            timeout_s=c.timeout_s,
            memory_mb=c.memory_mb,
            max_output_bytes=c.max_output_bytes,
            isolation=c.isolation,
        )
        if c.partial_credit and r.tests_total and r.killed_reason is None:
            score = c.wrong + (c.correct - c.wrong) * r.tests_passed / r.tests_total
        else:
            score = c.correct if r.passed else c.wrong
        return RewardResult(
            score,
            {
                "passed": r.passed,
                "returncode": r.returncode,
                "killed_reason": r.killed_reason,
                "tests_passed": r.tests_passed,
                "tests_total": r.tests_total,
                "isolation": r.isolation,
                "stderr_tail": r.stderr[-500:],
                "duration_s": r.duration_s,
            },
        )


class FormatConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    pattern: str = r"(?s)^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$"
    """Regular expression the whole response must match (``re.fullmatch``)."""
    required_tags: list[str] = Field(default_factory=list)
    """Tags that must each appear exactly once as ``<tag>...</tag>`` (checked in addition)."""
    response_from: Literal["last_turn", "all_turns"] = "last_turn"
    correct: float = 1.0
    wrong: float = 0.0
    timeout_s: float = Field(10.0, gt=0)
    """Wall-clock limit of the match (a worker process, killed past it: a backtracking pattern on a long
    response can run for hours holding the GIL)."""


def format_check(pattern: str, tags: list[str], text: str) -> tuple[bool, list[str]]:
    """``(fullmatch?, tags not present exactly once)``."""
    regex_ok = re.fullmatch(pattern, text) is not None
    missing = [
        t for t in tags if len(re.findall(f"<{re.escape(t)}>.*?</{re.escape(t)}>", text, re.DOTALL)) != 1
    ]
    return regex_ok, missing


class FormatReward:
    """``correct`` if the response has the required structure (a regex and/or tags)."""

    Config = FormatConfig
    stateless = True

    def __init__(self, config: FormatConfig | None = None) -> None:
        self.config = config or FormatConfig()
        try:
            self._re = re.compile(self.config.pattern)
        except re.error as exc:
            raise RewardError(f"format reward: invalid pattern {self.config.pattern!r}: {exc}") from None

    async def score(self, trajectory: Trajectory) -> RewardResult:
        c = self.config
        text = response_text(trajectory, c.response_from)
        regex_ok, missing = await _bounded.call(
            "rollart_reward.rewards:format_check",
            c.pattern,
            c.required_tags,
            text,
            timeout_s=c.timeout_s,
            what=f"format (timeout_s={c.timeout_s:g})",
        )
        ok = regex_ok and not missing
        return RewardResult(c.correct if ok else c.wrong, {"regex_ok": regex_ok, "missing_tags": missing})


class SyntheticConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    work_s: float = Field(0.05, ge=0)
    """Default work per call; ``info['work_s']`` overrides it per trajectory."""
    mode: Literal["sleep", "spin", "cpu"] = "sleep"
    """``sleep`` waits (I/O-bound rewards: remote judges, sandboxes); ``spin`` burns CPU for ``work_s`` of
    wall time; ``cpu`` burns ``work_s`` of this thread's CPU time (a fixed amount of computation, so it
    takes longer when the core is shared, like a real compute-bound reward)."""


class SyntheticReward:
    """Load generator for tests and benchmarks: works ``work_s`` then returns ``info['score']``
    (default 1.0); raises if ``info['fail']`` is true."""

    Config = SyntheticConfig
    stateless = True

    def __init__(self, config: SyntheticConfig | None = None) -> None:
        self.config = config or SyntheticConfig()

    async def score(self, trajectory: Trajectory) -> RewardResult:
        work = float(trajectory.info.get("work_s", self.config.work_s))
        if self.config.mode == "sleep":
            await asyncio.sleep(work)
        else:
            clock = time.thread_time if self.config.mode == "cpu" else time.perf_counter
            end = clock() + work
            while clock() < end:
                pass
        if trajectory.info.get("fail"):
            raise RuntimeError(f"synthetic failure for {trajectory.traj_id}")
        return RewardResult(float(trajectory.info.get("score", 1.0)), {"work_s": work})
