"""Small helpers shared by the text environments: action parsing and seeding."""

from __future__ import annotations

import hashlib
import re

__all__ = ["DIRECTION_WORDS", "parse_direction", "sub_seed"]

DIRECTION_WORDS = {"up": "U", "down": "D", "left": "L", "right": "R"}
_DIRECTION = re.compile(r"[\s`'\"*.<>\[\]()]*([A-Za-z]+)[\s`'\"*.!<>\[\]()]*")


def parse_direction(text: str) -> str | None:
    """``"U"``, ``" d "``, ``"Left"``, ``"**right**"`` → one of ``U D L R``; anything else → None."""
    m = _DIRECTION.fullmatch(text)
    if m is None:
        return None
    word = m.group(1)
    if len(word) == 1 and word.upper() in "UDLR":
        return word.upper()
    return DIRECTION_WORDS.get(word.lower())


def sub_seed(*parts: object) -> int:
    """A stable 63-bit seed from any parts (Python's ``hash`` is salted per process; this is not)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1
