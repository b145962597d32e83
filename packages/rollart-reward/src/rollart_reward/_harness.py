"""The test harness that runs inside the sandbox (stdlib only; copied next to the solution and run as a
script by :mod:`rollart_reward.sandbox`). Importable too: the host uses :func:`encode` for test values.

Three roles, each its own process; only the worker ever runs solution code:

- ``harness`` (``python _harness.py``): reads the run's nonce, cases and limits from stdin, makes
  itself non-dumpable (other processes of the same uid can then neither ptrace it nor open its
  ``/proc/<pid>/fd`` or memory), sets the rlimits and starts one tester per script case. Only when all of
  that holds does it write ``started`` on its report pipe; a step that fails writes ``setup-error: ...``
  instead and the host refuses the run. Then it runs the cases: call cases against a worker, comparing
  each returned value with the expected one itself; script cases through their tester. One JSON report
  carrying the nonce follows on the report pipe, which no other process holds.
- ``worker`` (``python _harness.py worker FD SOLUTION``): a fresh interpreter that imports the solution
  as module ``solution`` and answers requests (JSON lines on stdin, replies on fd FD). It never sees an
  expected value, a nonce, or a verdict pipe: whatever it writes is a value to be judged. Its loop is
  ``_solution_worker.py``, loaded by path in that process only.
- ``tester`` (``_tester.py``): runs a script case's test code with the solution's names bound to proxies
  of a worker, and writes the verdict with the nonce to a pipe only it and the harness hold. It is
  non-dumpable and ready before any worker exists.

Values cross between processes as tagged data (:mod:`_codec`): exact builtin types only, so an object
with an always-true ``__eq__`` or an ``int`` subclass is never a value, and ``sys.exit(0)`` or
``os._exit(0)`` is a worker that stopped answering.
"""

from __future__ import annotations

import importlib.util
import json
import os
import select
import subprocess
import sys
import threading
import time

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing into the sandbox's processes
if TYPE_CHECKING:
    import types
    from collections.abc import Callable
    from typing import IO, Any

    from rollart_reward._harness_types import Case, Config, Result, Tagged


def _sibling(name: str) -> types.ModuleType:
    """A module copied next to this file, loaded by path (inside the sandbox ``-I`` keeps the script's
    own directory off ``sys.path``)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), name + ".py")
    spec = importlib.util.spec_from_file_location(f"_rollart_sandbox_{name}", path)
    assert spec is not None and spec.loader is not None  # a .py path always gets a spec with a loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_codec = _sibling("_codec")
# _codec is loaded by path, so mypy cannot see its types: its names as this module re-exports them
MAX_ITEMS: int
MAX_MESSAGE: int
_Unsupported: type[Exception]
encode: Callable[..., Tagged]
decode: Callable[..., Any]
canonical: Callable[[object], str]
render: Callable[[Tagged], str]
MAX_ITEMS, MAX_MESSAGE = _codec.MAX_ITEMS, _codec.MAX_MESSAGE
_Unsupported, encode, decode, canonical, render = (
    _codec._Unsupported,
    _codec.encode,
    _codec.decode,
    _codec.canonical,
    _codec.render,
)


# ---------------------------------------------------------------- harness


class SetupError(Exception):
    """A hardening step of the harness's side could not be applied: the run must not go on."""


def no_dump() -> None:
    """Make this process non-dumpable (PR_SET_DUMPABLE 0): processes of the same uid can then neither
    ptrace it nor open its ``/proc/<pid>/mem`` or ``/proc/<pid>/fd/*``. Raises :class:`SetupError` when
    that cannot be done or checked: the sandbox then refuses to run."""
    try:
        import ctypes
    except ImportError as exc:
        raise SetupError(f"cannot make the harness non-dumpable: ctypes is not importable ({exc})") from None
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE
        raise SetupError(f"cannot make the harness non-dumpable: prctl failed (errno {ctypes.get_errno()})")
    if libc.prctl(3, 0, 0, 0, 0) != 0:  # PR_GET_DUMPABLE
        raise SetupError("cannot make the harness non-dumpable: it is still dumpable after prctl")


def _read_all(fd: int, cap: int) -> bytes:
    chunks: list[bytes]
    chunks, total = [], 0
    while True:
        b = os.read(fd, 1 << 16)
        if not b:
            return b"".join(chunks)
        total += len(b)
        if total > cap:
            raise ValueError("harness input too large")
        chunks.append(b)


