"""Run untrusted Python (model-written code + its tests) in a locked-down subprocess.

Isolation, layer by layer (Linux):

- a fresh temporary directory as working directory and ``HOME``, removed afterwards;
- resource limits: CPU seconds, address space (``memory_mb``), number of processes, file size,
  open files, no core dumps;
- no network: the child enters a new, empty network namespace (``unshare(CLONE_NEWNET)``: as root,
  or through an unprivileged user namespace). Where neither is allowed, a Python audit hook refuses
  socket calls instead — weaker (native code can bypass it); :func:`isolation` says which is active;
- privilege drop: ``RLIMIT_NPROC`` is not enforced for root, so when running as root the child
  switches to a throw-away uid (one per run) before running the code. That makes the process limit
  bite (a fork bomb stops at ``max_processes``) and lets the parent kill every process of that uid
  afterwards, even ones that left the process group;
- a wall-clock timeout that kills the whole process group, and an output cap that kills the run
  once stdout + stderr exceed ``max_output_bytes``.

``passed`` is true only for exit status 0 without being killed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
import logging
import math
import os
import shutil
import signal
import stat
import sys
import tempfile
import time
from dataclasses import dataclass

__all__ = ["SandboxResult", "isolation", "run_python", "run_python_async"]

log = logging.getLogger(__name__)

MAX_PROCESSES = 64
"""``RLIMIT_NPROC`` for the sandboxed uid (counts every process and thread of that uid)."""
MAX_FILE_BYTES = 16 << 20
"""``RLIMIT_FSIZE``: largest file the code may write."""
MAX_OPEN_FILES = 256
_UID_BASE = 620_000
_UID_SPAN = 30_000
_uid_counter = itertools.count()

# Runs as the parent's user in the child process (single-threaded, right after exec), isolates,
# limits and drops privileges, then execs the interpreter on the solution file.
_LAUNCHER = r"""
import ctypes, json, os, resource, sys
cfg = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
NEWNET, NEWUSER = 0x40000000, 0x10000000
mode = "audit-hook"
if libc.unshare(NEWNET) == 0:
    mode = "netns"
elif os.geteuid() != 0 and libc.unshare(NEWUSER | NEWNET) == 0:
    mode = "userns+netns"
with open(cfg["status"], "w") as f:
    f.write(mode)
for name, value in cfg["limits"].items():
    resource.setrlimit(getattr(resource, name), tuple(value))
os.chdir(cfg["workdir"])
uid = cfg["uid"]
if uid is not None:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
argv = [cfg["python"], "-I", "-B"]
if mode == "audit-hook":
    argv += ["-c", cfg["guard"]]
else:
    argv += ["solution.py"]
os.execve(cfg["python"], argv, cfg["env"])
"""

# Fallback when no network namespace can be created: refuse socket use from Python code.
_GUARD = r"""
import sys
def _no_net(event, args):
    if event.startswith("socket.") and event != "socket.gethostname":
        raise PermissionError("network access is disabled in the sandbox")
