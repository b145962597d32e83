"""Runs a script-form test case (``check(candidate)``, ``math.isclose``, helpers) inside the sandbox,
in a process that never runs solution code (stdlib only; started by the harness as
``python _tester.py REQ_FD RESP_FD VERDICT_FD``, its nonce, test code and deadline on stdin).

The test code runs here, with every top-level name of the solution bound to a proxy: calling one sends
the call to the solution's worker process (arguments as tagged data, :func:`_harness.encode`) and
returns its result decoded into exact builtin values, or a proxy for anything that is not data (a
class, an instance, a function). The test's own comparisons thus run on plain values in a process the
solution cannot reach: this process is non-dumpable before the worker exists (no ptrace, no
``/proc/<pid>/mem`` or ``/proc/<pid>/fd``), and its verdict goes, with the nonce, to a pipe only it and
the harness hold. A worker that dies, stalls, or answers out of turn fails the case, whatever the test
code catches.
"""

from __future__ import annotations

import builtins
import importlib
import importlib.util
import json
import os
import select
import sys
import time
import traceback
import types

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing into the sandbox's processes
if TYPE_CHECKING:
    from typing import Any, NoReturn


def _load_harness() -> types.ModuleType:
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_harness.py")
    spec = importlib.util.spec_from_file_location("_rollart_harness", path)
    assert spec is not None and spec.loader is not None  # a .py path always gets a spec with a loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Broken(BaseException):
    """The solution's worker failed the protocol: not an ``Exception``, so test code cannot catch it
    with ``except Exception`` (and a bare ``except`` does not save the case either)."""


class SolutionError(Exception):
    """The solution raised an exception that is not a builtin one."""


class Remote:
    """A solution object that is not data (function, class, instance): call it, read its attributes.
    Compares by identity; never runs solution code in this process."""

    __slots__ = ("_label", "_ref")

    def __init__(self, ref: int, label: str) -> None:
        object.__setattr__(self, "_ref", ref)
        object.__setattr__(self, "_label", label)

    def __call__(self, *args: object, **kwargs: object) -> Any:
        return _CHANNEL.ask(
            {"op": "invoke", "ref": self._ref, "args": _to_wire(args), "kwargs": _to_wire(kwargs)}
        )

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name not in ("__name__", "__qualname__", "__doc__"):
            raise AttributeError(name)
        return _CHANNEL.ask({"op": "attr", "ref": self._ref, "name": name})

    def __setattr__(self, name: str, value: object) -> None:
        raise TypeError("solution objects are read-only in the tests")

    def __repr__(self) -> str:
        return f"<solution object {self._label}>"


def _to_wire(value: object) -> list[Any]:
    def hook(obj: object) -> list[object]:
        if type(obj) is Remote:
            return ["h", obj._ref]
        raise TypeError(
            f"a {type(obj).__name__} cannot be passed to the solution (only data and solution objects)"
        )

    try:
        return H.encode(value, hook=hook)
    except H._Unsupported as exc:
        raise TypeError(f"argument not passable to the solution: {exc}") from None


def _from_wire(value: object, label: str) -> Any:
    return H.decode(value, handle=lambda ref: Remote(ref, label))


class Channel:
    broken: str | None  # why the solution's worker failed the protocol, once it has

    def __init__(self, req_fd: int, resp_fd: int, deadline: float) -> None:
        self.req_fd, self.resp_fd, self.deadline = req_fd, resp_fd, deadline
        self.n, self.buf, self.broken = 0, b"", None

    def _break(self, why: str) -> NoReturn:
        self.broken = self.broken or why
        raise Broken(self.broken)

    def ask(self, msg: dict[str, Any]) -> Any:
        if self.broken:
            raise Broken(self.broken)
        self.n += 1
        msg["i"] = self.n
        data = (json.dumps(msg) + "\n").encode()
        try:
            while data:
                data = data[os.write(self.req_fd, data) :]
        except OSError:
            self._break("the solution's process stopped answering")
        reply = self._recv()
        if not isinstance(reply, dict) or reply.get("i") != self.n or type(reply.get("ok")) is not bool:
            self._break("the solution's process answered out of turn")
        if not reply["ok"]:
            raise _exception(str(reply.get("type")), str(reply.get("error"))[:2000])
        if msg["op"] == "import":
            return reply.get("names")
        label = msg.get("name") or f"#{msg.get('ref')}"
        try:
            return _from_wire(reply.get("value"), label)
        except (ValueError, TypeError, KeyError, IndexError, RecursionError) as exc:
            raise TypeError(f"the solution returned an unsupported value ({exc})") from None

    def _recv(self) -> Any:
        while b"\n" not in self.buf:
            left = self.deadline - time.monotonic()
            if left <= 0:
                self._break("timeout")
            ready, _, _ = select.select([self.resp_fd], [], [], min(left, 0.5))
            if ready:
                chunk = os.read(self.resp_fd, 1 << 16)
                if not chunk:
                    self._break("the solution's process ended")
                self.buf += chunk
                if len(self.buf) > H.MAX_MESSAGE:
                    self._break("the solution's reply is too large")
        line, _, self.buf = self.buf.partition(b"\n")
        try:
            return json.loads(line)
        except ValueError:
            self._break("malformed reply from the solution's process")


