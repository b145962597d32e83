"""Checkpoint directory layout shared by the torch and Megatron ranks (no torch import here).

A checkpoint is a Hugging Face directory (safetensors + config + tokenizer files) plus the trainer's own
files and ``rollart_trainer.json`` (version, counters, the caller's ``extra``). It is written into a
sibling staging directory and renamed into place, the state file last, so a crash never leaves a
directory that :func:`find_checkpoint` would take for a checkpoint.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from rollart_core.errors import TrainerError

__all__ = [
    "ADAPTER_DIR",
    "STATE_FILE",
    "commit",
    "copy_model_files",
    "find_checkpoint",
    "read_state",
    "staging_dir",
]

STATE_FILE = "rollart_trainer.json"
ADAPTER_DIR = "adapter"
"""A LoRA checkpoint's adapters (a PEFT adapter directory); the root holds the frozen base model."""
MODEL_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
)


def find_checkpoint(path: str | Path) -> Path:
    """``path`` if it is a checkpoint, else its newest ``checkpoint-<n>`` child; TrainerError if none."""
    p = Path(path)
    if (p / STATE_FILE).is_file():
        return p
    found = [
        (int(c.name.rsplit("-", 1)[1]), c)
        for c in p.glob("checkpoint-*")
        if c.name.rsplit("-", 1)[1].isdigit() and (c / STATE_FILE).is_file()
    ]
    if not found:
        raise TrainerError(
            f"no trainer checkpoint at {p} (expected {STATE_FILE} or checkpoint-<step>/ inside)"
        )
    return max(found)[1]


def read_state(ckpt: Path) -> dict[str, Any]:
    state: dict[str, Any] = json.loads((ckpt / STATE_FILE).read_text())
    return state


def staging_dir(out: Path) -> Path:
    """Where the checkpoint for ``out`` is written before :func:`commit`: one name, so that several
    ranks can write their parts into it."""
    return out.with_name(f".{out.name}.tmp")


def copy_model_files(src: Path, dst: Path, skip: tuple[str, ...] = ()) -> None:
    """The Hugging Face side files (config, tokenizer, chat template) that ``src`` has."""
    for f in MODEL_FILES:
        if f not in skip and (src / f).is_file():
            shutil.copy(src / f, dst / f)


def commit(tmp: Path, out: Path, state: dict[str, Any]) -> None:
    """Write the state file into ``tmp`` and move it to ``out`` (replacing an older one)."""
    (tmp / STATE_FILE).write_text(json.dumps(state, indent=1))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
