"""The test harness that runs inside the sandbox (stdlib only; copied next to the solution and run as a
script by :mod:`rollart_reward.sandbox`). Importable too: the host uses :func:`encode` for test values.

Two roles, two processes:

- ``harness`` (``python _harness.py``): never runs model code. Makes itself non-dumpable (other processes
  of the same uid cannot ptrace it or read its ``/proc/<pid>/fd`` and memory), reads the run's nonce and
  test cases from stdin to EOF *before* any model code exists, starts a worker, sends it one call at a
  time, compares each returned value with the expected one, and writes one JSON report carrying the
  nonce to fd 3. The host trusts nothing else: no report, a report without the nonce, or fewer results
  than cases is a failure.
- ``worker`` (``python _harness.py worker FD SOLUTION``): a fresh interpreter (exec, so it holds none of
  the harness's memory) that imports the solution as module ``solution`` and answers call requests on
  fd FD. It never sees expected values or the nonce. Its answers are tagged values (:func:`encode`:
  exact builtin types only), compared by the harness as data, so an object with an always-true
  ``__eq__`` or an ``int`` subclass is just an unsupported value, and ``sys.exit(0)``/``os._exit(0)``
  is a worker that stopped answering.

Wire values are tagged lists: ``["n"]`` None, ``["b", bool]``, ``["i", "digits"]``, ``["f", repr]``,
``["s", str]``, ``["y", hex]`` bytes, ``["l"|"t"|"S"|"F", [items]]`` list / tuple / set / frozenset,
``["d", [[k, v], ...]]`` dict, ``["?", type name]`` anything else.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time

MAX_DEPTH = 64
MAX_ITEMS = 100_000
MAX_MESSAGE = 8 << 20


class _Unsupported(Exception):
    pass


def encode(x, depth=0, budget=None):
    """Tag an exact-builtin value (anything else becomes ``["?", type name]``)."""
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
        tag = {list: "l", tuple: "t", set: "S", frozenset: "F"}[t]
        return [tag, [encode(v, depth + 1, budget) for v in x]]
    if t is dict:
        return ["d", [[encode(k, depth + 1, budget), encode(v, depth + 1, budget)] for k, v in x.items()]]
    return ["?", t.__name__ if type(t.__name__) is str else "?"]


def decode(v, depth=0):
    """Tagged value -> Python value (the worker's side: arguments for the solution)."""
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
        items = [decode(i, depth + 1) for i in v[1]]
        return {"l": list, "t": tuple, "S": set, "F": frozenset}[tag](items)
    if tag == "d":
        return {decode(k, depth + 1): decode(val, depth + 1) for k, val in v[1]}
    raise ValueError(f"unsupported tag {tag!r}")


def canonical(v, depth=0):
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


def render(v, limit=200):
    """Short human form of a tagged value, for feedback."""
    try:
        text = repr(decode(v))
    except Exception:
        text = "<unrenderable value>"
    return text if len(text) <= limit else text[:limit] + "..."


# ---------------------------------------------------------------- harness


def _no_dump():
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE, 0
    except Exception:
        pass


def _read_all(fd, cap):
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

    def __init__(self, cap):
        self.cap, self.total, self.over = cap, 0, threading.Event()
        self.parts = {"stdout": bytearray(), "stderr": bytearray()}
        self.lock = threading.Lock()

    def drain(self, stream, name):
        def run():
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
    def __init__(self, cfg, cap, mode):
        r, w = os.pipe()
        self.resp_fd = r
        argv = [sys.executable, "-I", "-B"]
        if cfg.get("audit_hook"):
            argv += ["-c", _GUARD, os.path.abspath(__file__)]
        else:
            argv += [os.path.abspath(__file__)]
        argv += ["worker", str(w), cfg["solution"], mode]
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(w,),
            cwd=cfg["workdir"],
            env=cfg["env"],
            start_new_session=False,
        )
        os.close(w)
        self.threads = [cap.drain(self.proc.stdout, "stdout"), cap.drain(self.proc.stderr, "stderr")]
        self.buf = b""
        self.cap = cap

    def send(self, msg):
        try:
            self.proc.stdin.write((json.dumps(msg) + "\n").encode())
            self.proc.stdin.flush()
            return True
        except (BrokenPipeError, OSError):
            return False

    def recv(self, deadline):
        """One response line, or ``(None, reason)``."""
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

    def _death(self):
        try:
            rc = self.proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            return "worker closed its channel"
        if rc < 0:
            import signal

            sig = signal.Signals(-rc)
            return "cpu_time" if sig in (signal.SIGXCPU, signal.SIGKILL) else f"signal:{sig.name}"
        return f"worker exited early (status {rc})"

    def stop(self):
        try:
            self.proc.kill()
        except OSError:
            pass
        self.proc.wait()
        for th in self.threads:
            th.join(timeout=1.0)
        os.close(self.resp_fd)