sys.addaudithook(_no_net)
del _no_net
__file__ = "solution.py"
exec(compile(open("solution.py").read(), "solution.py", "exec"), {"__name__": "__main__"})
"""

# Kills every process of one uid (run as root, drops to that uid so kill(-1) reaches only those).
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


@dataclass
class SandboxResult:
    """Outcome of one sandboxed run."""

    passed: bool
    returncode: int | None
    stdout: str
    stderr: str
    killed_reason: str | None
    """``timeout``, ``cpu_time``, ``memory``, ``output_limit``, ``signal:<NAME>`` or None."""
    duration_s: float


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
    """The Python that runs the untrusted code: ours, or a system one the dropped uid can reach."""
    override = os.environ.get("ROLLART_SANDBOX_PYTHON")
    if override:
        return override
    if not drop or _world_executable(sys.executable):
        return sys.executable
    for cand in ("/usr/bin/python3", "/usr/local/bin/python3", "/bin/python3"):
        if os.path.exists(cand) and _world_executable(cand):
            return os.path.realpath(cand)
    raise RuntimeError(
        "running as root, the sandbox drops to an unprivileged uid, but no Python interpreter is "
        "executable by other users; set ROLLART_SANDBOX_PYTHON to one (e.g. /usr/bin/python3)"
    )


_isolation_cache: str | None = None


def isolation() -> str:
    """The network isolation mode the last run used: ``netns``, ``userns+netns`` or ``audit-hook``."""
    return _isolation_cache or "unknown (no run yet)"


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


async def _read_capped(stream: asyncio.StreamReader, buf: bytearray, total: list[int], cap: int,
                       over: asyncio.Event) -> None:
    while True:
        chunk = await stream.read(65536)
        if not chunk:
            return
        room = cap - total[0]
        if room > 0:
            buf.extend(chunk[:room])
        total[0] += len(chunk)
        if total[0] > cap:
            over.set()
            return


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


async def run_python_async(code: str, tests: str = "", *, timeout_s: float = 5.0, memory_mb: int = 512,
                           max_output_bytes: int = 65536) -> SandboxResult:
    """Run ``code`` followed by ``tests`` in the sandbox without blocking the event loop."""
    global _isolation_cache
    t0 = time.perf_counter()
    is_root = os.geteuid() == 0
    uid = _UID_BASE + (os.getpid() * 7919 + next(_uid_counter)) % _UID_SPAN if is_root else None
    python = _interpreter(is_root)
    workdir = tempfile.mkdtemp(prefix="rollart-sandbox-")
    ctl = tempfile.mkdtemp(prefix="rollart-sandbox-ctl-")
    try:
        with open(os.path.join(workdir, "solution.py"), "w") as f:
            f.write(code)
            if tests:
                f.write("\n\n" + tests + "\n")
        if uid is not None:
            os.chown(workdir, uid, uid)
            os.chown(os.path.join(workdir, "solution.py"), uid, uid)
        cpu = max(1, math.ceil(timeout_s))
        mem = memory_mb << 20
        cfg = {
            "python": python,
            "workdir": workdir,
            "uid": uid,
            "status": os.path.join(ctl, "status"),
            "guard": _GUARD,
            "env": {"PATH": "/usr/bin:/bin", "HOME": workdir, "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8"},
            "limits": {
                "RLIMIT_CPU": [cpu, cpu + 1],
                "RLIMIT_AS": [mem, mem],
                "RLIMIT_NPROC": [MAX_PROCESSES, MAX_PROCESSES],
                "RLIMIT_FSIZE": [MAX_FILE_BYTES, MAX_FILE_BYTES],
                "RLIMIT_NOFILE": [MAX_OPEN_FILES, MAX_OPEN_FILES],
                "RLIMIT_CORE": [0, 0],
            },
        }
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-S", "-c", _LAUNCHER, json.dumps(cfg),
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        out, err, total = bytearray(), bytearray(), [0]
        over = asyncio.Event()
        readers = asyncio.gather(
            _read_capped(proc.stdout, out, total, max_output_bytes, over),  # type: ignore[arg-type]
            _read_capped(proc.stderr, err, total, max_output_bytes, over),  # type: ignore[arg-type]
        )
        over_wait = asyncio.ensure_future(over.wait())
        killed: str | None = None
        try:
            done, _ = await asyncio.wait({readers, over_wait}, timeout=timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
            if over_wait in done:
                killed = "output_limit"
            elif readers not in done:
                killed = "timeout"
            if killed:
                _kill_group(proc.pid)
            try:
                rc = await asyncio.wait_for(proc.wait(), timeout=max(0.5, timeout_s - (time.perf_counter() - t0)))
            except TimeoutError:  # pipes closed but the process lingers (closed its stdio)
                killed = killed or "timeout"
                _kill_group(proc.pid)
                rc = await proc.wait()
        finally:
            over_wait.cancel()
            if proc.returncode is None:
                _kill_group(proc.pid)
                await proc.wait()
            readers.cancel()
            try:
                await readers
            except (asyncio.CancelledError, Exception):
                pass
            if uid is not None:
                await _reap_uid(uid)
        try:
            with open(cfg["status"]) as f:
                _isolation_cache = f.read() or _isolation_cache
        except OSError:
            pass
        stderr = err.decode("utf-8", "replace")
        if killed is None and rc is not None and rc < 0:
            sig = signal.Signals(-rc)
            killed = "cpu_time" if sig in (signal.SIGXCPU, signal.SIGKILL) else f"signal:{sig.name}"
        if killed is None and rc != 0 and "MemoryError" in stderr[-2000:]:
            killed = "memory"
        return SandboxResult(
            passed=rc == 0 and killed is None,
            returncode=rc,
            stdout=out.decode("utf-8", "replace"),
            stderr=stderr,
            killed_reason=killed,
            duration_s=time.perf_counter() - t0,
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(ctl, ignore_errors=True)


_pool: concurrent.futures.ThreadPoolExecutor | None = None


def run_python(code: str, tests: str = "", *, timeout_s: float = 5.0, memory_mb: int = 512,
               max_output_bytes: int = 65536) -> SandboxResult:
    """Blocking form of :func:`run_python_async` (safe to call from inside a running event loop's thread)."""
    coro = run_python_async(code, tests, timeout_s=timeout_s, memory_mb=memory_mb,
                            max_output_bytes=max_output_bytes)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    global _pool
    if _pool is None:
        _pool = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="rollart-sandbox")
    return _pool.submit(asyncio.run, coro).result()
