"""Run checkpoints on the in-process fakes (conftest.py): a save that dies half-way leaves the previous
checkpoint whole and no ``checkpoint-N`` of the failed step, and the run resumes from the previous one;
a resumed run rewrites ``metrics.jsonl`` (the real file the default sinks write) from the resumed
step on, so every step appears once. The real trainer's own checkpoints: rollart-train's tests."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import ModuleType

import pytest

from rollart_core.control import checkpoint
from rollart_core.control.train import train
from rollart_core.metrics import MemorySink


class _Crash(Exception):
    """Stands in for the process dying in the middle of a save."""


def _steps_in(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def _assert_whole(ckpt: Path, step: int) -> None:
    state = json.loads((ckpt / checkpoint.STATE_FILE).read_text())
    assert state["step"] == state["version"] == step
    assert (ckpt / "fake_trainer.txt").read_text() == str(step)


@pytest.mark.parametrize("where", ["trainer_save", "before_rename"])
async def test_a_save_that_dies_midway_leaves_the_previous_checkpoint_resumable(
    fakes: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    cfg = fakes.fake_config(tmp_path, mode="async", alpha=1, steps=4, save_every=1)
    p = fakes.FakePipeline(cfg, fakes.Script())
    if where == "trainer_save":  # the trainer wrote part of its files, then died
        real_save = p.trainer.save

        def save(path: str) -> None:
            real_save(path)
            if p.trainer.version == 2:
                (Path(path) / "optimizer.pt").write_bytes(b"\0" * 100)
                raise _Crash("died in the trainer's save")

        p.trainer.save = save
    else:  # everything written, the process dies before the directory is renamed into place
        real_fsync = checkpoint._fsync_tree

        def fsync(root: Path) -> None:
            real_fsync(root)
            if json.loads((root / checkpoint.STATE_FILE).read_text())["step"] == 2:
                raise _Crash("died before the rename")

        monkeypatch.setattr(checkpoint, "_fsync_tree", fsync)
    with pytest.raises(_Crash):
        await asyncio.wait_for(train(cfg, sink=MemorySink(), pipeline=p), 30)  # type: ignore[arg-type]

    run_dir = cfg.output_dir
    assert sorted(d.name for d in run_dir.iterdir() if d.name.startswith("checkpoint-")) == ["checkpoint-1"]
    _assert_whole(run_dir / "checkpoint-1", 1)
    # what the failed save left lies under a name that no resume or "newest checkpoint" search picks
    assert [d.name for d in run_dir.iterdir() if d.name.endswith(".tmp")] == [".checkpoint-2.tmp"]

    monkeypatch.undo()  # a new process: saves work again
    cfg2 = cfg.model_copy(deep=True)
    cfg2.loop.resume_from = run_dir / "checkpoint-1"
    p2 = fakes.FakePipeline(cfg2, fakes.Script())
    summary = await asyncio.wait_for(train(cfg2, sink=MemorySink(), pipeline=p2), 30)  # type: ignore[arg-type]
    assert [h["version"] for h in summary["history"]] == [2, 3, 4]  # steps and versions continue
    assert summary["launched"] == sum(summary["fates"].values())
    for step in (2, 3, 4):  # the resumed run's own saves replaced the leftover and went on
        _assert_whole(run_dir / f"checkpoint-{step}", step)
    assert not [d for d in run_dir.iterdir() if d.name.endswith(".tmp")]


def test_a_killed_saving_process_leaves_no_partial_checkpoint(fakes: ModuleType, tmp_path: Path) -> None:
    """The same with a real crash: a process saving step 2 is SIGKILLed while the trainer writes."""
    ready = tmp_path / "writing"
    script = textwrap.dedent(
        f"""
        import asyncio, sys, time
        from pathlib import Path
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import conftest as fakes
        from rollart_core.control.train import train
        from rollart_core.metrics import MemorySink

        cfg = fakes.fake_config(Path({str(tmp_path)!r}), mode="sync", steps=3, save_every=1)
        p = fakes.FakePipeline(cfg, fakes.Script())
        real_save = p.trainer.save

        def save(path):
            real_save(path)
            if p.trainer.version == 2:
                Path({str(ready)!r}).write_text(path)
                time.sleep(600)  # killed here, half-way through the save

        p.trainer.save = save
        asyncio.run(train(cfg, sink=MemorySink(), pipeline=p))
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)  # until the save has begun
        assert ready.exists(), f"the saving process ended early (rc {proc.poll()})"
    finally:
        os.kill(proc.pid, signal.SIGKILL)  # the process this test started
        proc.wait(30)
    run_dir = tmp_path / "run"
    assert sorted(d.name for d in run_dir.iterdir() if d.name.startswith("checkpoint-")) == ["checkpoint-1"]
    _assert_whole(run_dir / "checkpoint-1", 1)
    assert Path(ready.read_text()).name == ".checkpoint-2.tmp"


async def test_resume_rewrites_metrics_jsonl_from_the_resumed_step(fakes: ModuleType, tmp_path: Path) -> None:
    cfg = fakes.fake_config(tmp_path, mode="async", alpha=1, steps=3, save_every=2)
    first = await asyncio.wait_for(train(cfg, pipeline=fakes.FakePipeline(cfg, fakes.Script())), 30)  # type: ignore[arg-type]
    metrics = cfg.output_dir / "metrics.jsonl"
    assert first["steps"] == 3 and _steps_in(metrics) == [1, 2, 3]
    old_rows = metrics.read_text().splitlines()
    with metrics.open("a") as f:
        f.write('{"step": 4, "loss": 0.')  # a torn last line, as a crash mid-write leaves it

    cfg2 = cfg.model_copy(deep=True)
    cfg2.loop.steps, cfg2.loop.resume_from = 5, cfg.output_dir / "checkpoint-2"
    second = await asyncio.wait_for(train(cfg2, pipeline=fakes.FakePipeline(cfg2, fakes.Script())), 30)  # type: ignore[arg-type]
    assert [h["version"] for h in second["history"]] == [3, 4, 5]
    rows = metrics.read_text().splitlines()
    assert _steps_in(metrics) == [1, 2, 3, 4, 5]  # each step once: the first run's step 3 was dropped
    assert rows[:2] == old_rows[:2]  # the steps before the checkpoint are kept as written
    # and step 3's row is the resumed run's
    assert json.loads(rows[2]) == json.loads(json.dumps({"step": 3, **second["history"][0]}, default=str))