def _run_calls(cfg, cases, cap, deadline, results, log):
    worker = _Worker(cfg, cap, "module")
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


def _judge_call(i, case, reply, log):
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


def _run_script(cfg, case, cap, deadline, results, log):
    worker = _Worker(cfg, cap, "script")
    try:
        ok = worker.send({"op": "script", "tests": case["script"]})
        reply, reason = worker.recv(deadline) if ok else (None, "worker did not start")
    finally:
        worker.stop()
    if reply is not None and reply.get("ok"):
        results.append({"passed": True})
        return None
    why = reason or str(reply.get("error"))[:500]
    results.append({"passed": False, "why": why})
    log.append(f"script tests failed: {why}")
    return reason or ("memory" if why.startswith("MemoryError") else None)


def _norm_out(text):
    return "\n".join(line.rstrip() for line in text.rstrip().splitlines())


def _run_io(cfg, case, deadline, results, log):
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


def harness():
    _no_dump()
    cfg = json.loads(_read_all(0, 64 << 20))
    report_fd = cfg["report_fd"]
    cfg["audit_hook"] = os.environ.get("ROLLART_SANDBOX_NET") == "none"
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    import resource

    for name, value in cfg["limits"].items():
        resource.setrlimit(getattr(resource, name), tuple(value))
    deadline = time.monotonic() + cfg["timeout_s"]
    cap = _Capture(cfg["max_output"])
    results, log, killed = [], [], None
    cases = cfg["cases"]
    calls = [c for c in cases if c["kind"] == "call"]
    if calls:
        killed = _run_calls(cfg, calls, cap, deadline, results, log)
    for case in cases:
        if case["kind"] == "script":
            killed = _run_script(cfg, case, cap, deadline, results, log) or killed
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


# ---------------------------------------------------------------- worker

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


def worker(resp_fd, solution, mode):
    out = os.fdopen(resp_fd, "w", buffering=1)
    stdin = sys.stdin
    sys.stdin = open(os.devnull)

    def reply(**msg):
        for stream in (sys.stdout, sys.stderr):  # the harness stops the worker once it has the reply
            try:
                stream.flush()
            except Exception:
                pass
        out.write(json.dumps(msg) + "\n")
        out.flush()

    def error(exc):
        return f"{type(exc).__name__}: {exc}"[:2000]

    module = None
    for line in stdin:
        msg = json.loads(line)
        if msg["op"] == "script":
            scope = {"__name__": "__main__", "__file__": solution}
            try:
                with open(solution, encoding="utf-8") as f:
                    src = f.read()
                exec(compile(src + "\n\n" + msg["tests"] + "\n", solution, "exec"), scope)
            except BaseException as exc:
                import traceback

                traceback.print_exc()
                reply(ok=False, error=error(exc))
                return
            reply(ok=True)
            return
        if msg["op"] == "import":
            import importlib.util

            try:
                spec = importlib.util.spec_from_file_location("solution", solution)
                module = importlib.util.module_from_spec(spec)
                sys.modules["solution"] = module
                spec.loader.exec_module(module)
            except BaseException as exc:
                reply(ok=False, error=error(exc))
                return
            reply(ok=True)
            continue
        i = msg["i"]
        try:
            fn = getattr(module, msg["call"])
            args = decode(msg["args"])
            kwargs = decode(msg["kwargs"])
            value = fn(*args, **kwargs)
        except BaseException as exc:
            reply(i=i, ok=False, error=error(exc))
            continue
        try:
            tagged = encode(value)
        except (_Unsupported, RecursionError) as exc:
            tagged = ["?", str(exc)]
        reply(i=i, ok=True, value=tagged)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        worker(int(sys.argv[2]), sys.argv[3], sys.argv[4])
    else:
        harness()
