"""Turn a rollart checkpoint into a plain Hugging Face model directory (``rollart export CKPT --hf OUT``).

A checkpoint written by :meth:`rollart_train.torch_rank.TorchRankWorker.save` (and the run's
``checkpoint-N`` directories) already holds the model as a Hugging Face directory: ``config.json``,
``*.safetensors`` (and their index when sharded), the tokenizer files and the chat template. Besides
them it holds what only rollart reads: the optimiser and RNG state (``trainer_state.pt``) and the
trainer's / run's counters (``rollart_trainer.json``, ``rollart_checkpoint.json``, ...). The export
copies only the model files, so ``transformers.AutoModelForCausalLM.from_pretrained(OUT)`` and
``vllm.LLM(OUT)`` load it, and nothing private leaks into a model that is shared.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from rollart_core.errors import ConfigError

__all__ = ["MODEL_FILES", "export_hf"]

MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "model.safetensors.index.json",
)
"""Files of a Hugging Face model directory that are copied when present (plus every ``*.safetensors``)."""


def _check(ckpt: Path) -> list[Path]:
    if not ckpt.is_dir():
        raise ConfigError(f"{ckpt}: not a checkpoint directory (no such directory)")
    missing = [f for f in ("config.json", "tokenizer.json") if not (ckpt / f).is_file()]
    weights = sorted(ckpt.glob("*.safetensors"))
    if not weights:
        missing.append("*.safetensors")
    if missing:
        raise ConfigError(
            f"{ckpt}: not a checkpoint (missing {', '.join(missing)}); give a directory written by "
            "the trainer, e.g. RUN_DIR/checkpoint-N"
        )
    index = ckpt / "model.safetensors.index.json"
    if index.is_file():  # sharded: every shard the index names must be there
        names = set(json.loads(index.read_text()).get("weight_map", {}).values())
        absent = sorted(n for n in names if not (ckpt / n).is_file())
        if absent:
            raise ConfigError(f"{ckpt}: incomplete checkpoint, shards missing: {', '.join(absent)}")
    return weights


def export_hf(checkpoint: str | Path, out_dir: str | Path, *, overwrite: bool = False) -> Path:
    """Copy the model files of ``checkpoint`` into ``out_dir`` (a new directory, written beside it
    and renamed, so a failed export leaves nothing half-written). Returns ``out_dir``.

    :class:`ConfigError` for a path that is not a checkpoint, or an ``out_dir`` that exists
    (unless ``overwrite``)."""
    ckpt, out = Path(checkpoint).resolve(), Path(out_dir).resolve()
    weights = _check(ckpt)
    if out == ckpt:
        raise ConfigError(f"{out}: the export directory must differ from the checkpoint")
    if out.exists() and not overwrite:
        raise ConfigError(f"{out}: already exists (--force replaces it)")
    tmp = out.with_name(f".{out.name}.export-tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        for f in [*weights, *(ckpt / n for n in MODEL_FILES)]:
            if f.is_file():
                shutil.copy2(f, tmp / f.name)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
