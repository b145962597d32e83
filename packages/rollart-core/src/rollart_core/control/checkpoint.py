"""Checkpoints of a whole run: the trainer's (weights, optimizer, version), the loop's step, the
rollout's group counter (new groups never reuse an id or a seed), the fate ledger and the
SampleBuffer's content.

A checkpoint directory is written under a temporary name, fsynced, and renamed as one unit: a
crash leaves either the whole checkpoint or none. Trajectories still in flight at save time cannot
be saved: they are counted, and a run resumed from the checkpoint books them as
``cancelled_at_stop`` (their groups are relaunched by admission as usual), so launched and fates
still add up across the resume.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from rollart_core.errors import ConfigError
from rollart_core.protocols import SupportsResume, SupportsWeightPush

if TYPE_CHECKING:
    from rollart_core.control.pipeline import Pipeline
    from rollart_core.control.steps import Run

__all__ = ["resume", "save_checkpoint", "set_aside_earlier_run"]
STATE_FILE = "rollart_state.json"


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for f in files:
            with open(os.path.join(dirpath, f), "rb") as fh:
                os.fsync(fh.fileno())
        fd = os.open(dirpath, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


async def save_checkpoint(p: Pipeline, run: Run, step: int, path: Path) -> None:
    ro, rs = run.rollout, run.state
    tmp = path.with_name(f".{path.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    await asyncio.to_thread(p.trainer.save, str(tmp))
    state = {
        "step": step,
        "version": p.trainer.version,
        "groups_launched": ro.groups_launched,
        "launched": rs.launched,
        "fates": dict(rs.fates),
        "inflight": len(ro.inflight),
        "buffer": rs.buffer.state_dict(),
    }
    (tmp / STATE_FILE).write_text(json.dumps(state))
    await asyncio.to_thread(_fsync_tree, tmp)
    if path.exists():
        shutil.rmtree(path)
    tmp.rename(path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


async def resume(p: Pipeline, run: Run, path: Path) -> int:
    """Restore a run saved by :func:`save_checkpoint`; the engines load its weights. Returns the
    next step number."""
    state_file = path / STATE_FILE
    if not state_file.is_file():
        raise ConfigError(f"loop.resume_from: {path} is not a rollart checkpoint (no {STATE_FILE})")
    if not isinstance(p.trainer, SupportsResume):
        raise ConfigError(f"loop.resume_from: trainer {type(p.trainer).__name__} cannot resume")
    state = json.loads(state_file.read_text())
    await asyncio.to_thread(p.trainer.load, str(path))
    if p.trainer.version != state["version"]:
        raise ConfigError(
            f"{path}: trainer state says version {p.trainer.version}, run state {state['version']}"
        )
    run.state.restore(
        state["buffer"], state.get("fates", {}), state.get("launched", 0), state.get("inflight", 0)
    )
    run.rollout.groups_launched = state["groups_launched"]
    version = p.trainer.version
    if isinstance(p.trainer, SupportsWeightPush):
        await asyncio.to_thread(p.trainer.push_weights, version)
    else:
        await asyncio.wrap_future(p.store.push(version, dict(p.trainer.named_weights())))
    await p.proxy.update_weights(version)
    run.state.resume_at(version)
    return int(state["step"]) + 1


# What makes a directory an earlier run's (its logs alone do not: the CLI opens them first)
_RUN_MARKERS = ("metrics.jsonl", "summary.json", "weights", "tensorboard", "checkpoint-*")


def set_aside_earlier_run(output_dir: Path, resume_from: Path | None) -> Path | None:
    """A new run (no ``resume_from``) in a directory that holds an earlier run moves that run to
    ``OUTPUT_DIR.YYYYmmdd-HHMMSS`` (its last write) and returns where; nothing is deleted, and the
    new run starts clean: its metrics, report, weight versions and restart checkpoints are its own
    (an earlier run's ``checkpoint-50`` would otherwise be the "newest checkpoint" a trainer restart
    loads). A resumed run keeps its directory."""
    if resume_from is not None or not output_dir.is_dir():
        return None
    found = [p for m in _RUN_MARKERS for p in output_dir.glob(m)]
    if not found:
        return None
    import time

    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(max(p.stat().st_mtime for p in found)))
    dest = output_dir.with_name(f"{output_dir.name}.{stamp}")
    n = 1
    while dest.exists():
        n += 1
        dest = output_dir.with_name(f"{output_dir.name}.{stamp}-{n}")
    os.replace(output_dir, dest)
    return dest