class _Capture:
    """Drains a worker's stdout/stderr into a shared, capped buffer; flags an overflow."""

    def __init__(self, cap: int) -> None:
        self.cap, self.total, self.over = cap, 0, threading.Event()
        self.parts = {"stdout": bytearray(), "stderr": bytearray()}
        self.lock = threading.Lock()

    def drain(self, stream: IO[bytes], name: str) -> threading.Thread:
        def run() -> None:
            while True:
                b = stream.read1(65536) if hasattr(stream, "read1") else stream.read(65536)
                if not b:
                    return
                with self.lock:
                    room = self.cap - self.total
                    if room > 0:
                        self.parts[name].extend(b[:room])
                    self.total += len(b)
                    if self.total > self.cap:
                        self.over.set()

        th = threading.Thread(target=run, daemon=True)
        th.start()
        return th


class _Worker:
    """One solution process. Requests go to its stdin (from the harness, or from a tester given
    ``stdin_fd``); replies come back on its own pipe (to the harness, or to the tester: ``resp_w``)."""

    resp_fd: int | None  # None when the replies go to a tester

    def __init__(
        self, cfg: Config, cap: _Capture, stdin_fd: int | None = None, resp_w: int | None = None
    ) -> None:
        own = resp_w is None
        if resp_w is None:  # own
            self.resp_fd, resp_w = os.pipe()
        else:
            self.resp_fd = None
        argv = [sys.executable, "-I", "-B"]
        if cfg.get("audit_hook"):
            argv += ["-c", _GUARD, os.path.abspath(__file__)]
        else:
            argv += [os.path.abspath(__file__)]
        argv += ["worker", str(resp_w), cfg["solution"]]
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE if stdin_fd is None else stdin_fd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(resp_w,),
            cwd=cfg["workdir"],
            env=cfg["env"],
            start_new_session=False,
        )
        if own:
            os.close(resp_w)
        assert self.proc.stdout is not None and self.proc.stderr is not None  # both PIPE
        self.threads = [cap.drain(self.proc.stdout, "stdout"), cap.drain(self.proc.stderr, "stderr")]
        self.buf = b""
        self.cap = cap

    def send(self, msg: dict[str, object]) -> bool:
        try:
            assert self.proc.stdin is not None  # a worker the harness sends to has its stdin on a PIPE
            self.proc.stdin.write((json.dumps(msg) + "\n").encode())
            self.proc.stdin.flush()
            return True
        except (BrokenPipeError, OSError):
            return False

    def recv(self, deadline: float) -> tuple[Any, str | None]:
        """One response line, or ``(None, reason)``."""
        assert self.resp_fd is not None  # only the harness's own workers reply to it
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if self.cap.over.is_set():
                return None, "output_limit"
            if left <= 0:
                return None, "timeout"
            ready, _, _ = select.select([self.resp_fd], [], [], min(left, 0.05))
            if ready:
                chunk = os.read(self.resp_fd, 1 << 16)
                if not chunk:
                    return None, self._death()
                self.buf += chunk
                if len(self.buf) > MAX_MESSAGE:
                    return None, "response too large"
        line, _, self.buf = self.buf.partition(b"\n")
        try:
            return json.loads(line), None
        except ValueError:
            return None, "malformed response"

    def _death(self) -> str:
        try:
            rc = self.proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            return "worker closed its channel"
        if rc < 0:
            import signal

            sig = signal.Signals(-rc)
            return "cpu_time" if sig in (signal.SIGXCPU, signal.SIGKILL) else f"signal:{sig.name}"
        return f"worker exited early (status {rc})"

    def stop(self) -> None:
        try:
            self.proc.kill()
        except OSError:
            pass
        self.proc.wait()
        for th in self.threads:
            th.join(timeout=1.0)
        if self.resp_fd is not None:
            os.close(self.resp_fd)

    def signal_reason(self) -> str | None:
        rc = self.proc.poll()
        if rc is None or rc >= 0:
            return None
        import signal

        sig = signal.Signals(-rc)
        return "cpu_time" if sig in (signal.SIGXCPU, signal.SIGKILL) else f"signal:{sig.name}"


def _run_calls(
    cfg: Config, cases: list[Case], cap: _Capture, deadline: float, results: list[Result], log: list[str]
) -> str | None:
    reason: str | None
    worker = _Worker(cfg, cap)
    try:
        if not worker.send({"op": "import"}):
            reason = "worker did not start"
        else:
            reply, reason = worker.recv(deadline)
            if reply is not None and not reply.get("ok"):
                reason = f"import failed: {str(reply.get('error'))[:500]}"
        if reason is None:
            for i, case in enumerate(cases):
                worker.send(
                    {
                        "op": "call",
                        "i": i,
                        "call": case["call"],
                        "args": case["args"],
                        "kwargs": case["kwargs"],
                    }
                )
                reply, reason = worker.recv(deadline)
                if reply is None:
                    break
                results.append(_judge_call(i, case, reply, log))
    finally:
        worker.stop()
    while len(results) < len(cases):
        results.append({"passed": False, "why": reason or "not run"})
        log.append(f"test {len(results)}: not run ({reason})")
    return reason


