"""``kill -9`` of ``rollart train`` mid-run (a scheduler's preemption, the OOM killer): within 10 s no
process of the run is left (Ray's GCS, raylet, monitors, dashboard, its dashboard and runtime-env
agents, the workers, the engine's subprocesses), and ``loop.resume_from`` the newest checkpoint then
completes its steps. Before the driver's watchdog, the dashboard agent and the runtime-env agent of
the killed run were alive more than 20 s after the kill. Slow (two runs of the tiny model: 65 s on a quiet 2-core machine, 300 s beside a training run)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from rollart_core.watchdog import descendants, process_table, start_time

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.ray]
ROOT = Path(__file__).resolve().parents[2]


def _session(sid: int) -> dict[int, int]:
    """The live (not zombie) processes of session ``sid``: PID -> start time."""
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] not in (b"Z", b"X"):
                out[int(name)] = int(fields[19])
    return out


def _alive(procs: dict[int, int]) -> dict[int, int]:
    return {p: s for p, s in procs.items() if start_time(p) == s}


def _wait_for(what: str, cond: Callable[[], object], timeout: float, every: Callable[[], None]) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        every()
        time.sleep(0.2)


def _config(tmp_path: Path, steps: int, resume_from: Path | None = None) -> Path:
    cfg = yaml.safe_load((ROOT / "examples" / "frozenlake_tiny.yaml").read_text())
    cfg["model"]["path"] = str(tmp_path / "model")
    cfg["output_dir"] = str(tmp_path / "run")
    cfg["tasks"][0].update(group_size=4, groups_per_step=2)
    cfg["loop"].update(steps=steps, eval_every=0, save_every=1)
    if resume_from is not None:
        cfg["loop"]["resume_from"] = str(resume_from)
    path = tmp_path / f"cfg-{steps}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _start(cfg: Path, console: Path) -> subprocess.Popen[bytes]:
    with open(console, "w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "rollart_core.cli", "train", str(cfg)],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its session holds every process it starts but the setsid'd ones
        )


def _newest_checkpoint(run: Path) -> Path | None:
    found = sorted(run.glob("checkpoint-*"), key=lambda p: int(p.name.rsplit("-", 1)[1]))
    return found[-1] if found else None


def test_driver_sigkill_leaves_nothing_and_resume_completes(tmp_path: Path) -> None:
    run = tmp_path / "run"
    driver = _start(_config(tmp_path, steps=100_000), tmp_path / "console-1.txt")
    seen: dict[int, int] = {}  # every process of the run seen while it ran: PID -> start time

    def look() -> None:
        table = process_table()
        for pid in descendants({driver.pid}, table):
            seen.setdefault(pid, table[pid][1])
        for pid, start in _session(driver.pid).items():
            seen.setdefault(pid, start)

    resumed: subprocess.Popen[bytes] | None = None
    try:
        _wait_for(
            "checkpoint-2 of the first run",
            lambda: driver.poll() is not None or (run / "checkpoint-2").is_dir(),
            600,
            look,
        )
        assert driver.poll() is None, (tmp_path / "console-1.txt").read_text()[-3000:]
        look()
        assert len(_alive(seen)) > 5, seen  # Ray's processes, the engine, the watchdog: all seen
        driver.send_signal(signal.SIGKILL)
        t_kill = time.monotonic()
        driver.wait()
        left: dict[int, int] = {}
        while time.monotonic() - t_kill < 10 and (left := {**_alive(seen), **_session(driver.pid)}):
            time.sleep(0.1)
        gone_s = time.monotonic() - t_kill
        assert not left, f"alive {gone_s:.1f} s after the kill: " + "; ".join(
            f"{p} {Path(f'/proc/{p}/cmdline').read_bytes()[:100]!r}" for p in left if start_time(p)
        )

        ckpt = _newest_checkpoint(run)
        assert ckpt is not None
        done = int(ckpt.name.rsplit("-", 1)[1])
        resumed = _start(_config(tmp_path, steps=done + 2, resume_from=ckpt), tmp_path / "console-2.txt")
        rc = resumed.wait(timeout=600)
        out = (tmp_path / "console-2.txt").read_text()
        assert rc == 0, out[-3000:]
        summary = json.loads((run / "summary.json").read_text())
        assert summary["outcome"] == "completed" and summary["completed"] is True, summary
        assert summary["final_version"] == done + 2, summary  # the steps continued from the checkpoint
        assert sum(summary["fates"].values()) == summary["launched"], summary
        assert (run / f"checkpoint-{done + 2}").is_dir()
        deadline = time.monotonic() + 10  # the resumed run, ended normally, leaves nothing either
        while _session(resumed.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _session(resumed.pid)
    finally:
        for pid, start in {**seen, **_session(driver.pid)}.items():  # only what this test started
            if start_time(pid) == start:
                os.kill(pid, signal.SIGKILL)
        for proc in (driver, resumed):
            if proc is not None and proc.poll() is None:
                for pid in _session(proc.pid):
                    os.kill(pid, signal.SIGKILL)
                proc.wait()
