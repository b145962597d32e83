"""SIGTERM (a scheduler's, ``timeout``'s, ``kill``'s) stops ``rollart train`` as Ctrl-C does: the run's
stages shut down, its report, timeline and summary (the steps it made, every launched trajectory's
fate) are written, it exits 143, and no process it started is left. Before, Ray's own SIGTERM
handler aborted the driver and left Ray's agents behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.vllm, pytest.mark.ray]
ROOT = Path(__file__).resolve().parents[2]


def _session(sid: int) -> list[int]:
    """PIDs of the live (not zombie) processes of session ``sid``."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != b"Z":
            pids.append(int(entry))
    return pids


def _wait_for(what: str, cond: object, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.2)


def test_sigterm_stops_the_run_cleanly(tmp_path: Path) -> None:
    cfg = yaml.safe_load((ROOT / "examples" / "frozenlake_tiny.yaml").read_text())
    cfg["model"]["path"] = str(tmp_path / "model")
    cfg["output_dir"] = str(tmp_path / "run")
    cfg["tasks"][0].update(group_size=4, groups_per_step=2)
    cfg["loop"].update(steps=100_000, eval_every=0, save_every=0)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    metrics = tmp_path / "run" / "metrics.jsonl"
    with open(tmp_path / "console.txt", "w") as console:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rollart_core.cli", "train", str(path)],
            stdout=console,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its session holds every process it starts (Ray's too)
        )
    try:
        _wait_for(
            "the first step",
            lambda: proc.poll() is not None or (metrics.exists() and metrics.read_text().strip()),
            600,
        )
        assert proc.poll() is None, (tmp_path / "console.txt").read_text()[-3000:]
        assert len(_session(proc.pid)) > 3  # Ray's processes, the engine, the trainer: all in it

        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=180)

        out = (tmp_path / "console.txt").read_text()
        assert rc == 143, out[-3000:]
        assert "SIGTERM received" not in out  # Ray's abort handler did not run
        assert (tmp_path / "run" / "report.html").is_file() and (tmp_path / "run" / "timeline.json").is_file()
        # what the stopped run did: its steps and the fate of every trajectory it launched
        summary = json.loads((tmp_path / "run" / "summary.json").read_text())
        assert summary["outcome"] == "terminated (SIGTERM)" and summary["completed"] is False, summary
        assert summary["steps"] >= 1 and summary["launched"] >= 8, summary
        assert sum(summary["fates"].values()) == summary["launched"], summary
        assert summary["fates"].get("cancelled_at_stop", 0) < summary["launched"], summary
        _wait_for(
            f"the run's processes to exit (left: {_session(proc.pid)})", lambda: not _session(proc.pid), 60
        )
    finally:
        for pid in _session(proc.pid):  # only what this test started: its own session
            os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
