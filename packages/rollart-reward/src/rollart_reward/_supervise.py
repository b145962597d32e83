"""The host side of one sandboxed run: the harness's limits, supervision (wall clock, whole-tree CPU
seconds, output caps, the report pipe), and the verdict from the harness's report. Used by
:mod:`rollart_reward.sandbox`."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import secrets
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any

from rollart_core.errors import RewardError
from rollart_reward import _hardening
from rollart_reward._hardening import TreeLimits

log = logging.getLogger(__name__)

MAX_FILE_BYTES = 16 << 20
"""``RLIMIT_FSIZE``: largest file the code may write (at most the size of its ``/tmp``)."""
MAX_OPEN_FILES = 256


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
    limits: str = ""
    """How the whole tree was bounded: ``cgroup`` or ``rlimits`` (split so they sum to the totals)."""
    memory_peak_bytes: int | None = None
    """The tree's peak memory, processes and files together (with a cgroup; None without)."""


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


def _rlimits(limits: TreeLimits) -> dict[str, list[int]]:
    cpu = max(1, math.ceil(limits.cpu_s))
    fsize = min(MAX_FILE_BYTES, limits.tmp_bytes)
    return {
        "RLIMIT_CPU": [cpu, cpu + 1],
        "RLIMIT_AS": [limits.per_process_bytes, limits.per_process_bytes],
        "RLIMIT_NPROC": [limits.processes, limits.processes],
        "RLIMIT_FSIZE": [fsize, fsize],
        "RLIMIT_NOFILE": [MAX_OPEN_FILES, MAX_OPEN_FILES],
        "RLIMIT_CORE": [0, 0],
    }


@dataclass
class _Run:
    """One run's resources on the host side."""

    limits: TreeLimits
    cgroup: _hardening.Cgroup | None
    uid: int | None
    level: str | None
    timeout_s: float
    max_output_bytes: int
    t0: float


async def _cpu_exceeded(proc: asyncio.subprocess.Process, run: _Run) -> None:
    """Returns once the whole tree has used more than its CPU seconds."""
    while True:
        await asyncio.sleep(0.1 if run.cgroup else 0.25)  # a poll: the kernel signals nothing here
        if run.cgroup is not None:
            used = await asyncio.to_thread(run.cgroup.cpu_seconds)
        else:
            used = await asyncio.to_thread(_hardening.tree_cpu_seconds, proc.pid)
        if used > run.limits.cpu_s:
            return


async def _supervise(
    proc: asyncio.subprocess.Process, report_r: int, harness_cfg: dict[str, Any], run: _Run
) -> SandboxResult:
    loop = asyncio.get_running_loop()
    report = bytearray()
    report_done = loop.create_future()
    report_cap = 4 * run.max_output_bytes + 200 * len(harness_cfg["cases"]) + (1 << 20)

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
        _read_capped(proc.stdout, out, run.max_output_bytes),  # type: ignore[arg-type]
        _read_capped(proc.stderr, err, run.max_output_bytes),  # type: ignore[arg-type]
    )
    killed: str | None = None
    cpu_watch = asyncio.ensure_future(_cpu_exceeded(proc, run))
    try:
        try:
            proc.stdin.write(json.dumps(harness_cfg).encode())  # type: ignore[union-attr]
            await proc.stdin.drain()  # type: ignore[union-attr]
            proc.stdin.close()  # type: ignore[union-attr]
        except (BrokenPipeError, ConnectionResetError):
            pass
        exited = asyncio.ensure_future(proc.wait())
        # the harness stops itself at timeout_s; the slack covers start-up and the report
        done, _ = await asyncio.wait(
            {exited, cpu_watch}, timeout=run.timeout_s + 3.0, return_when="FIRST_COMPLETED"
        )
        if exited not in done:
            killed = "cpu_time" if cpu_watch in done else "timeout"
            _kill_group(proc.pid)
            if run.cgroup is not None:
                await asyncio.to_thread(run.cgroup.kill)
        await proc.wait()
        try:
            await asyncio.wait_for(asyncio.shield(report_done), timeout=1.0)
        except TimeoutError:  # a leftover process holds the report pipe open (fallback levels)
            pass
    finally:
        cpu_watch.cancel()
        loop.remove_reader(report_r)
        if proc.returncode is None:
            _kill_group(proc.pid)
            await proc.wait()
        _kill_group(proc.pid)  # the fallback levels: whatever is left in the process group
        try:
            await asyncio.wait_for(readers, timeout=1.0)
        except (TimeoutError, asyncio.CancelledError, Exception):
            readers.cancel()
        if run.uid is not None and run.level != "bwrap":
            await _reap_uid(run.uid)
    stderr_host = err.decode("utf-8", "replace")
    ran = run.level or "rlimits"
    # The launcher's markers come first, before any solution code exists. Only the first line counts:
    # a solution can write to the host's stderr pipe too (through bwrap's init, /proc/1/fd/2, when the
    # sandbox's uid owns that pipe), so nothing after it may turn a run into a refusal.
    first, _, rest = stderr_host.partition("\n")
    if first.startswith("\0level:") and run.level != "bwrap":
        ran, stderr_host = first[len("\0level:") :], rest
    if first.startswith("\0setup-error:") and not report.startswith(b"started\n"):
        raise SandboxError("sandbox refused to run: " + first[len("\0setup-error:") :].strip())
    body = _started(bytes(report), proc.returncode, killed, stderr_host)
    result = _judge(body, harness_cfg, proc.returncode, killed, stderr_host, ran, run.t0)
    result.limits = "cgroup" if run.cgroup is not None else "rlimits"
    if run.cgroup is not None:
        result.memory_peak_bytes = run.cgroup.peak_bytes()
        if not result.passed and run.cgroup.oom_kills() > 0:
            result.killed_reason = "memory"
    return result


def _started(report: bytes, rc: int | None, killed: str | None, stderr_host: str) -> bytes:
    """The report after the harness's start line. Raises :class:`SandboxError` when the harness
    refused (a hardening step failed) or never started: no solution code ran, so there is no score."""
    if report.startswith(b"setup-error:"):
        raise SandboxError("sandbox refused to run: " + report[12:].decode("utf-8", "replace").strip())
    if not report.startswith(b"started\n"):
        raise SandboxError(
            f"the sandbox did not start (status {rc}, {killed or 'exited'}): {stderr_host.strip()[-800:]}"
        )
    return report[len(b"started\n") :]


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
