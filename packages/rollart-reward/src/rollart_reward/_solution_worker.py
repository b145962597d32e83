"""The sandbox's worker role (stdlib only; copied next to :mod:`_harness`, which loads it by path and
runs :func:`worker` for ``python _harness.py worker FD SOLUTION``): the one process that runs solution code.
"""

from __future__ import annotations

import json
import os
import sys

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing into the sandbox's processes
if TYPE_CHECKING:
    import types
    from collections.abc import Callable
    from typing import Any

    from rollart_reward._harness_types import Tagged


# The codec the harness loaded (passed to :func:`worker`, so this process runs it once); declared for
# mypy, which cannot see the types of a module loaded by path.
MAX_ITEMS: int
_Unsupported: type[Exception]
encode: Callable[..., Tagged]
decode: Callable[..., Any]


def _names(module: types.ModuleType, wrap: Callable[[object], Tagged]) -> dict[str, Tagged]:
    """The solution's top-level names as the tester binds them: data by value, a standard module by
    name, anything else as a handle."""
    import types

    out: dict[str, Tagged] = {}
    for name, value in list(vars(module).items()):
        if name.startswith("__"):
            continue
        if isinstance(value, types.ModuleType):
            out[name] = ["m", str(value.__name__)]
            continue
        try:
            out[name] = wrap(value)
        except (_Unsupported, RecursionError):
            out[name] = ["h", _handle(value)]
    return out


_HANDLES: list[object] = []  # the solution objects handed out, by handle number


def _handle(obj: object) -> int:
    if len(_HANDLES) >= MAX_ITEMS:
        raise _Unsupported("too many solution objects")
    _HANDLES.append(obj)
    return len(_HANDLES) - 1


def worker(resp_fd: int, solution: str, codec: types.ModuleType) -> None:
    """Serves one solution: ``import``, then ``call`` (by name, values only: the harness compares) or
    ``invoke`` / ``attr`` on handles (a tester's proxies). Never sees an expected value or a nonce.
    ``codec`` is the harness's :mod:`_codec`, already loaded."""
    global MAX_ITEMS, _Unsupported, encode, decode
    MAX_ITEMS, _Unsupported, encode, decode = codec.MAX_ITEMS, codec._Unsupported, codec.encode, codec.decode
    out = os.fdopen(resp_fd, "w", buffering=1)
    stdin = sys.stdin
    sys.stdin = open(os.devnull)
    try:  # the first process the OOM killer takes is the solution's, never the harness
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass

    def reply(**msg: object) -> None:
        for stream in (sys.stdout, sys.stderr):  # the harness stops the worker once it has the reply
            try:
                stream.flush()
            except Exception:
                pass
        out.write(json.dumps(msg) + "\n")
        out.flush()

    def error(exc: BaseException) -> str:
        return f"{type(exc).__name__}: {exc}"[:2000]

    def wrap(value: object) -> Tagged:
        return encode(value, hook=lambda obj: ["h", _handle(obj)])

    def resolve(ref: int) -> Any:  # a solution object: what it can do is up to it (a failure is its error)
        return _HANDLES[ref]

    module: types.ModuleType | None = None
    for line in stdin:
        msg = json.loads(line)
        i, op = msg.get("i"), msg["op"]
        if op == "import":
            import importlib.util

            try:
                spec = importlib.util.spec_from_file_location("solution", solution)
                assert spec is not None and spec.loader is not None  # solution is a .py path
                module = importlib.util.module_from_spec(spec)
                sys.modules["solution"] = module
                spec.loader.exec_module(module)
                names = _names(module, wrap) if msg.get("names") else None
            except BaseException as exc:
                reply(i=i, ok=False, error=error(exc), type=type(exc).__name__)
                return
            reply(i=i, ok=True, names=names)
            continue
        try:
            if op == "call":
                value = getattr(module, msg["call"])(*decode(msg["args"]), **decode(msg["kwargs"]))
            elif op == "invoke":
                fn = resolve(msg["ref"])
                value = fn(*decode(msg["args"], handle=resolve), **decode(msg["kwargs"], handle=resolve))
            else:  # attr
                value = getattr(resolve(msg["ref"]), msg["name"])
        except BaseException as exc:
            reply(i=i, ok=False, error=error(exc), type=type(exc).__name__)
            continue
        try:
            tagged = encode(value) if op == "call" else wrap(value)
        except (_Unsupported, RecursionError) as exc:
            tagged = ["?", str(exc)]
        reply(i=i, ok=True, value=tagged)
