"""Turn a rollart checkpoint into a plain Hugging Face model directory (``rollart export CKPT --hf OUT``).

A checkpoint written by :meth:`rollart_train.torch_rank.TorchRankWorker.save` (and the run's
``checkpoint-N`` directories) already holds the model as a Hugging Face directory: ``config.json``,
``*.safetensors`` (and their index when sharded), the tokenizer files and the chat template. Besides
them it holds what only rollart reads: the optimiser and RNG state (``trainer_state.pt``) and the
trainer's / run's counters (``rollart_trainer.json``, ``rollart_checkpoint.json``, ...). The export
copies only the model files, so ``transformers.AutoModelForCausalLM.from_pretrained(OUT)`` and
``vllm.LLM(OUT)`` load it, and nothing private leaks into a model that is shared.

A checkpoint of LoRA training (trainer ``lora:``) holds the frozen base model at its root and the
trained adapters in ``adapter/`` (PEFT format: ``lora_B`` unscaled, ``lora_alpha`` in the config).
Copying the root alone would export the untrained base model, so the export merges the adapters
into the base weights, ``W + (alpha / r) · B @ A`` (what :class:`rollart_train.lora.LoraLinear`
computes), in float32 and cast back to the weight's dtype: the result is a plain model that loads
without PEFT or LoRA support. With ``adapter_only`` it writes the PEFT adapter directory instead
(``adapter_config.json`` + ``adapter_model.safetensors``, for ``vllm``'s ``LoRARequest`` or PEFT).
When the root has no base weights, the base is read from the adapter's ``base_model_name_or_path``.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollart_core.errors import ConfigError
from rollart_train._checkpoint import ADAPTER_DIR, STATE_FILE

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

_INDEX = "model.safetensors.index.json"
# the names of rollart_train.lora's PEFT files, repeated so that this module imports no torch
_PEFT_PREFIX = "base_model.model."
_ADAPTER_CONFIG = "adapter_config.json"
_ADAPTER_WEIGHTS = "adapter_model.safetensors"


def _weights(d: Path) -> list[Path]:
    """``d``'s safetensors files; ConfigError when its index names a shard that is not there."""
    index = d / _INDEX
    if index.is_file():  # sharded: every shard the index names must be there
        names = set(json.loads(index.read_text()).get("weight_map", {}).values())
        absent = sorted(n for n in names if not (d / n).is_file())
        if absent:
            raise ConfigError(f"{d}: incomplete checkpoint, shards missing: {', '.join(absent)}")
    return sorted(d.glob("*.safetensors"))


def _check(ckpt: Path) -> list[Path]:
    if not ckpt.is_dir():
        raise ConfigError(f"{ckpt}: not a checkpoint directory (no such directory)")
    missing = [f for f in ("config.json", "tokenizer.json") if not (ckpt / f).is_file()]
    weights = _weights(ckpt)
    if not weights:
        missing.append("*.safetensors")
    if missing:
        raise ConfigError(
            f"{ckpt}: not a checkpoint (missing {', '.join(missing)}); give a directory written by "
            "the trainer, e.g. RUN_DIR/checkpoint-N"
        )
    return weights


def _adapter_dir(ckpt: Path) -> Path | None:
    """``ckpt/adapter`` for a checkpoint of LoRA training, None for full fine-tuning; ConfigError for a
    LoRA checkpoint whose adapter files are incomplete."""
    adapter = ckpt / ADAPTER_DIR
    state_file = ckpt / STATE_FILE
    trained_lora = state_file.is_file() and json.loads(state_file.read_text()).get("lora") is not None
    if not adapter.exists() and not trained_lora:
        return None
    absent = [f for f in (_ADAPTER_CONFIG, _ADAPTER_WEIGHTS) if not (adapter / f).is_file()]
    if absent:
        raise ConfigError(
            f"{adapter}: a checkpoint of LoRA training without its adapters (missing {', '.join(absent)})"
        )
    return adapter


def _base_dir(ckpt: Path, adapter_cfg: dict[str, Any]) -> Path:
    """Where the base weights of a LoRA checkpoint are: its root (what the trainer writes), else the
    adapter's ``base_model_name_or_path``; ConfigError naming that path when it is no model."""
    if ckpt.is_dir() and _weights(ckpt):
        return ckpt
    named = str(adapter_cfg.get("base_model_name_or_path") or "")
    # the trainer writes the model path it was given: relative to where it ran, or to the checkpoint
    found = [p.resolve() for p in (Path(named), ckpt / named) if named and p.is_dir()]
    base = found[0] if found else None
    if base is None or not (base / "config.json").is_file() or not _weights(base):
        raise ConfigError(
            f"{ckpt}: a LoRA checkpoint without base weights (*.safetensors), and its base model "
            f"{named or '(adapter_config.json names none)'} is missing or not a Hugging Face model "
            "directory: point base_model_name_or_path in "
            f"{ckpt / ADAPTER_DIR / _ADAPTER_CONFIG} at the model the adapters were trained on"
        )
    return base


def _lora_scale(adapter_cfg: dict[str, Any], where: Path) -> float:
    if adapter_cfg.get("peft_type", "LORA") != "LORA" or adapter_cfg.get("use_dora"):
        raise ConfigError(f"{where}: only plain LoRA adapters can be merged (peft_type LORA, no DoRA)")
    rank, alpha = float(adapter_cfg["r"]), float(adapter_cfg["lora_alpha"])
    return alpha / math.sqrt(rank) if adapter_cfg.get("use_rslora") else alpha / rank


