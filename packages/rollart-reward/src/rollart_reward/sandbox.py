"""Run untrusted Python (model-written code) against test cases in a locked-down subprocess.

**The harness decides.** The model's code runs only in worker processes. A harness process
(:mod:`rollart_reward._harness`) gets the cases and a per-run nonce, compares call cases' returned values
type-strictly as data itself, and runs script-form tests (``check(candidate)``, ``math.isclose``) in a
tester process (:mod:`rollart_reward._tester`) where the solution's names are proxies to a worker; the
harness and testers are non-dumpable before any worker exists, and the verdicts travel on pipes no
worker holds. An early exit, a forged reply, a killed harness, or a missing / nonce-less / short report
is a failure. Test-case formats: :func:`parse_tests`.

**Isolation levels** (:func:`probe_isolation`; the level that ran is ``SandboxResult.isolation``):

- ``bwrap``: bubblewrap with user, mount, PID, network, IPC, UTS and cgroup namespaces, no nested user
  namespaces, and a seccomp filter (:mod:`rollart_reward._hardening`). The sandbox sees only ``/usr``
  (and the interpreter's prefix) read-only, its own files read-only at ``/sandbox``, sized ``/tmp`` and
  ``/dev/shm``, a read-only ``/`` and ``/dev``, its own ``/proc``, no network but its own loopback.
  ``kill(-1)`` reaches only sandbox processes; every process dies with the harness. As root, bubblewrap
  runs as a throw-away uid (one per run).
- ``netns`` (fallback): rlimits, a network namespace, and as root a throw-away uid whose leftover
  processes are killed after the run. The file system is the host's.
- ``rlimits`` (fallback): rlimits, and a Python audit hook refusing sockets (native code gets past it).

**Whole-tree limits**: memory (processes and files together), processes, CPU seconds and wall time bound
the answer's whole process tree: a cgroup per run where one can be made, else rlimits split so they sum
to the same totals. **Fail closed**: ``isolation="require"`` (the default) refuses to run without
``bwrap``, and every hardening step (seccomp, ``--disable-userns``, non-dumpable harness and testers,
rlimits, a required cgroup) either holds or the run raises :class:`SandboxError` naming it, before any
answer code runs.
"""

from __future__ import annotations

import ast
import asyncio
import concurrent.futures
import itertools
import json
import logging
import os
import secrets
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Literal

from rollart_reward import _hardening, _harness
from rollart_reward._hardening import HardeningError, TreeLimits
from rollart_reward._supervise import (
    SandboxError,
    SandboxResult,
    _rlimits,
    _Run,
    _supervise,
)

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
Limits = Literal["auto", "cgroup", "rlimits"]

MAX_PROCESSES = 64
"""Processes and threads the answer may have at once (the harness's own side adds its tasks)."""
MAX_CASES = 10_000
_UID_BASE = 620_000
_UID_SPAN = 30_000
_uid_counter = itertools.count()
_SANDBOX_SOURCES = tuple(
    os.path.join(os.path.dirname(_harness.__file__), name)
    for name in ("_codec.py", "_harness.py", "_solution_worker.py", "_tester.py")
)


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
      become call cases. Otherwise the whole string is one *script* case: it runs in a tester process
      with the solution's names bound to proxies (values cross as plain data), passing when it completes;
    - empty / None: one script case that passes when the solution imports without error.
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


def _bwrap_argv(bwrap: str, python: str, rundir: str, seccomp_fd: int, limits: TreeLimits) -> list[str]:
    # --unshare-user is explicit: --disable-userns needs it (and a user namespace must never be optional).
    argv = [
        bwrap,
        "--unshare-all",
        "--unshare-user",
        "--disable-userns",
        "--die-with-parent",
        "--new-session",
    ]
    argv += ["--seccomp", str(seccomp_fd), "--ro-bind", "/usr", "/usr"]
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
        "--size",
        str(limits.shm_bytes),
        "--tmpfs",
        "/dev/shm",
        "--size",
        str(limits.tmp_bytes),
        "--tmpfs",
        "/tmp",
        "--ro-bind",
        rundir,
        "/sandbox",
        # bwrap's own / and /dev are unsized tmpfs mounts: read-only, the sized ones above hold all files
        "--remount-ro",
        "/dev",
        "--remount-ro",
        "/",
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
for procs in cfg.get("cgroup", []):
    try:
        with open(procs, "w") as f:
            f.write(str(os.getpid()))
    except OSError as exc:
        os.write(2, ("\0setup-error:cannot join the run's cgroup (" + procs + "): " + str(exc) + "\n").encode())
        os._exit(125)
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


