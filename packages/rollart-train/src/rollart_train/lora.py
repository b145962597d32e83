"""LoRA adapters for the torch trainer, written here rather than taken from ``peft`` (one small layer;
no extra dependency in the lock).

:func:`apply_lora` turns each targeted ``nn.Linear`` into a :class:`LoraLinear`: the same module with
the same base parameters (so their names stay ``…q_proj.weight``) plus ``lora_A`` (kaiming-initialised)
and ``lora_B`` (zeros), so that the model at step 0 computes exactly what the base model does. Every
base parameter is frozen; only the adapters get gradients and optimiser state.

Names follow PEFT's on-disk format, which vLLM (and PEFT itself) load:

- adapter tensors: ``base_model.model.<module path>.lora_A.weight`` (``[r, in]``) and ``….lora_B.weight``
  (``[out, r]``);
- ``adapter_config.json``: ``r``, ``lora_alpha``, ``target_modules``, ``base_model_name_or_path``.

What goes to the weight store (:func:`served_adapter`) is the adapter tensors alone, with the scale
``alpha / r`` folded into ``lora_B``: the tensors then describe the adapter completely (rank from
``lora_A``'s shape, target modules from the names, ``lora_alpha = r``), so a store that carries only
named tensors carries an adapter, and an engine rebuilds the directory from them
(:func:`adapter_files` is the trainer-side writer of the same format, used for checkpoints).
With ``serve: merged`` the store carries :func:`merged_weights` instead: the whole model in HF naming
with every adapter folded into its base weight, which any engine loads as full weights.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rollart_core.errors import ConfigError
from rollart_train.torch_config import LoraConfig

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "PEFT_PREFIX",
    "LoraLinear",
    "adapter_config",
    "adapter_state",
    "apply_lora",
    "is_lora_name",
    "linear_module_names",
    "load_adapter_files",
    "merged_weights",
    "save_adapter_files",
    "served_adapter",
]

PEFT_PREFIX = "base_model.model."
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
_UNSUPPORTED = ("lm_head",)
"""Linear modules that are never adapted: vLLM serves no LoRA on the output head (and a tied head
shares its weight with the embedding)."""


class LoraLinear(nn.Linear):
    """``y = x Wᵀ + b + (dropout(x) Aᵀ) Bᵀ · alpha/r`` around the parameters of an existing ``nn.Linear``.

    A subclass of ``nn.Linear`` built around the base layer's own ``weight``/``bias`` objects (nothing
    is copied), so state-dict names of the base stay those of the Hugging Face checkpoint and the
    adapters sit beside them as ``lora_A.weight`` / ``lora_B.weight``."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float) -> None:
        nn.Module.__init__(self)  # not nn.Linear.__init__: it would allocate a new weight
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        dtype, device = base.weight.dtype, base.weight.device
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, dtype=dtype, device=device)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, dtype=dtype, device=device)
        # PEFT's initialisation: A as nn.Linear's default, B zero, so the update starts at 0
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)
        self.lora_dropout: nn.Module = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.rank, self.alpha = rank, alpha
        self.scaling = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = nn.functional.linear(x, self.weight, self.bias)
        return out + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling


def linear_module_names(model: nn.Module) -> list[str]:
    """The distinct last path parts of the model's adaptable ``nn.Linear`` modules (what
    ``target_modules`` may name), sorted."""
    names = {
        n.rsplit(".", 1)[-1]
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear) and n and n.rsplit(".", 1)[-1] not in _UNSUPPORTED
    }
    return sorted(names)


def apply_lora(model: nn.Module, config: LoraConfig) -> list[str]:
    """Freeze ``model`` and wrap its targeted linear layers with adapters (in place). Returns the full
    module paths wrapped. Raises ConfigError, listing the model's linear module names, when a target
    matches nothing."""
    available = linear_module_names(model)
    wanted = list(dict.fromkeys(config.target_modules))
    missing = [t for t in wanted if t not in available]
    if missing:
        raise ConfigError(
            f"trainer lora.target_modules: {missing} not found in {type(model).__name__}; its linear "
            f"modules are {available}"
        )
    model.requires_grad_(False)
    wrapped = []
    for path, module in list(model.named_modules()):
        if not path or path.rsplit(".", 1)[-1] not in wanted or not isinstance(module, nn.Linear):
            continue
        if isinstance(module, LoraLinear):
            raise ConfigError(f"{path}: already carries a LoRA adapter")
        parent_path, _, child = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        setattr(parent, child, LoraLinear(module, config.rank, config.alpha, config.dropout))
        wrapped.append(path)
    return wrapped