def _exception(type_name: str, message: str) -> Exception:
    if message.startswith(type_name + ": "):
        message = message[len(type_name) + 2 :]
    cls = getattr(builtins, type_name, None)
    if isinstance(cls, type) and issubclass(cls, Exception) and cls is not Broken:
        try:
            return cls(message)
        except Exception:
            pass
    return SolutionError(message)


def _bind(names: dict[str, Any] | None) -> dict[str, Any]:
    """The test code's globals: the solution's names (data, standard modules, proxies) and a
    ``solution`` module holding them, for ``from solution import f``."""
    main = types.ModuleType("__main__")  # the test code's module: unittest.main() finds its tests here
    main.__dict__["__builtins__"] = builtins  # main.__builtins__, an attribute ModuleType does not declare
    sys.modules["__main__"] = main
    scope = main.__dict__
    module = types.ModuleType("solution")
    for name, tagged in (names or {}).items():
        if type(tagged) is list and tagged and tagged[0] == "m":
            mod = str(tagged[1])
            # Only a standard module under its own name (``import math``): the solution cannot
            # substitute another module for one the test code uses.
            if mod != name or mod.split(".")[0] not in sys.stdlib_module_names:
                continue
            value = importlib.import_module(mod)
        else:
            try:
                value = _from_wire(tagged, name)
            except (ValueError, TypeError, KeyError, IndexError, RecursionError):
                continue
        scope[name] = value
        setattr(module, name, value)
    sys.modules["solution"] = module
    return scope


def _run(cfg: dict[str, Any]) -> tuple[bool, str | None]:
    """(passed, why) of the test code against the solution."""
    why: str | None
    try:
        names = _CHANNEL.ask({"op": "import", "names": True})
    except Broken as exc:
        return False, str(exc)
    except Exception as exc:
        return False, f"import failed: {type(exc).__name__}: {exc}"
    scope = _bind(names)
    sys.argv = ["tests"]  # unittest.main() and argparse in test code read it
    try:
        exec(compile(cfg["script"], "<tests>", "exec"), scope)
        passed, why = True, None
    except SystemExit as exc:  # unittest.main() and the like end with sys.exit(not ok)
        passed, why = exc.code in (None, 0, False), f"tests exited with {exc.code!r}"
    except Broken as exc:
        passed, why = False, str(exc)
    except BaseException as exc:
        assert exc.__traceback__ is not None  # caught here, so it has at least this frame
        traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)  # from the test code down
        passed, why = False, f"{type(exc).__name__}: {exc}"
    if _CHANNEL.broken:  # a caught Broken still fails the case
        passed, why = False, _CHANNEL.broken
    return passed, why


H: types.ModuleType  # the harness module (_harness.py, loaded by path), set by main()
_CHANNEL: Channel  # the solution's worker, set by main() before any test code runs


def main() -> None:
    global H, _CHANNEL
    req_fd, resp_fd, verdict_fd = (int(a) for a in sys.argv[1:4])
    sys.stdin = open(os.devnull)

    def say(line: str) -> None:
        data = (line + "\n").encode()
        while data:
            data = data[os.write(verdict_fd, data) :]

    try:
        H = _load_harness()
        H.no_dump()
        cfg = json.loads(H._read_all(0, 64 << 20))
    except Exception as exc:
        say(f"setup-error: {type(exc).__name__}: {exc}")
        return
    say("ready")
    _CHANNEL = Channel(req_fd, resp_fd, float(cfg["deadline"]))
    passed, why = _run(cfg)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    say(json.dumps({"nonce": cfg["nonce"], "passed": passed, "why": why if why is None else why[:1000]}))


if __name__ == "__main__":
    main()
