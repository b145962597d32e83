"""Answer extraction from free-form model output: ``\\boxed{}``, ``answer:`` lines, the last number.

Pure functions, no dependencies; used by the match rewards and usable on their own.
"""

from __future__ import annotations

import re
from fractions import Fraction

__all__ = ["extract_answer", "last_boxed", "normalize_answer", "parse_number"]

_ANSWER_RE = re.compile(r"(?:final\s+answer|answer)\s*(?:is)?\s*[:=]?\s*(.+)", re.IGNORECASE)
_NUMBER_RE = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|[-+]?\.\d+")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced; None if absent."""
    idx = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if idx < 0:
        return None
    i = text.find("{", idx)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j].strip()
    return None


def extract_answer(text: str, *, last_number: bool = True) -> str | None:
    """The model's final answer: last ``\\boxed{}``, else the last ``answer: ...`` line, else (if
    ``last_number``) the last number in the text, else None."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    matches = [m.group(1) for line in text.splitlines() if (m := _ANSWER_RE.search(line))]
    if matches:
        ans = matches[-1].strip().rstrip(".").strip()
        ans = ans.strip("$").strip()
        if ans:
            return ans
    nums = _NUMBER_RE.findall(text) if last_number else []
    return nums[-1] if nums else None


def normalize_answer(text: str) -> str:
    """Case-folded, whitespace-collapsed, surrounding ``$``/punctuation/``\\text{}`` removed."""
    t = text.strip().strip("$").strip()
    t = re.sub(r"\\text\{([^}]*)\}", r"\1", t)
    t = re.sub(r"\s+", " ", t).strip().rstrip(".").strip()
    return t.casefold()


def parse_number(text: str) -> Fraction | None:
    """Parse ``1,234``, ``-0.5``, ``3/4``, ``50%``, ``\\frac{3}{4}``, ``$12``; None if not a number."""
    t = normalize_answer(text).replace("\\$", "").replace("$", "").replace(",", "").replace(" ", "")
    m = re.fullmatch(r"\\d?frac\{([-+]?\d+)\}\{([-+]?\d+)\}", t)
    if m:
        t = f"{m.group(1)}/{m.group(2)}"
    pct = t.endswith("%") or t.endswith("\\%")
    t = t.rstrip("%").rstrip("\\")
    try:
        value = Fraction(t)
    except (ValueError, ZeroDivisionError):
        return None
    return value / 100 if pct else value