def is_lora_name(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter parameters under their module paths (``…q_proj.lora_A.weight``), as trained."""
    return {n: p for n, p in model.named_parameters() if is_lora_name(n)}


def _gathered(t: torch.Tensor) -> torch.Tensor:
    """Under FSDP a parameter is a shard (DTensor): gather it (collective: every rank iterates)."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()


def served_adapter(model: nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    """What the weight store carries: PEFT-named adapter tensors with ``alpha / r`` folded into
    ``lora_B`` (the matching ``adapter_config.json`` has ``lora_alpha = r``)."""
    scales = {f"{n}.": m.scaling for n, m in model.named_modules() if isinstance(m, LoraLinear)}
    for name, t in adapter_state(model).items():
        t = _gathered(t)
        if ".lora_B." in name:
            t = t * scales[name.rsplit("lora_B.", 1)[0]]
        yield PEFT_PREFIX + name, t


def merged_weights(model: nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    """The model's full weights in HF naming (no adapter tensors) with each adapter folded into its
    base weight: ``W + (B @ A) · alpha/r`` for every :class:`LoraLinear`, in the base weight's dtype."""

    lora = {f"{n}.weight": m for n, m in model.named_modules() if isinstance(m, LoraLinear)}
    for name, t in model.state_dict().items():
        if is_lora_name(name):
            continue
        t = _gathered(t)
        m = lora.get(name)
        if m is not None:
            a, b = _gathered(m.lora_A.weight).float(), _gathered(m.lora_B.weight).float()
            t = (t.float() + (b @ a) * m.scaling).to(t.dtype)
        yield name, t


def adapter_config(
    rank: int, alpha: float, target_modules: Iterable[str], base_model: str | Path = ""
) -> dict[str, Any]:
    """The ``adapter_config.json`` of a PEFT LoRA adapter with these settings."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base_model),
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(set(target_modules)),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }


def save_adapter_files(
    tensors: Mapping[str, torch.Tensor], config: dict[str, Any], out_dir: str | Path
) -> Path:
    """Write a PEFT adapter directory (``adapter_model.safetensors`` + ``adapter_config.json``)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({n: t.detach().cpu().contiguous() for n, t in tensors.items()}, str(out / ADAPTER_WEIGHTS))
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=1))
    return out


def load_adapter_files(model: nn.Module, adapter_dir: str | Path, config: LoraConfig) -> None:
    """Copy a PEFT adapter directory written by :func:`save_adapter_files` (unscaled ``lora_B``,
    ``lora_alpha`` = the config's) into ``model``'s adapters; every adapter must be there."""
    from safetensors.torch import load_file

    d = Path(adapter_dir)
    saved_cfg = json.loads((d / ADAPTER_CONFIG).read_text())
    if saved_cfg.get("r") != config.rank or sorted(saved_cfg.get("target_modules", [])) != sorted(
        set(config.target_modules)
    ):
        raise ConfigError(
            f"{d}: adapter has r={saved_cfg.get('r')}, target_modules={saved_cfg.get('target_modules')}; "
            f"the trainer's lora has rank={config.rank}, target_modules={config.target_modules}"
        )
    saved = {n.removeprefix(PEFT_PREFIX): t for n, t in load_file(str(d / ADAPTER_WEIGHTS)).items()}
    params = adapter_state(model)
    if set(saved) != set(params):
        raise ConfigError(
            f"{d}: adapter tensors do not match the model's adapters "
            f"(missing {sorted(set(params) - set(saved))[:4]}, unexpected {sorted(set(saved) - set(params))[:4]})"
        )
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(saved[name])
