"""Tool-use arithmetic: the model computes a multi-operation expression with a calculator tool.

Per seed a fresh problem, e.g. ``(482 * 17) - 3091 + 66 * 12``. The calculator evaluates at most
``max_ops_per_call`` operations per call, so a long expression needs several turns of tool use.
Text tool-call syntax, one call per turn::

    <calc>482 * 17</calc>        → "calc: 482 * 17 = 8194"
    <answer>5895</answer>        → checked against the exact value; ends the episode

Anything else is a format error: an observation saying so and ``format_penalty``, never an
exception. A calculator error (bad expression, too many operations, division by zero, a number or
result beyond ``MAX_MAGNITUDE``: ``1e308 / 0.3`` included) is reported as the tool's output, with
``tool_error_penalty``. The evaluation is total and bounded: every value is an exact fraction whose
numerator and denominator stay within ``MAX_MAGNITUDE``, so no action can make ``step()`` raise or
run long (an action that crashed the environment would be a way out of a bad episode).
"""

from __future__ import annotations

import ast
import operator
import random
import re
from fractions import Fraction
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from rollart_core.types import StepResult

__all__ = [
    "MAX_MAGNITUDE",
    "CalculatorConfig",
    "CalculatorEnv",
    "ToolError",
    "evaluate",
    "format_number",
    "make_problem",
]

MAX_MAGNITUDE = 10**60
"""Bound on the numerator and the denominator of every number and intermediate result: larger ones
are a tool error. Keeps each operation's cost and every result's text small, whatever the action."""

_CALC = re.compile(r"<calc>(.*?)</calc>", re.S)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)
_OPS: dict[type, Any] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}
_SYMBOL = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


class ToolError(ValueError):
    """The calculator rejected an expression (reported to the model, never raised to the runner)."""


class CalculatorConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    num_operands: int = Field(4, ge=2, le=12)
    max_operand: int = Field(999, ge=2, le=10**4)
    """Largest operand of a problem (bounded so that every problem's value stays exact and small)."""
    operators: str = Field("+-*", pattern=r"^[+\-*]+$")
    """Operators the problems use (the calculator itself also divides)."""
    max_ops_per_call: int = Field(1, ge=1)
    """Operations the calculator does per call: small values force several turns of tool use."""
    max_turns: int = Field(12, ge=1)
    format_penalty: float = -0.1
    tool_error_penalty: float = 0.0
    correct_reward: float = 1.0
    wrong_reward: float = 0.0


def _count_ops(node: ast.AST) -> int:
    return sum(isinstance(n, ast.BinOp) for n in ast.walk(node))


def _bounded(x: Fraction) -> Fraction:
    if abs(x.numerator) > MAX_MAGNITUDE or x.denominator > MAX_MAGNITUDE:
        raise ToolError("number out of range (at most 60 digits, and no finer than 1e-60)")
    return x


