"""The driver's watchdog: whatever a driver started dies with it, however the driver dies, and nothing
else is touched. Real processes (a driver script, its children), no Ray: a few seconds each."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollart_core.watchdog import RUN_MARK_ENV, descendants, process_table, start_time

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")

DRIVER = r"""
import json, os, subprocess, sys, time
from rollart_core.watchdog import guard_driver

interval, end = float(sys.argv[1]), sys.argv[2]
watchdog = guard_driver(grace_s=1.0, interval_s=interval)
assert guard_driver() == watchdog  # once per process
py = sys.executable
ignores_term = subprocess.Popen(
    [py, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); time.sleep(300)"],
    stdout=subprocess.PIPE,
)
ignores_term.stdout.readline()
own_session = subprocess.Popen(["sleep", "300"], start_new_session=True)
# its parent exits at once: the orphan is reparented away from the driver and keeps running
middle = subprocess.Popen(
    [py, "-c", "import subprocess; print(subprocess.Popen(['sleep', '300']).pid, flush=True)"],
    stdout=subprocess.PIPE,
)
orphan = int(middle.stdout.readline())
middle.wait()
pids = [ignores_term.pid, own_session.pid, orphan]
print(json.dumps({"watchdog": watchdog, "pids": pids}), flush=True)
if end == "exit":
    sys.stdin.readline()  # once the test has noted what runs (a loaded host is slow to look)
    os._exit(0)  # a driver that ends without stopping what it started
time.sleep(300)
"""


def _wait_gone(procs: dict[int, int], timeout: float) -> float:
    """Seconds until none of ``procs`` (PID -> start time) is alive; raises after ``timeout``."""
    t0 = time.monotonic()
    while True:
        alive = {p: s for p, s in procs.items() if start_time(p) == s}
        if not alive:
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"still alive after {timeout:.0f} s: {sorted(alive)}")
        time.sleep(0.05)


def _kill(procs: dict[int, int]) -> None:
    for pid, start in procs.items():  # processes this test started (through its driver)
        if start_time(pid) == start:
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize(
    ("interval", "end"),
    [
        (0.1, "sigkill"),  # sampled: every process seen in the tree before the kill
        (60.0, "sigkill"),  # nothing sampled after the start: the run's mark finds them
        (0.1, "exit"),  # a driver that exits without cleaning up is gone all the same
    ],
)
def test_everything_the_driver_started_dies_with_it(tmp_path: Path, interval: float, end: str) -> None:
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    env = {**os.environ, RUN_MARK_ENV: "someone-else"}
    driver = subprocess.Popen(
        [sys.executable, str(script), str(interval), end],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    # a stranger: started beside the run, with another run's mark; it must outlive the driver
    stranger = subprocess.Popen(["sleep", "300"], env=env)
    started: dict[int, int] = {}
    try:
        assert driver.stdout is not None
        line = driver.stdout.readline()
        assert line, f"the driver failed (exit {driver.wait()})"
        info = json.loads(line)
        for pid in [info["watchdog"], *info["pids"]]:
            start = start_time(pid)
            assert start is not None, pid
            started[pid] = start
        if end == "sigkill":
            assert info["watchdog"] in descendants({driver.pid}, process_table())
            driver.send_signal(signal.SIGKILL)
        else:
            assert driver.stdin is not None
            driver.stdin.write("exit now\n")
            driver.stdin.flush()
        driver.wait(timeout=30)
        took = _wait_gone(started, timeout=10)  # the watchdog included: it exits after its sweep
        assert took < 10
        assert stranger.poll() is None  # only the run's own processes
    finally:
        _kill(started)
        if driver.poll() is None:
            driver.kill()
            driver.wait()
        stranger.kill()
        stranger.wait()


def test_descendants_follow_the_tree() -> None:
    table = {1: (0, 1), 10: (1, 5), 11: (10, 6), 12: (11, 7), 20: (1, 8)}
    assert descendants({10}, table) == {11, 12}
    assert descendants({10, 11}, table) == {12}
    assert descendants({99}, table) == set()