# Run inside a probe sandbox: every hardening step bwrap was asked for must be in force.
_PROBE = r"""
import ctypes, os
status = open("/proc/self/status").read()
if "Seccomp:\t2" not in status:
    raise SystemExit("the seccomp filter is not in force")
if ctypes.CDLL(None, use_errno=True).unshare(0x10000000) == 0:
    raise SystemExit("a nested user namespace could be made")
for path in ("/probe", "/dev/probe"):
    try:
        open(path, "w").close()
        raise SystemExit(path + " is writable (unsized tmpfs)")
    except OSError:
        pass
"""


def _seccomp_fd(seccomp: str) -> int:
    """A pipe's read end holding the seccomp program (``"builtin"`` or a compiled BPF file's path)."""
    if seccomp == "builtin":
        try:
            program = _hardening.seccomp_program()
        except HardeningError as exc:
            raise SandboxError(f"sandbox hardening unavailable: {exc}") from None
    else:
        try:
            with open(seccomp, "rb") as f:
                program = f.read(1 << 16)
        except OSError as exc:
            raise SandboxError(f"sandbox hardening unavailable: seccomp program {seccomp!r}: {exc}") from None
        if not program or len(program) % 8:
            raise SandboxError(f"seccomp program {seccomp!r} is not a list of 8-byte BPF instructions")
    r, w = os.pipe()
    try:
        os.write(w, program)  # < 64 KiB: fits the pipe's buffer
    finally:
        os.close(w)
    return r


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
        seccomp_fd = _seccomp_fd("builtin")
    except SandboxError as exc:
        return False, str(exc)
    rundir = tempfile.mkdtemp(prefix="rollart-sandbox-probe-")
    try:
        os.chmod(rundir, 0o755)
        limits = _hardening.tree_limits(64, 8, 5.0, 8, cgroup=True)  # sizes only
        argv = _bwrap_argv(bwrap, python, rundir, seccomp_fd, limits)
        argv[-3:] = ["-I", "-c", _PROBE]
        cfg = {
            "mode": "bwrap",
            "uid": _UID_BASE + _UID_SPAN if is_root else None,
            "argv": argv,
            "env": {"PATH": "/usr/bin:/bin"},
        }
        p = subprocess.run(
            [sys.executable, "-I", "-S", "-c", _LAUNCHER, json.dumps(cfg)],
            capture_output=True,
            timeout=20,
            pass_fds=(seccomp_fd,),
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"bwrap probe failed: {exc}"
    finally:
        os.close(seccomp_fd)
        shutil.rmtree(rundir, ignore_errors=True)
    if p.returncode != 0:
        err = p.stderr.decode("utf-8", "replace").strip()[-300:]
        if err.startswith("bwrap:") and ("namespace" in err or "uid map" in err or "not permitted" in err):
            return False, f"user namespaces disabled or not permitted for this user (bwrap: {err})"
        return False, f"bwrap does not run here with every hardening step (status {p.returncode}): {err}"
    return True, ""


def isolation() -> str:
    """The isolation level of the last run in this process: ``bwrap``, ``netns`` or ``rlimits``."""
    return _last_level or "unknown (no run yet)"


# ---------------------------------------------------------------- running


def _tree_limits(
    memory_mb: int, max_processes: int, cpu_s: float, tmpfs_mb: int | None, cgroup: bool
) -> TreeLimits:
    try:
        return _hardening.tree_limits(
            memory_mb, max_processes, cpu_s, tmpfs_mb if tmpfs_mb is not None else memory_mb // 4, cgroup
        )
    except HardeningError as exc:
        raise SandboxError(str(exc)) from None


def _make_cgroup(
    limits: str, memory_mb: int, max_processes: int, cpu_s: float, tmpfs_mb: int | None, parent: str | None
) -> tuple[TreeLimits, _hardening.Cgroup | None]:
    """The run's whole-tree limits: a cgroup where one can be made (required by ``limits="cgroup"``),
    else (``"auto"``) limits split so they sum to the same totals."""
    if limits not in ("auto", "cgroup", "rlimits"):
        raise SandboxError(f"limits must be 'auto', 'cgroup' or 'rlimits', got {limits!r}")
    if limits != "rlimits":
        tree = _tree_limits(memory_mb, max_processes, cpu_s, tmpfs_mb, cgroup=True)
        try:
            return tree, _hardening.Cgroup.create(tree, parent)
        except HardeningError as exc:
            if limits == "cgroup":
                raise SandboxError(f"sandbox hardening unavailable: {exc}") from None
            log.debug("no cgroup for the sandbox (%s): split rlimits", exc)
    return _tree_limits(memory_mb, max_processes, cpu_s, tmpfs_mb, cgroup=False), None


async def run_python_async(
    code: str,
    tests: str | list[dict[str, Any]] | None = "",
    *,
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    max_output_bytes: int = 65536,
    isolation: Isolation = "require",
    cpu_s: float | None = None,
    max_processes: int = MAX_PROCESSES,
    tmpfs_mb: int | None = None,
    limits: Limits = "auto",
    cgroup_parent: str | None = None,
    seccomp: str = "builtin",
) -> SandboxResult:
    """Run ``code`` against ``tests`` (see :func:`parse_tests`) in the sandbox without blocking the loop.

    ``memory_mb`` bounds the answer's whole process tree and its files together, ``max_processes`` its
    processes and threads, ``cpu_s`` (default ``timeout_s``) its CPU seconds, ``timeout_s`` its wall
    time; ``tmpfs_mb`` (default a quarter of ``memory_mb``) is the share files may take. ``limits``:
    ``cgroup`` requires a cgroup (below ``cgroup_parent``, a path inside the cgroup hierarchy, default
    this process's own), ``rlimits`` splits the totals over per-process rlimits, ``auto`` takes a
    cgroup where one can be made. ``seccomp``: the built-in filter, or the path of a compiled BPF
    program. Raises :class:`SandboxError` for malformed tests, or when a hardening step cannot be
    applied here (the message names it)."""
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
    seccomp_fd = _seccomp_fd(seccomp) if level == "bwrap" else -1
    cgroup = None
    rundir = tempfile.mkdtemp(prefix="rollart-sandbox-")
    workdir = None
    report_r = report_w = -1
    try:
        tree, cgroup = await asyncio.to_thread(
            _make_cgroup, limits, memory_mb, max_processes, cpu_s or timeout_s, tmpfs_mb, cgroup_parent
        )
        os.chmod(rundir, 0o755)
        for src in _SANDBOX_SOURCES:
            shutil.copyfile(src, os.path.join(rundir, os.path.basename(src)))
        with open(os.path.join(rundir, "solution.py"), "w", encoding="utf-8", errors="surrogatepass") as f:
            f.write(code)
        for name in ("_codec.py", "_harness.py", "_solution_worker.py", "_tester.py", "solution.py"):
            os.chmod(os.path.join(rundir, name), 0o644)
        if level == "bwrap":
            inner_solution, inner_workdir = "/sandbox/solution.py", "/tmp"
            argv = _bwrap_argv(shutil.which("bwrap") or "bwrap", python, rundir, seccomp_fd, tree)
        else:
            workdir = tempfile.mkdtemp(prefix="rollart-sandbox-work-")
            if uid is not None:
                os.chown(workdir, uid, uid)
            inner_solution, inner_workdir = os.path.join(rundir, "solution.py"), workdir
            argv = [python, "-I", "-B", os.path.join(rundir, "_harness.py")]
        report_r, report_w = os.pipe()
        env = {
            "PATH": "/usr/bin:/bin",
            "HOME": inner_workdir,
            "LANG": "C.UTF-8",
            "PYTHONIOENCODING": "utf-8",
            "MALLOC_ARENA_MAX": "2",  # glibc reserves 64 MiB of address space per thread arena
        }
        harness_cfg = {
            "nonce": secrets.token_hex(16),
            "cases": cases,
            "limits": _rlimits(tree),
            "timeout_s": timeout_s,
            "max_output": max_output_bytes,
            "solution": inner_solution,
            "workdir": inner_workdir,
            "env": env,
            "report_fd": report_w,
        }
        launch = {
            "mode": "bwrap" if level == "bwrap" else "fallback",
            "uid": uid,
            "argv": argv,
            "env": env,
            "cgroup": cgroup.procs_files() if cgroup else [],
        }
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
            pass_fds=(report_w, seccomp_fd) if seccomp_fd >= 0 else (report_w,),
        )
        for fd in (report_w, seccomp_fd):
            if fd >= 0:
                os.close(fd)
        report_w = seccomp_fd = -1
        run = _Run(tree, cgroup, uid, level, timeout_s, max_output_bytes, t0)
        result = await _supervise(proc, report_r, harness_cfg, run)
        _last_level = result.isolation
        return result
    finally:
        for fd in (report_r, report_w, seccomp_fd):
            if fd >= 0:
                os.close(fd)
        if cgroup is not None:
            await asyncio.to_thread(cgroup.remove)
        shutil.rmtree(rundir, ignore_errors=True)
        if workdir:
            shutil.rmtree(workdir, ignore_errors=True)


_pool: concurrent.futures.ThreadPoolExecutor | None = None


def run_python(
    code: str,
    tests: str | list[dict[str, Any]] | None = "",
    **options: Any,
) -> SandboxResult:
    """Blocking form of :func:`run_python_async` (same options; safe to call from inside a running
    event loop's thread)."""
    coro = run_python_async(code, tests, **options)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    global _pool
    if _pool is None:
        _pool = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="rollart-sandbox")
    return _pool.submit(asyncio.run, coro).result()
