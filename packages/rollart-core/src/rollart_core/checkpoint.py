"""Checkpoints of a whole run: the trainer's (weights, optimizer, version), the loop's step, the
rollout's group counter (new groups never reuse an id or a seed) and the SampleBuffer's content."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import TYPE_CHECKING

from rollart_core.errors import ConfigError
from rollart_core.protocols import SupportsResume

if TYPE_CHECKING:
    from rollart_core.pipeline import Pipeline
    from rollart_core.rollout import Rollout

__all__ = ["resume", "save_checkpoint"]
STATE_FILE = "rollart_state.json"


async def save_checkpoint(p: Pipeline, ro: Rollout, step: int, path: Path) -> None:
    await asyncio.to_thread(p.trainer.save, str(path))
    state = {"step": step, "version": p.trainer.version, "groups_launched": ro.groups_launched,
             "buffer": p.buffer.state_dict()}
    tmp = path / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(state))
    tmp.replace(path / STATE_FILE)


async def resume(p: Pipeline, ro: Rollout, path: Path) -> int:
    """Restore a run saved by :func:`save_checkpoint`; the engines load its weights. Returns the
    next step number."""
    state_file = path / STATE_FILE
    if not state_file.is_file():
        raise ConfigError(f"train.resume_from: {path} is not a rollart checkpoint (no {STATE_FILE})")
    if not isinstance(p.trainer, SupportsResume):
        raise ConfigError(f"train.resume_from: trainer {type(p.trainer).__name__} cannot resume")
    state = json.loads(state_file.read_text())
    await asyncio.to_thread(p.trainer.load, str(path))
    if p.trainer.version != state["version"]:
        raise ConfigError(f"{path}: trainer state says version {p.trainer.version}, run state {state['version']}")
    p.buffer.load_state_dict(state["buffer"])
    ro.groups_launched = state["groups_launched"]
    await asyncio.wrap_future(p.store.push(p.trainer.version, dict(p.trainer.named_weights())))
    await p.proxy.update_weights(p.trainer.version)
    ro.served_version = p.trainer.version
    return int(state["step"]) + 1