def _judge_call(i: int, case: Case, reply: dict[str, Any], log: list[str]) -> Result:
    call = f"{case['call']}({', '.join(render(a) for a in case['args'][1])})"
    n = i + 1
    if reply.get("i") != i or not reply.get("ok"):
        err = str(reply.get("error"))[:300]
        log.append(f"test {n}: {call} raised {err}")
        return {"passed": False, "why": f"raised {err}"}
    try:
        same = canonical(reply["value"]) == canonical(case["expected"])
    except (ValueError, KeyError, TypeError) as exc:
        log.append(f"AssertionError: test {n}: {call} returned an unsupported value ({exc})")
        return {"passed": False, "why": f"bad value: {exc}"}
    if not same:
        log.append(f"AssertionError: test {n}: {call} returned {render(reply['value'])}")
        return {"passed": False, "why": "wrong value"}
    log.append(f"test {n}: ok")
    return {"passed": True}


def _read_line(
    fd: int, deadline: float, stop: Callable[[], bool] | None = None, cap: int = MAX_MESSAGE
) -> str | None:
    """One line from ``fd`` before ``deadline`` (None on EOF, timeout, ``stop()`` or an over-long line)."""
    buf = b""
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0 or len(buf) > cap or (stop is not None and stop()):
            return None
        ready, _, _ = select.select([fd], [], [], min(left, 0.05))
        if ready:
            chunk = os.read(fd, 1)  # byte by byte: what follows the line stays in the pipe
            if not chunk:
                return None
            buf += chunk
    return buf[:-1].decode("utf-8", "replace")


class _Tester:
    """A script case's judge: a fresh interpreter that runs the test code with the solution's names
    bound to proxies of a worker (``_tester.py``). Started, non-dumpable and ready before any solution
    code runs; its verdict pipe is shared with the harness only."""

    def __init__(self, cfg: Config, cap: _Capture, case: Case, deadline: float) -> None:
        self.req_r, req_w = os.pipe()
        resp_r, self.resp_w = os.pipe()
        self.verdict_r, verdict_w = os.pipe()
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_tester.py")
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-B", path, str(req_w), str(resp_r), str(verdict_w)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(req_w, resp_r, verdict_w),
            cwd=cfg["workdir"],
            env=cfg["env"],
        )
        for fd in (req_w, resp_r, verdict_w):
            os.close(fd)
        assert self.proc.stdout is not None and self.proc.stderr is not None  # both PIPE
        self.threads = [cap.drain(self.proc.stdout, "stdout"), cap.drain(self.proc.stderr, "stderr")]
        spec = {"nonce": cfg["nonce"], "script": case["script"], "deadline": deadline}
        try:
            assert self.proc.stdin is not None  # PIPE
            self.proc.stdin.write(json.dumps(spec).encode())
            self.proc.stdin.close()
        except OSError:
            pass
        line = _read_line(self.verdict_r, time.monotonic() + 30.0)
        if line != "ready":
            self.stop()
            raise SetupError(f"the test runner did not start: {line or 'no answer'}")

    def run(
        self, cfg: Config, cap: _Capture, deadline: float, results: list[Result], log: list[str]
    ) -> str | None:
        worker = _Worker(cfg, cap, stdin_fd=self.req_r, resp_w=self.resp_w)
        os.close(self.req_r)
        os.close(self.resp_w)
        try:
            line = _read_line(self.verdict_r, deadline + 0.5, stop=cap.over.is_set)
            died = worker.signal_reason()  # before stop(), whose kill is not the solution's fault
        finally:
            worker.stop()
            self.stop()
        verdict: object = None
        try:
            verdict = json.loads(line) if line else None
        except ValueError:
            pass
        if (
            isinstance(verdict, dict)
            and verdict.get("nonce") == cfg["nonce"]
            and verdict.get("passed") is True
            and not cap.over.is_set()
        ):
            results.append({"passed": True})
            log.append(f"test {len(results)}: ok")
            return None
        why = str(verdict.get("why"))[:500] if isinstance(verdict, dict) else "no verdict"
        if cap.over.is_set():
            why = "output_limit"
        elif line is None and time.monotonic() >= deadline:
            why = "timeout"
        results.append({"passed": False, "why": why})
        log.append(f"script tests failed: {why}")
        if why in ("timeout", "output_limit"):
            return why
        return "memory" if "MemoryError" in why else died

    def stop(self) -> None:
        try:
            self.proc.kill()
        except OSError:
            pass
        self.proc.wait()
        for th in self.threads:
            th.join(timeout=1.0)
        os.close(self.verdict_r)


