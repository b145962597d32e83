"""Every process a run starts dies with its driver, however the driver dies (SIGKILL included).

A driver that exits normally shuts down what it started. A driver that is SIGKILLed (a scheduler's
preemption, the OOM killer) runs no code at all: Ray's head processes (GCS, raylet, log monitor,
dashboard) die with it (Ray starts them with ``PR_SET_PDEATHSIG``), but the raylet's own children do
not: its dashboard agent and runtime-env agent poll for the raylet, then try to report to a GCS that
is gone, and were seen alive more than 20 s after the kill; a node preempted again and again piles
them up. Processes started with a session of their own (a reward runtime, a sandbox) escape a
process-group kill too.

:func:`guard_driver` starts, once per driver process, a watchdog: a small separate Python process
(standard library only, in a session of its own, so a signal to the driver's process group leaves it
alive) that

- holds a pidfd of the driver (``pidfd_open``; where there is none, it polls the driver's PID and
  start time every ``interval_s``) and wakes the moment the driver is gone;
- meanwhile samples the process tree every ``interval_s``: every process that descends from the
  driver, and every descendant of a process seen before (it stays the run's after its parent died:
  Ray's workers once the raylet is gone), each recorded as (PID, start time);
- marks the run: ``ROLLART_RUN_MARK=<driver pid>-<random>`` in the driver's environment, inherited by
  whatever it starts after, so that a process started after the last sample (and reparented before
  the watchdog saw it) is found too;
- when the driver is gone: SIGTERM to the run's processes (recorded and still alive with their start
  time, or carrying the mark, and their descendants), SIGKILL ``grace_s`` later to what is left,
  repeated until none is left; then it exits.

Only the run's own processes are touched: never by name, only by PID and start time (a PID reused by
a stranger has another start time), each signal sent through a pidfd opened after that check. The
watchdog does not keep a run alive, takes no signal from the driver's terminal, and costs one
``/proc`` scan every ``interval_s`` (a few ms with a few hundred processes).

    from rollart_core.watchdog import guard_driver
    guard_driver()          # before starting anything (RayCluster calls it before ray.init)

This file also runs as the watchdog itself (``python -I watchdog.py --pid ...``): standard library only.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import select
import signal
import sys
import time

__all__ = ["RUN_MARK_ENV", "descendants", "guard_driver", "process_table", "start_time", "watchdog_pid"]

RUN_MARK_ENV = "ROLLART_RUN_MARK"
"""The environment variable that marks the processes of one driver's run."""

READY = b"rollart-watchdog ready\n"


# ---------------------------------------------------------------------------------------- /proc reading


def _stat(pid: int) -> tuple[int, str, int] | None:
    """(parent PID, state, start time in clock ticks since boot) of ``pid``; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            rest = f.read().rsplit(b")", 1)[1].split()  # the command in parentheses may hold spaces
    except (OSError, IndexError):
        return None
    return int(rest[1]), rest[0].decode(), int(rest[19])


def start_time(pid: int) -> int | None:
    """The start time of ``pid`` (clock ticks since boot); None when it is gone or a zombie."""
    st = _stat(pid)
    return None if st is None or st[1] in ("Z", "X") else st[2]


def process_table() -> dict[int, tuple[int, int]]:
    """Every live (not zombie) process: PID -> (parent PID, start time)."""
    table = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st is not None and st[1] not in ("Z", "X"):
                table[int(name)] = (st[0], st[2])
    return table


def descendants(roots: set[int], table: dict[int, tuple[int, int]]) -> set[int]:
    """The PIDs in ``table`` below any of ``roots`` (children, their children, ...), roots excluded."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found: set[int] = set()
    todo = list(roots)
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found and child not in roots:
                found.add(child)
                todo.append(child)
    return found


