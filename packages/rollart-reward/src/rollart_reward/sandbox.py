"""Run untrusted Python (model-written code) against test cases in a locked-down subprocess.

**The harness decides.** The tests are not run by the model's code: a harness process
(:mod:`rollart_reward._harness`) receives the test cases and a per-run random nonce on its stdin, starts a
fresh worker interpreter that imports the solution as a module, calls it once per test case, compares
each returned value type-strictly as data (never through the solution's ``__eq__``), and writes a report
with the nonce to a pipe only it holds. An early exit (``sys.exit(0)``, ``os._exit(0)``), a killed
harness, or a missing / nonce-less / short report is a failure. Test-case formats: :func:`parse_tests`.

**Isolation levels** (:func:`probe_isolation`; the level that ran is ``SandboxResult.isolation``):

- ``bwrap``: bubblewrap with user, mount, PID, network, IPC, UTS and cgroup namespaces. The sandbox
  sees only ``/usr`` (and the interpreter's prefix) read-only, its own files read-only at ``/sandbox``,
  a private ``/tmp``, its own ``/proc`` (PID 1 is the sandbox's init), no network but its own loopback.
  ``kill(-1)`` reaches only sandbox processes; every process dies with the harness (PID namespace,
  ``--die-with-parent``). As root, bubblewrap runs as a throw-away uid (one per run), so even a mount
  escape meets a uid that owns nothing. Works for a non-root trainer where user namespaces are allowed.
- ``netns`` (fallback): rlimits, a network namespace (as root, or through an unprivileged user
  namespace), and as root a throw-away uid whose leftover processes are killed after the run.
  The file system is the host's (read-only only where permissions say so).
- ``rlimits`` (fallback): rlimits, and a Python audit hook refusing sockets (native code gets past it).

``isolation="require"`` (the default) refuses to run without ``bwrap`` (a :class:`SandboxError` naming
what is missing); ``"best_effort"`` falls back. Every level keeps the rlimits (CPU seconds, address
space, processes, file size, open files, no core dumps), a wall-clock timeout that kills the whole
process group, and an output cap.
"""

from __future__ import annotations

import ast
import asyncio
import concurrent.futures
import itertools
import json
import logging
import math
import os
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Literal

from rollart_core.errors import RewardError
from rollart_reward import _harness

__all__ = [
    "Isolation",
    "SandboxError",
    "SandboxResult",
    "isolation",
    "parse_tests",
    "probe_isolation",
    "run_python",
    "run_python_async",
]

log = logging.getLogger(__name__)

Isolation = Literal["require", "best_effort"]

MAX_PROCESSES = 64
"""``RLIMIT_NPROC`` inside the sandbox (counts every process and thread of the sandbox's uid)."""
MAX_FILE_BYTES = 16 << 20
"""``RLIMIT_FSIZE``: largest file the code may write."""
MAX_OPEN_FILES = 256
MAX_CASES = 10_000
_UID_BASE = 620_000
_UID_SPAN = 30_000
_uid_counter = itertools.count()
_HARNESS_SRC = _harness.__file__


class SandboxError(RewardError):
    """The sandbox cannot run the code as asked (isolation unavailable, malformed test cases)."""


@dataclass
class SandboxResult:
    """Outcome of one sandboxed run."""

    passed: bool
    """Every test case passed, judged by the harness, with a valid report."""
    returncode: int | None
    """Exit status of the harness (0 when it completed its report, whatever the tests did)."""
    stdout: str
    stderr: str
    """The solution's stderr, then one line per failed test (``AssertionError: test 2: f(1) returned 3``)."""
    killed_reason: str | None
    """``timeout``, ``cpu_time``, ``memory``, ``output_limit``, ``signal:<NAME>``, ``no_report`` or None."""
    duration_s: float
    tests_passed: int = 0
    tests_total: int = 0
    isolation: str = ""
    """The level that ran: ``bwrap``, ``netns`` or ``rlimits``."""


# ---------------------------------------------------------------- test cases


def _literal(node: ast.AST) -> Any:
    return ast.literal_eval(node)


