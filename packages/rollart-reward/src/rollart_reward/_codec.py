"""Values between the sandbox's processes as tagged data (stdlib only; copied into the sandbox next to
the harness). Only exact builtin types are data: an ``int`` subclass or an object with an always-true
``__eq__`` is never compared as a value.

Wire values are tagged lists: ``["n"]`` None, ``["b", bool]``, ``["i", "digits"]``, ``["f", repr]``,
``["s", str]``, ``["y", hex]`` bytes, ``["l"|"t"|"S"|"F", [items]]`` list / tuple / set / frozenset,
``["d", [[k, v], ...]]`` dict, ``["?", type name]`` anything else, or ``["h", n]``: the worker's handle
for a solution object that is not data (a function, a class, an instance), which a tester calls through.
"""

from __future__ import annotations

import json

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing into the sandbox's processes
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    Tagged = list[Any]  # a wire value: its tag, then its payload

MAX_DEPTH = 64
MAX_ITEMS = 100_000
MAX_MESSAGE = 8 << 20


class _Unsupported(Exception):
    pass


def encode(
    x: Any,  # any value, a solution's too: dispatched on its exact type t, which does not narrow x
    depth: int = 0,
    budget: list[int] | None = None,
    hook: Callable[[object], Tagged] | None = None,
) -> Tagged:
    """Tag an exact-builtin value. Anything else becomes ``hook(x)`` when a hook is given (a handle to a
    remote object), else ``["?", type name]``."""
    budget = budget if budget is not None else [MAX_ITEMS]
    budget[0] -= 1
    if depth > MAX_DEPTH or budget[0] < 0:
        raise _Unsupported("value too deep or too large")
    t = type(x)
    if x is None:
        return ["n"]
    if t is bool:
        return ["b", x]
    if t is int:
        return ["i", str(x)]
    if t is float:
        return ["f", "0.0" if x == 0 else repr(x)]
    if t is str:
        return ["s", x]
    if t is bytes:
        return ["y", x.hex()]
    if t in (list, tuple, set, frozenset):
        tags: dict[type, str] = {list: "l", tuple: "t", set: "S", frozenset: "F"}
        tag = tags[t]
        return [tag, [encode(v, depth + 1, budget, hook) for v in x]]
    if t is dict:
        return [
            "d",
            [[encode(k, depth + 1, budget, hook), encode(v, depth + 1, budget, hook)] for k, v in x.items()],
        ]
    if hook is not None:
        return hook(x)
    return ["?", t.__name__ if type(t.__name__) is str else "?"]


def decode(v: Tagged, depth: int = 0, handle: Callable[[int], object] | None = None) -> Any:
    """Tagged value -> Python value; ``["h", n]`` becomes ``handle(n)`` (a remote object) when allowed."""
    if depth > MAX_DEPTH:
        raise ValueError("value too deep")
    tag = v[0]
    if tag == "n":
        return None
    if tag in ("b", "s"):
        return v[1]
    if tag == "i":
        return int(v[1])
    if tag == "f":
        return float(v[1])
    if tag == "y":
        return bytes.fromhex(v[1])
    if tag in ("l", "t", "S", "F"):
        items = [decode(i, depth + 1, handle) for i in v[1]]
        return {"l": list, "t": tuple, "S": set, "F": frozenset}[tag](items)
    if tag == "d":
        return {decode(k, depth + 1, handle): decode(val, depth + 1, handle) for k, val in v[1]}
    if tag == "h" and handle is not None and type(v[1]) is int:
        return handle(v[1])
    raise ValueError(f"unsupported tag {tag!r}")


def canonical(v: object, depth: int = 0) -> str:
    """A comparable form of a tagged value: order-free for dicts and sets. Raises on a malformed tree."""
    if depth > MAX_DEPTH or type(v) is not list or not v or type(v[0]) is not str:
        raise ValueError("malformed value")
    tag = v[0]
    if tag == "n":
        return "n"
    if tag in ("b", "i", "f", "s", "y", "?"):
        if len(v) != 2 or type(v[1]) not in (bool, str):
            raise ValueError("malformed scalar")
        if tag == "?":
            raise ValueError(f"unsupported return type {v[1]!r}")
        return json.dumps([tag, v[1]])
    if tag in ("l", "t", "S", "F"):
        items = [canonical(i, depth + 1) for i in v[1]]
        if tag in ("S", "F"):
            items.sort()
        return json.dumps([tag, items])
    if tag == "d":
        pairs = sorted(json.dumps([canonical(k, depth + 1), canonical(val, depth + 1)]) for k, val in v[1])
        return json.dumps(["d", pairs])
    raise ValueError(f"unknown tag {tag!r}")


def render(v: Tagged, limit: int = 200) -> str:
    """Short human form of a tagged value, for feedback."""
    try:
        text = repr(decode(v))
    except Exception:
        text = "<unrenderable value>"
    return text if len(text) <= limit else text[:limit] + "..."