def _has_mark(pid: int, mark: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return mark in f.read().split(b"\0")
    except OSError:
        return False


def _signal(pid: int, start: int, sig: int) -> None:
    """``sig`` to ``pid`` if it is still the process that started at ``start``."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except (AttributeError, OSError):  # no pidfd (old kernel): the start-time check alone
        if start_time(pid) == start:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        return
    try:
        if start_time(pid) == start:  # checked after the pidfd pinned the process
            signal.pidfd_send_signal(fd, sig)
    except OSError:
        pass
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------------ the watchdog


class _Watch:
    def __init__(self, driver: int, driver_start: int, mark: str) -> None:
        self.driver, self.driver_start = driver, driver_start
        self.mark = f"{RUN_MARK_ENV}={mark}".encode()
        self.me = os.getpid()
        self.tracked: dict[int, int] = {}  # PID -> start time: every process of the run seen so far

    def sample(self) -> None:
        table = process_table()
        self.tracked = {p: s for p, s in self.tracked.items() if table.get(p, (0, -1))[1] == s}
        for pid in descendants({self.driver, *self.tracked}, table) - {self.me}:
            self.tracked.setdefault(pid, table[pid][1])

    def driver_alive(self) -> bool:
        return start_time(self.driver) == self.driver_start

    def wait_for_driver(self, interval_s: float) -> None:
        """Return once the driver is gone, sampling the tree meanwhile."""
        try:
            fd: int | None = os.pidfd_open(self.driver)
        except (AttributeError, OSError):
            fd = None
        if not self.driver_alive():  # gone (or its PID reused) before the pidfd was open
            return
        while True:
            if fd is not None:
                if select.select([fd], [], [], interval_s)[0]:
                    return
            else:
                time.sleep(interval_s)
                if not self.driver_alive():
                    return
            self.sample()

    def targets(self) -> dict[int, int]:
        """The run's live processes now: tracked, marked, and whatever descends from them."""
        table = process_table()
        found = {p for p, s in self.tracked.items() if table.get(p, (0, -1))[1] == s}
        uid = os.getuid()
        for pid, (_, start) in table.items():
            if (
                pid not in found
                and start >= self.driver_start
                and _owned(pid, uid)
                and _has_mark(pid, self.mark)
            ):
                found.add(pid)
        found |= descendants(found, table)
        found.discard(self.me)
        out = {p: table[p][1] for p in found if p in table}
        self.tracked.update(out)
        return out

    def sweep(self, grace_s: float, budget_s: float) -> tuple[int, int]:
        """SIGTERM the run's processes, SIGKILL them ``grace_s`` later; returns (stopped, killed)."""
        termed: dict[tuple[int, int], float] = {}
        killed: set[tuple[int, int]] = set()
        deadline = time.monotonic() + budget_s
        while time.monotonic() < deadline:
            targets = self.targets()
            if not targets:
                break
            now = time.monotonic()
            for pid, start in targets.items():
                key = (pid, start)
                if key not in termed:
                    termed[key] = now
                    _signal(pid, start, signal.SIGTERM)
                elif now - termed[key] >= grace_s:
                    killed.add(key)
                    _signal(pid, start, signal.SIGKILL)
            time.sleep(0.05)
        return len(termed), len(killed)


def _owned(pid: int, uid: int) -> bool:
    try:
        return os.stat(f"/proc/{pid}").st_uid == uid
    except OSError:
        return False


def _main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="rollart watchdog: the run's processes die with its driver")
    ap.add_argument("--pid", type=int, required=True)
    ap.add_argument("--start", type=int, required=True)
    ap.add_argument("--mark", required=True)
    ap.add_argument("--grace", type=float, default=2.0)
    ap.add_argument("--interval", type=float, default=0.5)
    args = ap.parse_args(argv)
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_IGN)  # the driver's terminal and pipes are not the watchdog's end
    watch = _Watch(args.pid, args.start, args.mark)
    watch.sample()
    try:
        os.write(1, READY)
        os.close(1)
    except OSError:
        pass
    watch.wait_for_driver(args.interval)
    stopped, killed = watch.sweep(args.grace, budget_s=max(10.0, 4 * args.grace))
    left = watch.targets()
    if stopped:
        msg = (
            f"rollart watchdog: driver {args.pid} is gone; stopped {stopped} process(es) of its run"
            f" ({killed} needed SIGKILL){f'; still alive: {sorted(left)}' if left else ''}\n"
        )
        try:
            os.write(2, msg.encode())
        except OSError:
            pass
    return 1 if left else 0


# ---------------------------------------------------------------------------------------- driver's side

_guard: tuple[int, int] | None = None  # (driver PID, watchdog PID)


def _running_child(pid: int) -> bool:
    """Whether our child ``pid`` still runs (reaping it when it has ended)."""
    try:
        return os.waitpid(pid, os.WNOHANG) == (0, 0)
    except ChildProcessError:
        return False


def guard_driver(grace_s: float = 2.0, interval_s: float = 0.5, ready_timeout_s: float = 30.0) -> int | None:
    """Start this process's watchdog (once per process; Linux only) and mark the environment that
    everything it starts from now on inherits. Returns the watchdog's PID (None: no ``/proc``, no
    watchdog). Raises OSError when the watchdog did not come up.

    The watchdog is spawned without a ``subprocess.Popen`` handle: it outlives the driver by design,
    and a handle left at interpreter exit prints "ResourceWarning: subprocess N is still running"."""
    global _guard
    if not os.path.isdir("/proc/self/task"):
        return None
    me = os.getpid()
    if _guard is not None and _guard[0] == me and _running_child(_guard[1]):
        return _guard[1]
    start = start_time(me)
    if start is None:
        return None
    mark = f"{me}-{secrets.token_hex(8)}"
    env = {k: v for k, v in os.environ.items() if k != RUN_MARK_ENV}
    cmd = [sys.executable, "-I", os.path.abspath(__file__), "--pid", str(me), "--start", str(start)]
    cmd += ["--mark", mark, "--grace", str(grace_s), "--interval", str(interval_s)]
    r, w = os.pipe()  # both close-on-exec; dup2 onto the child's stdout clears that for fd 1 only
    devnull = os.open(os.devnull, os.O_RDONLY)
    try:
        actions = [(os.POSIX_SPAWN_DUP2, devnull, 0), (os.POSIX_SPAWN_DUP2, w, 1)]
        pid = os.posix_spawn(cmd[0], cmd, env, file_actions=actions, setsid=True)
    finally:
        os.close(w)
        os.close(devnull)
    ready = b""
    try:
        if select.select([r], [], [], ready_timeout_s)[0]:
            ready = os.read(r, len(READY))
    finally:
        os.close(r)
    if ready != READY:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        raise OSError(f"the run's watchdog did not start ({cmd[:3]}; wait status {status})")
    os.environ[RUN_MARK_ENV] = mark  # after its start: the watchdog itself carries no mark
    _guard = (me, pid)
    return pid


def watchdog_pid() -> int | None:
    """The PID of this process's running watchdog (it lives as long as the driver does), or None."""
    if _guard is not None and _guard[0] == os.getpid() and _running_child(_guard[1]):
        return _guard[1]
    return None


if __name__ == "__main__":
    sys.exit(_main())