def _norm_out(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.rstrip().splitlines())


def _run_io(cfg: Config, case: Case, deadline: float, results: list[Result], log: list[str]) -> str | None:
    left = deadline - time.monotonic()
    if left <= 0:
        results.append({"passed": False, "why": "timeout"})
        return "timeout"
    try:
        p = subprocess.run(
            [sys.executable, "-I", "-B", cfg["solution"]],
            input=case["stdin"].encode(),
            capture_output=True,
            timeout=left,
            cwd=cfg["workdir"],
            env=cfg["env"],
        )
    except subprocess.TimeoutExpired:
        results.append({"passed": False, "why": "timeout"})
        return "timeout"
    out = p.stdout[: cfg["max_output"]].decode("utf-8", "replace")
    ok = p.returncode == 0 and _norm_out(out) == _norm_out(case["stdout"])
    n = len(results) + 1
    log.append(
        f"test {n}: ok"
        if ok
        else f"AssertionError: test {n}: wrong output (status {p.returncode})"
        + ("\n" + p.stderr[-300:].decode("utf-8", "replace") if p.stderr else "")
    )
    results.append({"passed": ok} if ok else {"passed": False, "why": "wrong output"})
    return None


def _setup(cfg: Config, deadline: float) -> tuple[_Capture, list[_Tester]]:
    """Everything of the harness's side that must hold before any solution code exists. Raises
    :class:`SetupError` naming the step that could not be applied."""
    no_dump()
    import resource

    for name, value in cfg["limits"].items():
        try:
            # a JSON [soft, hard]: no pair for mypy, but setrlimit checks the length itself (ValueError)
            resource.setrlimit(getattr(resource, name), tuple(value))  # type: ignore[arg-type]
        except (OSError, ValueError) as exc:
            raise SetupError(f"cannot set {name} to {value}: {exc}") from None
    threading.stack_size(256 << 10)  # the output threads stay small under RLIMIT_AS
    cap = _Capture(cfg["max_output"])
    testers = [_Tester(cfg, cap, c, deadline) for c in cfg["cases"] if c["kind"] == "script"]
    return cap, testers


def harness() -> None:
    cfg: Config = json.loads(_read_all(0, 64 << 20))
    report_fd = cfg["report_fd"]
    cfg["audit_hook"] = os.environ.get("ROLLART_SANDBOX_NET") == "none"
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    deadline = time.monotonic() + cfg["timeout_s"]
    try:
        cap, testers = _setup(cfg, deadline)
    except SetupError as exc:
        os.write(report_fd, f"setup-error: {exc}\n".encode())
        return
    os.write(report_fd, b"started\n")  # from here on every failure is the solution's
    results: list[Result]
    log: list[str]
    killed: str | None
    results, log, killed = [], [], None
    cases = cfg["cases"]
    calls = [c for c in cases if c["kind"] == "call"]
    if calls:
        killed = _run_calls(cfg, calls, cap, deadline, results, log)
    for case in cases:
        if case["kind"] == "script":
            killed = testers.pop(0).run(cfg, cap, deadline, results, log) or killed
        elif case["kind"] == "io":
            killed = _run_io(cfg, case, deadline, results, log) or killed
    if cap.over.is_set():
        killed = "output_limit"
    if (
        killed
        and killed not in ("timeout", "output_limit", "cpu_time", "memory")
        and not killed.startswith("signal:")
    ):
        log.append(killed)
        killed = "memory" if "MemoryError" in killed else None
    with cap.lock:
        out = cap.parts["stdout"].decode("utf-8", "replace")
        err = cap.parts["stderr"].decode("utf-8", "replace")
    report = {
        "nonce": cfg["nonce"],
        "results": results,
        "killed": killed,
        "stdout": out,
        "stderr": err,
        "log": log,
    }
    data = json.dumps(report).encode()
    while data:
        data = data[os.write(report_fd, data) :]
    os.close(report_fd)


# ---------------------------------------------------------------- worker (its loop: _solution_worker.py)

# Fallback when no network namespace exists: refuse socket use from Python code (native code gets past).
_GUARD = r"""
import sys
def _no_net(event, args):
    if event.startswith("socket.") and event != "socket.gethostname":
        raise PermissionError("network access is disabled in the sandbox")
sys.addaudithook(_no_net)
del _no_net
path = sys.argv[1]
sys.argv = sys.argv[1:]
exec(compile(open(path).read(), path, "exec"), {"__name__": "__main__", "__file__": path})
"""


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        _sibling("_solution_worker").worker(int(sys.argv[2]), sys.argv[3], _codec)
    else:
        harness()
