"""Answer extraction from free-form model output: ``\\boxed{}``, ``answer:`` lines, the last number.

Pure functions, no dependencies; used by the match rewards and usable on their own. Model output is
untrusted, so every function is bounded: extraction looks at the last :data:`MAX_TEXT_CHARS` characters,
an answer longer than :data:`MAX_ANSWER_CHARS` is not an answer, and :func:`parse_number` parses digits
and exponents itself, refusing more than :data:`MAX_DIGITS` digits or an exponent beyond
:data:`MAX_EXPONENT` (``Fraction("1e999999999")`` would compute 10**999999999).
"""

from __future__ import annotations

import re
import unicodedata
from fractions import Fraction

__all__ = [
    "MAX_ANSWER_CHARS",
    "MAX_DIGITS",
    "MAX_EXPONENT",
    "MAX_TEXT_CHARS",
    "extract_answer",
    "last_boxed",
    "normalize_answer",
    "parse_number",
]

MAX_TEXT_CHARS = 100_000
"""Extraction reads only this many characters from the end of a response (the answer comes last)."""
MAX_ANSWER_CHARS = 10_000
MAX_DIGITS = 1000
MAX_EXPONENT = 1000
_DECIMAL_RE = re.compile(r"([-+]?)(\d*)(?:\.(\d*))?(?:e([-+]?\d+))?", re.ASCII | re.IGNORECASE)

_ANSWER_RE = re.compile(r"(?:final\s+answer|answer)\s*(?:is)?\s*[:=]?\s*(.+)", re.IGNORECASE)
_NUMBER_RE = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|[-+]?\.\d+")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced; None if absent."""
    text = text[-MAX_TEXT_CHARS:]
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
                found = text[i + 1 : j].strip()
                return found if len(found) <= MAX_ANSWER_CHARS else None
    return None


def extract_answer(text: str, *, last_number: bool = True) -> str | None:
    """The model's final answer: last ``\\boxed{}``, else the last ``answer: ...`` line, else (if
    ``last_number``) the last number in the text, else None."""
    text = text[-MAX_TEXT_CHARS:]
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    matches = [m.group(1) for line in text.splitlines() if (m := _ANSWER_RE.search(line))]
    if matches:
        ans = matches[-1].strip().rstrip(".").strip()
        ans = ans.strip("$").strip()
        if ans and len(ans) <= MAX_ANSWER_CHARS:
            return ans
    nums = _NUMBER_RE.findall(text) if last_number else []
    return nums[-1] if nums else None


def normalize_answer(text: str) -> str:
    """NFKC-normalised (fullwidth digits become ASCII), invisible format characters (RTL marks,
    zero-width spaces) and NULs dropped, case-folded, whitespace-collapsed, surrounding
    ``$``/punctuation/``\\text{}`` removed."""
    t = unicodedata.normalize("NFKC", text[: MAX_ANSWER_CHARS * 2])
    t = "".join(ch for ch in t if ch != "\0" and unicodedata.category(ch) != "Cf")
    t = t.strip().strip("$").strip()
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
    if len(t) > MAX_DIGITS + 10:
        return None
    num, slash, den = t.partition("/")
    value = _decimal(num)
    if slash:
        d = _decimal(den)
        if value is None or d is None or d == 0:
            return None
        value = value / d
    if value is None:
        return None
    return value / 100 if pct else value


def _decimal(t: str) -> Fraction | None:
    """``[-+]digits[.digits][e[-+]digits]`` as a Fraction, without materialising huge powers of ten."""
    m = _DECIMAL_RE.fullmatch(t)
    if m is None:
        return None
    sign, whole, frac, exp = m.groups()
    frac = frac or ""
    if not whole and not frac:
        return None
    if len(whole) + len(frac) > MAX_DIGITS or (exp is not None and len(exp.lstrip("+-")) > 6):
        return None
    e = int(exp) if exp is not None else 0
    if abs(e) > MAX_EXPONENT:
        return None
    value = Fraction(int(whole + frac or "0")) * Fraction(10) ** (e - len(frac))
    return -value if sign == "-" else value