def _eval(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if (
        isinstance(node, ast.Constant)
        and isinstance(node.value, int | float)
        and not isinstance(node.value, bool)
    ):
        if isinstance(node.value, int) and node.value.bit_length() > 256:
            raise ToolError("number out of range (at most 60 digits, and no finer than 1e-60)")
        try:
            value = Fraction(str(node.value))
        except (ValueError, OverflowError):
            raise ToolError(f"not a finite number: {node.value!r}") from None
        return _bounded(value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        v = _eval(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ToolError("division by zero")
        return _bounded(_OPS[type(node.op)](left, right))
    raise ToolError(f"unsupported syntax {type(node).__name__}; use numbers, + - * / and parentheses")


def evaluate(expression: str, max_ops: int | None = None) -> Fraction:
    """Exact value of an arithmetic expression (numbers, ``+ - * /``, parentheses); ToolError otherwise,
    never another exception (numbers and results beyond :data:`MAX_MAGNITUDE` included)."""
    text = expression.strip()
    if not text or len(text) > 200:
        raise ToolError("expression must be 1..200 characters")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # ValueError: e.g. a NUL byte
        raise ToolError(f"cannot parse {text[:40]!r}") from None
    if max_ops is not None and _count_ops(tree) > max_ops:
        raise ToolError(f"at most {max_ops} operation(s) per call")
    return _eval(tree)


def format_number(x: Fraction) -> str:
    """An integer exactly, else six decimals without trailing zeros (values from :func:`evaluate`
    are within :data:`MAX_MAGNITUDE`, so the float conversion cannot overflow)."""
    if x.denominator == 1:
        return str(x.numerator)
    text = f"{float(x):.6f}".rstrip("0").rstrip(".")
    return "0" if text == "-0" else text


def make_problem(cfg: CalculatorConfig, rng: random.Random) -> tuple[str, Fraction]:
    """A random expression (some products parenthesised) and its exact value."""
    terms = [str(rng.randint(2, cfg.max_operand)) for _ in range(cfg.num_operands)]
    ops = [rng.choice(cfg.operators) for _ in range(cfg.num_operands - 1)]
    parts = [terms[0]]
    for op, t in zip(ops, terms[1:], strict=True):
        parts += [op, t]
    # parenthesise one adjacent pair so the order of tool calls matters
    if len(terms) >= 3:
        i = 2 * rng.randrange(len(terms) - 1)
        parts[i] = "(" + parts[i]
        parts[i + 2] = parts[i + 2] + ")"
    expr = " ".join(parts)
    return expr, evaluate(expr)


class CalculatorEnv:
    """Compute the expression with ``<calc>…</calc>`` tool calls, then ``<answer>…</answer>``."""

    Config = CalculatorConfig
    action_vocabulary = None
    profile = "decode_heavy"
    """Short turns: a few tokens of tool call per turn, short tool outputs."""
    system_prompt = (
        "Compute the value of the expression. You have a calculator: reply <calc>A op B</calc> with one "
        "operation (+, -, *, /) and you get the result. When you know the value, reply <answer>N</answer>."
    )

    def __init__(self, config: CalculatorConfig | None = None) -> None:
        self.config = config or CalculatorConfig()
        self.expression = ""
        self.value = Fraction(0)
        self.turns = 0
        self.tool_calls = 0
        self.done = True

    async def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        self.expression, self.value = make_problem(self.config, random.Random(seed))
        self.turns = 0
        self.tool_calls = 0
        self.done = False
        return f"Expression: {self.expression}", {"expression": self.expression}

    async def step(self, action_text: str) -> StepResult:
        if self.done:
            raise RuntimeError("step() after the episode ended; call reset()")
        cfg = self.config
        self.turns += 1
        truncated = self.turns >= cfg.max_turns
        answer = _ANSWER.search(action_text)
        calc = _CALC.search(action_text)
        # the first tag in the text wins (a model may think out loud before it)
        if answer is not None and (calc is None or answer.start() < calc.start()):
            self.done = True
            try:
                given = evaluate(answer.group(1), max_ops=0)
            except ToolError:
                return StepResult(
                    f"Answer {answer.group(1).strip()[:20]!r} is not a number.",
                    cfg.wrong_reward,
                    True,
                    False,
                    {"success": False, "tool_calls": self.tool_calls, "invalid": True},
                )
            ok = abs(given - self.value) <= Fraction(1, 10**6)
            return StepResult(
                "Correct." if ok else "Wrong.",
                cfg.correct_reward if ok else cfg.wrong_reward,
                True,
                False,
                {"success": ok, "tool_calls": self.tool_calls},
            )
        self.done = truncated
        if calc is not None:
            self.tool_calls += 1
            expr = " ".join(calc.group(1).split())
            try:
                out = f"calc: {expr} = {format_number(evaluate(expr, cfg.max_ops_per_call))}"
                reward = 0.0
            except ToolError as exc:
                out, reward = f"calc error: {exc}", cfg.tool_error_penalty
            return StepResult(out, reward, False, truncated, {"tool_calls": self.tool_calls})
        return StepResult(
            "Format error: reply <calc>A op B</calc> to use the calculator or <answer>N</answer> to answer.",
            cfg.format_penalty,
            False,
            truncated,
            {"invalid": True},
        )

    async def close(self) -> None:
        self.done = True