def _assert_to_case(stmt: ast.stmt) -> dict[str, Any] | None:
    """``assert f(<literals>) == <literal>[, msg]`` as a call case; None for any other statement."""
    if not isinstance(stmt, ast.Assert) or not isinstance(stmt.test, ast.Compare):
        return None
    cmp = stmt.test
    if len(cmp.ops) != 1 or not isinstance(cmp.ops[0], ast.Eq):
        return None
    call, expected = cmp.left, cmp.comparators[0]
    if isinstance(expected, ast.Call) and not isinstance(call, ast.Call):
        call, expected = expected, call
    if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name):
        return None
    try:
        args = [_literal(a) for a in call.args]
        kwargs = {k.arg: _literal(k.value) for k in call.keywords if k.arg is not None}
        if len(kwargs) != len(call.keywords) or any(isinstance(a, ast.Starred) for a in call.args):
            return None
        return {"call": call.func.id, "args": args, "kwargs": kwargs, "expected": _literal(expected)}
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        return None


def parse_tests(tests: str | list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The test cases of ``tests``, in the harness's form. Accepted formats:

    - a list of dicts, each ``{"call": "f", "args": [...], "kwargs": {...}, "expected": value}`` (the harness
      calls ``solution.f(*args, **kwargs)`` and compares the result type-strictly) or
      ``{"stdin": "...", "stdout": "..."}`` (the solution runs as a program; its output, trailing
      whitespace ignored, must equal ``stdout``);
    - a string of test code. When every statement is ``assert f(<literals>) == <literal>`` the asserts
      become call cases (as safe as the dict form). Otherwise the whole string is one *script* case run
      after the solution in its namespace, passing when it completes: an early exit still fails, but a
      script can be fooled from inside (an object whose ``__eq__`` is always true): prefer call cases;
    - empty / None: one script case that passes when the solution runs to its end.
    """
    if tests is None or (isinstance(tests, str) and not tests.strip()):
        return [{"kind": "script", "script": ""}]
    if isinstance(tests, str):
        try:
            tree = ast.parse(tests)
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return [{"kind": "script", "script": tests}]
        cases = [_assert_to_case(s) for s in tree.body]
        if cases and all(c is not None for c in cases):
            return [_call_case(c, i) for i, c in enumerate(cases)]  # type: ignore[arg-type]
        return [{"kind": "script", "script": tests}]
    if not isinstance(tests, list | tuple) or not tests:
        raise SandboxError(
            f"tests must be a string of test code or a non-empty list of cases, got {type(tests).__name__}"
        )
    if len(tests) > MAX_CASES:
        raise SandboxError(f"{len(tests)} test cases, more than the limit of {MAX_CASES}")
    out = []
    for i, case in enumerate(tests):
        if not isinstance(case, dict):
            raise SandboxError(f"test case {i}: expected a dict, got {type(case).__name__}")
        if "call" in case:
            out.append(_call_case(case, i))
        elif "stdin" in case or "stdout" in case:
            if not isinstance(case.get("stdin", ""), str) or not isinstance(case.get("stdout"), str):
                raise SandboxError(f"test case {i}: 'stdin' and 'stdout' must be strings")
            out.append({"kind": "io", "stdin": case.get("stdin", ""), "stdout": case["stdout"]})
        else:
            raise SandboxError(
                f"test case {i}: needs 'call' + 'expected' or 'stdin' + 'stdout', got keys {sorted(case)}"
            )
    return out


def _call_case(case: dict[str, Any], i: int) -> dict[str, Any]:
    unknown = set(case) - {"call", "args", "kwargs", "expected"}
    if (
        unknown
        or "expected" not in case
        or not isinstance(case["call"], str)
        or not case["call"].isidentifier()
    ):
        raise SandboxError(
            f"test case {i}: a call case is {{'call': name, 'args': [...], 'kwargs': {{...}}, "
            f"'expected': value}}, got {case!r:.200}"
        )
    args, kwargs = case.get("args", []), case.get("kwargs", {})
    if (
        not isinstance(args, list | tuple)
        or not isinstance(kwargs, dict)
        or not all(isinstance(k, str) for k in kwargs)
    ):
        raise SandboxError(f"test case {i}: 'args' must be a list and 'kwargs' a dict with string keys")
    try:
        return {
            "kind": "call",
            "call": case["call"],
            "args": _harness.encode(tuple(args)),
            "kwargs": _harness.encode(dict(kwargs)),
            "expected": _harness.encode(case["expected"]),
        }
    except _harness._Unsupported as exc:
        raise SandboxError(f"test case {i}: {exc}") from None


# ---------------------------------------------------------------- isolation


def _world_executable(path: str) -> bool:
    """True if a process of an unrelated uid can execute ``path`` (every parent dir o+x)."""
    path = os.path.realpath(path)
    try:
        if not os.stat(path).st_mode & stat.S_IXOTH:
            return False
        parent = os.path.dirname(path)
        while True:
            if not os.stat(parent).st_mode & stat.S_IXOTH:
                return False
            if parent == "/":
                return True
            parent = os.path.dirname(parent)
    except OSError:
        return False


def _interpreter(drop: bool) -> str:
    """The Python that runs the harness: ours, or a system one the dropped uid can reach."""
    override = os.environ.get("ROLLART_SANDBOX_PYTHON")
    if override:
        return os.path.realpath(override)
    if not drop or _world_executable(sys.executable):
        return os.path.realpath(sys.executable)
    for cand in ("/usr/bin/python3", "/usr/local/bin/python3", "/bin/python3"):
        if os.path.exists(cand) and _world_executable(cand):
            return os.path.realpath(cand)
    raise SandboxError(
        "running as root, the sandbox drops to an unprivileged uid, but no Python interpreter is "
        "executable by other users; set ROLLART_SANDBOX_PYTHON to one (e.g. /usr/bin/python3)"
    )


def _bwrap_argv(bwrap: str, python: str, rundir: str, as_root: bool) -> list[str]:
    argv = [bwrap, "--unshare-all", "--die-with-parent", "--new-session"]
    if as_root:
        argv += ["--cap-drop", "ALL"]
    argv += ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
        if os.path.islink(top):
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind", top, top]
    for etc in ("/etc/ld.so.cache", "/etc/alternatives"):
        argv += ["--ro-bind-try", etc, etc]
    prefix = os.path.dirname(os.path.dirname(python))
    if not (prefix + "/").startswith("/usr/"):
        argv += ["--ro-bind", prefix, prefix]
    argv += [
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--tmpfs",
        "/tmp",
        "--ro-bind",
        rundir,
        "/sandbox",
        "--chdir",
        "/tmp",
        "--",
        python,
        "-I",
        "-B",
        "/sandbox/_harness.py",
    ]
    return argv


# Runs in the child before the harness: drops to the run's uid (as root) and execs bubblewrap, or (the
# fallback) enters a network namespace where it can, drops the uid, and execs the harness.
_LAUNCHER = r"""
import ctypes, json, os, sys
cfg = json.loads(sys.argv[1])
env = dict(cfg["env"])
if cfg["mode"] == "fallback":
    libc = ctypes.CDLL(None, use_errno=True)
    NEWNET, NEWUSER = 0x40000000, 0x10000000
    net = "none"
    if libc.unshare(NEWNET) == 0:
        net = "netns"
    elif os.geteuid() != 0 and libc.unshare(NEWUSER | NEWNET) == 0:
        net = "netns"
    env["ROLLART_SANDBOX_NET"] = net
    os.write(2, ("\0level:" + ("netns" if net == "netns" else "rlimits") + "\n").encode())
uid = cfg["uid"]
if uid is not None:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
os.execve(cfg["argv"][0], cfg["argv"], env)
"""

_REAPER = r"""
import os, signal, sys
uid = int(sys.argv[1])
os.setgroups([]); os.setgid(uid); os.setuid(uid)
for _ in range(50):
    try:
        os.kill(-1, signal.SIGKILL)
    except ProcessLookupError:
        break
"""

_probe_lock = threading.Lock()
_probe_cache: dict[bool, tuple[bool, str]] = {}
_last_level: str | None = None


def probe_isolation() -> tuple[str | None, str]:
    """``("bwrap", "")`` when bubblewrap sandboxes work here, else ``(None, <what is missing>)``."""
    is_root = os.geteuid() == 0
    with _probe_lock:
        if is_root not in _probe_cache:
            _probe_cache[is_root] = _probe_bwrap(is_root)
    ok, why = _probe_cache[is_root]
    return ("bwrap", "") if ok else (None, why)


def _probe_bwrap(is_root: bool) -> tuple[bool, str]:
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return False, "bwrap not found on PATH (install the 'bubblewrap' package: apt-get install bubblewrap)"
    try:
        with open("/proc/sys/user/max_user_namespaces") as f:
            if int(f.read().strip() or 0) == 0:
                return False, "user namespaces disabled (sysctl user.max_user_namespaces = 0)"
    except (OSError, ValueError):
        pass
    try:
        python = _interpreter(is_root)
    except SandboxError as exc:
        return False, str(exc)
    rundir = tempfile.mkdtemp(prefix="rollart-sandbox-probe-")
    try:
        os.chmod(rundir, 0o755)
        shutil.copyfile(_HARNESS_SRC, os.path.join(rundir, "_harness.py"))
        os.chmod(os.path.join(rundir, "_harness.py"), 0o644)
        argv = _bwrap_argv(bwrap, python, rundir, as_root=False)
        argv[-3:] = ["-I", "-c", "import os; assert os.getpid() == 2 or os.getpid() < 10"]
        cfg = {
            "mode": "bwrap",
            "uid": _UID_BASE + _UID_SPAN if is_root else None,
            "argv": argv,
            "env": {"PATH": "/usr/bin:/bin"},
        }
        p = subprocess.run(
            [sys.executable, "-I", "-S", "-c", _LAUNCHER, json.dumps(cfg)], capture_output=True, timeout=20
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"bwrap probe failed: {exc}"
    finally:
        shutil.rmtree(rundir, ignore_errors=True)
    if p.returncode != 0:
        err = p.stderr.decode("utf-8", "replace").strip()[-300:]
        if "namespace" in err or "uid map" in err or "Operation not permitted" in err:
            return False, f"user namespaces disabled or not permitted for this user (bwrap: {err})"
        return False, f"bwrap does not run here (status {p.returncode}): {err}"
    return True, ""


def isolation() -> str:
    """The isolation level of the last run in this process: ``bwrap``, ``netns`` or ``rlimits``."""
    return _last_level or "unknown (no run yet)"


# ---------------------------------------------------------------- running


def _uid_processes(uid: int) -> list[int]:
    """Live (non-zombie) processes owned by ``uid``."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid != uid:
                    continue
                with open(f"/proc/{entry}/stat") as f:
                    state = f.read().rpartition(")")[2].split()[0]
            except (OSError, IndexError):
                continue
            if state not in ("Z", "X"):
                pids.append(int(entry))
    return pids


async def _reap_uid(uid: int) -> None:
    """Kill every leftover process of the throw-away uid (daemonised children, fork bombs)."""
    deadline = time.monotonic() + 5.0
    while _uid_processes(uid) and time.monotonic() < deadline:
        proc = await asyncio.create_subprocess_exec(sys.executable, "-I", "-S", "-c", _REAPER, str(uid))
        await proc.wait()
        await asyncio.sleep(0.01)  # let the kernel finish tearing down the killed processes
    left = _uid_processes(uid)
    if left:
        log.error("sandbox uid %d still has processes %s after reaping", uid, left)


async def _read_capped(stream: asyncio.StreamReader, buf: bytearray, cap: int) -> None:
    while True:
        chunk = await stream.read(65536)
        if not chunk:
            return
        room = cap - len(buf)
        if room > 0:
            buf.extend(chunk[:room])


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _limits(timeout_s: float, memory_mb: int) -> dict[str, list[int]]:
    cpu = max(1, math.ceil(timeout_s))
    mem = memory_mb << 20
    return {
        "RLIMIT_CPU": [cpu, cpu + 1],
        "RLIMIT_AS": [mem, mem],
        "RLIMIT_NPROC": [MAX_PROCESSES, MAX_PROCESSES],
        "RLIMIT_FSIZE": [MAX_FILE_BYTES, MAX_FILE_BYTES],
        "RLIMIT_NOFILE": [MAX_OPEN_FILES, MAX_OPEN_FILES],
        "RLIMIT_CORE": [0, 0],
    }


async def run_python_async(
    code: str,
    tests: str | list[dict[str, Any]] | None = "",
    *,
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    max_output_bytes: int = 65536,
    isolation: Isolation = "require",
) -> SandboxResult:
    """Run ``code`` against ``tests`` (see :func:`parse_tests`) in the sandbox without blocking the loop.

    Raises :class:`SandboxError` for malformed tests, or when ``isolation="require"`` and no real
    isolation is available here (the message names what is missing)."""
    global _last_level
    if isolation not in ("require", "best_effort"):
        raise SandboxError(f"isolation must be 'require' or 'best_effort', got {isolation!r}")
    t0 = time.perf_counter()
    cases = parse_tests(tests)
    level, why = await asyncio.to_thread(probe_isolation)
    if level is None and isolation == "require":
        raise SandboxError(
            f"sandbox: no real isolation on this host: {why}; install bubblewrap, or set "
            "isolation='best_effort' to run with rlimits only"
        )
    is_root = os.geteuid() == 0
    uid = _UID_BASE + (os.getpid() * 7919 + next(_uid_counter)) % _UID_SPAN if is_root else None
    python = _interpreter(is_root)
    rundir = tempfile.mkdtemp(prefix="rollart-sandbox-")
    workdir = None
    report_r = report_w = -1
    try:
        os.chmod(rundir, 0o755)
        shutil.copyfile(_HARNESS_SRC, os.path.join(rundir, "_harness.py"))
        with open(os.path.join(rundir, "solution.py"), "w", encoding="utf-8", errors="surrogatepass") as f:
            f.write(code)
        for name in ("_harness.py", "solution.py"):
            os.chmod(os.path.join(rundir, name), 0o644)
        if level == "bwrap":
            inner_solution, inner_workdir, inner_harness = "/sandbox/solution.py", "/tmp", None
            argv = _bwrap_argv(shutil.which("bwrap") or "bwrap", python, rundir, as_root=False)
        else:
            workdir = tempfile.mkdtemp(prefix="rollart-sandbox-work-")
            if uid is not None:
                os.chown(workdir, uid, uid)
            inner_solution, inner_workdir = os.path.join(rundir, "solution.py"), workdir
            inner_harness = os.path.join(rundir, "_harness.py")
            argv = [python, "-I", "-B", inner_harness]
        report_r, report_w = os.pipe()
        env = {"PATH": "/usr/bin:/bin", "HOME": inner_workdir, "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8"}
        nonce = secrets.token_hex(16)
        harness_cfg = {
            "nonce": nonce,
            "cases": cases,
            "limits": _limits(timeout_s, memory_mb),
            "timeout_s": timeout_s,
            "max_output": max_output_bytes,
            "solution": inner_solution,
            "workdir": inner_workdir,
            "env": env,
            "report_fd": report_w,
        }
        launch = {"mode": "bwrap" if level == "bwrap" else "fallback", "uid": uid, "argv": argv, "env": env}
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-I",
            "-S",
            "-c",
            _LAUNCHER,
            json.dumps(launch),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
            pass_fds=(report_w,),
        )
        os.close(report_w)
        report_w = -1
        result = await _supervise(proc, report_r, harness_cfg, timeout_s, max_output_bytes, uid, level, t0)
        _last_level = result.isolation
        return result
    finally:
        for fd in (report_r, report_w):
            if fd >= 0:
                os.close(fd)
        shutil.rmtree(rundir, ignore_errors=True)
        if workdir:
            shutil.rmtree(workdir, ignore_errors=True)