def _merge_shards(base: Path, adapter: Path, out: Path) -> None:
    """Write ``base``'s safetensors files into ``out`` with each adapted weight replaced by
    ``W + scale · B @ A``. ConfigError when an adapter's weight is not in the base or has another shape."""
    import torch
    from safetensors.torch import load_file, save_file

    cfg = json.loads((adapter / _ADAPTER_CONFIG).read_text())
    scale = _lora_scale(cfg, adapter / _ADAPTER_CONFIG)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in load_file(str(adapter / _ADAPTER_WEIGHTS)).items():
        module, _, part = name.removeprefix(_PEFT_PREFIX).rpartition(".lora_")
        if part not in ("A.weight", "B.weight"):
            raise ConfigError(f"{adapter / _ADAPTER_WEIGHTS}: {name} is not a LoRA A/B weight")
        pairs.setdefault(f"{module}.weight", {})[part[0]] = t
    for key, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise ConfigError(f"{adapter / _ADAPTER_WEIGHTS}: {key} has lora_{''.join(ab)} alone")
    merged: set[str] = set()
    for shard in _weights(base):
        tensors = load_file(str(shard))
        for key in pairs.keys() & tensors.keys():
            w, a, b = tensors[key], pairs[key]["A"], pairs[key]["B"]
            if (b.shape[0], a.shape[1]) != tuple(w.shape) or a.shape[0] != b.shape[1]:
                raise ConfigError(
                    f"{adapter}: {key} is {tuple(w.shape)} in {shard}, but its adapter is "
                    f"B {tuple(b.shape)} @ A {tuple(a.shape)}: adapters of another base model?"
                )
            delta = (b.to(torch.float32) @ a.to(torch.float32)) * scale
            tensors[key] = (w.to(torch.float32) + delta).to(w.dtype).contiguous()
            merged.add(key)
        save_file(tensors, str(out / shard.name), metadata={"format": "pt"})
    if absent := sorted(pairs.keys() - merged):
        raise ConfigError(
            f"{adapter}: adapters for weights the base model {base} lacks: {', '.join(absent[:4])}"
        )


def _copy_side_files(dirs: list[Path], out: Path) -> None:
    """The non-weight model files but the shard index, from the first of ``dirs`` that has each."""
    for name in MODEL_FILES:
        if name == _INDEX:
            continue
        src = next((d / name for d in dirs if (d / name).is_file()), None)
        if src is not None:
            shutil.copy2(src, out / name)


def _write(out: Path, overwrite: bool, fill: Callable[[Path], None]) -> Path:
    """Run ``fill`` on a new directory beside ``out`` and rename it to ``out``, so that a failed
    export leaves nothing half-written."""
    if out.exists() and not overwrite:
        raise ConfigError(f"{out}: already exists (--force replaces it)")
    tmp = out.with_name(f".{out.name}.export-tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        fill(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def export_hf(
    checkpoint: str | Path, out_dir: str | Path, *, overwrite: bool = False, adapter_only: bool = False
) -> Path:
    """Write the model of ``checkpoint`` into ``out_dir`` as a Hugging Face directory; for a
    checkpoint of LoRA training, the base model with the adapters merged in (or, with
    ``adapter_only``, the PEFT adapter directory alone). Returns ``out_dir``.

    :class:`ConfigError` for a path that is not a checkpoint, a LoRA checkpoint whose adapters or
    base model are missing, ``adapter_only`` on a checkpoint of full fine-tuning, or an ``out_dir``
    that exists (unless ``overwrite``)."""
    ckpt, out = Path(checkpoint).resolve(), Path(out_dir).resolve()
    if out == ckpt:
        raise ConfigError(f"{out}: the export directory must differ from the checkpoint")
    adapter = _adapter_dir(ckpt) if ckpt.is_dir() else None
    if adapter is None:
        if adapter_only:
            if not ckpt.is_dir():
                raise ConfigError(f"{ckpt}: not a checkpoint directory (no such directory)")
            raise ConfigError(
                f"{ckpt}: --adapter-only needs a checkpoint of LoRA training (trainer lora:), "
                f"and this one has no {ADAPTER_DIR}/: it is a full fine-tuned model, export it without"
            )
        weights = _check(ckpt)

        def copy(tmp: Path) -> None:
            for f in [*weights, *(ckpt / n for n in MODEL_FILES)]:
                if f.is_file():
                    shutil.copy2(f, tmp / f.name)

        return _write(out, overwrite, copy)

    if adapter_only:

        def copy_adapter(tmp: Path) -> None:
            for name in (_ADAPTER_CONFIG, _ADAPTER_WEIGHTS):
                shutil.copy2(adapter / name, tmp / name)

        return _write(out, overwrite, copy_adapter)
    adapter_cfg = json.loads((adapter / _ADAPTER_CONFIG).read_text())
    base = _base_dir(ckpt, adapter_cfg)

    def merge(tmp: Path) -> None:
        _merge_shards(base, adapter, tmp)
        _copy_side_files([ckpt, base], tmp)
        if (base / _INDEX).is_file():  # the shards are the base's: so is their index
            shutil.copy2(base / _INDEX, tmp / _INDEX)

    return _write(out, overwrite, merge)