async def _supervise(
    proc: asyncio.subprocess.Process,
    report_r: int,
    harness_cfg: dict[str, Any],
    timeout_s: float,
    max_output_bytes: int,
    uid: int | None,
    level: str | None,
    t0: float,
) -> SandboxResult:
    loop = asyncio.get_running_loop()
    report = bytearray()
    report_done = loop.create_future()
    report_cap = 4 * max_output_bytes + 200 * len(harness_cfg["cases"]) + (1 << 20)

    def on_report() -> None:
        try:
            chunk = os.read(report_r, 1 << 16)
        except OSError:
            chunk = b""
        if chunk and len(report) < report_cap:
            report.extend(chunk)
        elif not chunk or len(report) >= report_cap:
            loop.remove_reader(report_r)
            if not report_done.done():
                report_done.set_result(None)

    loop.add_reader(report_r, on_report)
    out, err = bytearray(), bytearray()
    readers = asyncio.gather(
        _read_capped(proc.stdout, out, max_output_bytes),  # type: ignore[arg-type]
        _read_capped(proc.stderr, err, max_output_bytes),
    )  # type: ignore[arg-type]
    killed: str | None = None
    try:
        try:
            proc.stdin.write(json.dumps(harness_cfg).encode())  # type: ignore[union-attr]
            await proc.stdin.drain()  # type: ignore[union-attr]
            proc.stdin.close()  # type: ignore[union-attr]
        except (BrokenPipeError, ConnectionResetError):
            pass
        try:  # the harness stops itself at timeout_s; the slack covers start-up and the report
            await asyncio.wait_for(asyncio.shield(proc.wait()), timeout=timeout_s + 3.0)
        except TimeoutError:
            killed = "timeout"
            _kill_group(proc.pid)
        await proc.wait()
        try:
            await asyncio.wait_for(asyncio.shield(report_done), timeout=1.0)
        except TimeoutError:  # a leftover process holds the report pipe open (fallback levels)
            pass
    finally:
        loop.remove_reader(report_r)
        if proc.returncode is None:
            _kill_group(proc.pid)
            await proc.wait()
        _kill_group(proc.pid)  # the fallback levels: whatever is left in the process group
        try:
            await asyncio.wait_for(readers, timeout=1.0)
        except (TimeoutError, asyncio.CancelledError, Exception):
            readers.cancel()
        if uid is not None and level != "bwrap":
            await _reap_uid(uid)
    stderr_host = err.decode("utf-8", "replace")
    ran = level or "rlimits"
    if "\0level:" in stderr_host:
        head, _, tail = stderr_host.partition("\0level:")
        ran, _, rest = tail.partition("\n")
        stderr_host = head + rest
    return _judge(bytes(report), harness_cfg, proc.returncode, killed, stderr_host, ran, t0)


def _judge(
    report_bytes: bytes,
    cfg: dict[str, Any],
    rc: int | None,
    killed: str | None,
    stderr_host: str,
    level: str,
    t0: float,
) -> SandboxResult:
    total = len(cfg["cases"])
    report: Any = None
    try:
        report = json.loads(report_bytes) if report_bytes else None
    except ValueError:
        report = None
    results = report.get("results") if isinstance(report, dict) else None
    valid = (
        isinstance(report, dict)
        and secrets.compare_digest(str(report.get("nonce", "")), cfg["nonce"])
        and isinstance(results, list)
        and len(results) == total
        and all(isinstance(r, dict) and type(r.get("passed")) is bool for r in results)
    )
    duration = time.perf_counter() - t0
    if not valid:
        if killed is None and rc is not None and rc < 0:
            sig = signal.Signals(-rc)
            killed = "cpu_time" if sig in (signal.SIGXCPU, signal.SIGKILL) else f"signal:{sig.name}"
        why = "no report from the harness" if report is None else "invalid report (wrong nonce or results)"
        return SandboxResult(
            False,
            rc,
            "",
            f"{stderr_host[-2000:]}\n{why}".strip(),
            killed or "no_report",
            duration,
            0,
            total,
            level,
        )
    assert isinstance(report, dict) and isinstance(results, list)  # narrowed by ``valid`` (our own data)
    passed = sum(r["passed"] for r in results)
    killed = killed or (report.get("killed") if isinstance(report.get("killed"), str) else None)
    failures = "\n".join(str(line) for line in report.get("log", []) if "ok" != str(line)[-2:])
    stderr = str(report.get("stderr", ""))
    if failures:
        stderr = f"{stderr}\n{failures}".lstrip("\n")
    return SandboxResult(
        passed == total and total > 0 and killed is None,
        rc,
        str(report.get("stdout", "")),
        stderr,
        killed,
        duration,
        passed,
        total,
        level,
    )


_pool: concurrent.futures.ThreadPoolExecutor | None = None


def run_python(
    code: str,
    tests: str | list[dict[str, Any]] | None = "",
    *,
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    max_output_bytes: int = 65536,
    isolation: Isolation = "require",
) -> SandboxResult:
    """Blocking form of :func:`run_python_async` (safe to call from inside a running event loop's thread)."""
    coro = run_python_async(
        code,
        tests,
        timeout_s=timeout_s,
        memory_mb=memory_mb,
        max_output_bytes=max_output_bytes,
        isolation=isolation,
    )
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    global _pool
    if _pool is None:
        _pool = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="rollart-sandbox")
    return _pool.submit(asyncio.run, coro).result()
