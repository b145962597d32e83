"""LoRA adapters served by :class:`~rollart_proxy.engines.vllm_engine.VllmEngine`, versioned like weights.

A trainer that trains LoRA pushes to the weight store only the adapter tensors, in PEFT naming:
``base_model.model.<module path>.lora_A.weight`` (``[r, in]``) and ``….lora_B.weight`` (``[out, r]``)
with the scale ``alpha / r`` already folded into ``lora_B`` (``rollart_train.lora`` writes them so).
The names and shapes describe the adapter completely: rank from ``lora_A``, target modules from the
names, ``lora_alpha = r``. Any writer of that format works; nothing here imports the trainer.

:class:`AdapterVersions` keeps, per weight version, a PEFT directory (``adapter_model.safetensors`` +
``adapter_config.json``) and the ``LoRARequest`` that names it (``rollart-v<version>``, id = version:
unique per version, so vLLM's adapter cache and prefix cache never mix two versions). Version 0 is the
base model: no adapter (it equals an adapter with ``B = 0``).

Why in-flight requests keep the adapter they started with: vLLM binds a request to its adapter for
its whole life. A request's tokens are therefore all of its start version (exact per-token versions,
no KV to recompute), and the directory and cache slot of an older version stay until its last request
ends; the engine drops them at the next update after that.
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rollart_core.errors import WeightSyncError

__all__ = ["PEFT_PREFIX", "AdapterVersions", "VllmLoraConfig", "adapter_layout", "is_adapter"]

log = logging.getLogger(__name__)
PEFT_PREFIX = "base_model.model."
_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


class VllmLoraConfig(BaseModel):
    """Serve LoRA adapters (``enable_lora``) instead of loading full weights."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    max_lora_rank: Literal[1, 8, 16, 32, 64, 128, 256, 320, 512] = 16
    """Largest adapter rank the engine accepts (vLLM's allowed values); the trainer's ``lora.rank``
    must not exceed it."""
    max_loras: int = Field(4, ge=1)
    """Adapters in one batch: the served version plus older versions whose requests are still
    running (about ``alpha + 1`` under bounded staleness). More wait their turn, none is lost."""
    max_cpu_loras: int | None = Field(None, ge=1)
    """Adapters vLLM keeps loaded in host memory (None: ``max_loras``); an evicted one that is still
    in use reloads from its directory."""
    adapter_dir: str | None = None
    """Where the per-version adapter directories go (None: a temporary directory of this process,
    removed at shutdown)."""

    @model_validator(mode="after")
    def _cache_holds_a_batch(self) -> VllmLoraConfig:
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        return self


def is_adapter(names: Any) -> bool:
    """True if the tensor names are a PEFT LoRA adapter (every name ``base_model.model.…lora_A/B.weight``)."""
    names = list(names)
    return bool(names) and all(n.startswith(PEFT_PREFIX) and n.endswith(_SUFFIXES) for n in names)


def adapter_layout(tensors: Mapping[str, Any]) -> tuple[int, list[str]]:
    """Rank and target modules of a pushed adapter; WeightSyncError if it is not one consistent adapter."""
    if not is_adapter(tensors):
        odd = [n for n in tensors if not (n.startswith(PEFT_PREFIX) and n.endswith(_SUFFIXES))][:3]
        raise WeightSyncError(f"not a PEFT LoRA adapter: unexpected tensor names {odd}")
    ranks = {int(t.shape[0]) for n, t in tensors.items() if n.endswith(".lora_A.weight")}
    ranks |= {int(t.shape[1]) for n, t in tensors.items() if n.endswith(".lora_B.weight")}
    modules = {n.removesuffix(s) for n in tensors for s in _SUFFIXES if n.endswith(s)}
    unpaired = [m for m in modules if not all(m + s in tensors for s in _SUFFIXES)]
    if len(ranks) != 1 or unpaired:
        raise WeightSyncError(f"inconsistent LoRA adapter: ranks {sorted(ranks)}, unpaired {unpaired[:3]}")
    return ranks.pop(), sorted({m.rsplit(".", 1)[-1] for m in modules})


class AdapterVersions:
    """The adapter versions one engine knows, the one new requests get, and who still uses each.

    Called from the engine's event loop, except :meth:`write` (a thread: it writes files)."""

    def __init__(self, config: VllmLoraConfig, base_model: str, name: str) -> None:
        self.config = config
        self.base_model = base_model
        if config.adapter_dir:
            self.root = Path(config.adapter_dir) / name
            self.root.mkdir(parents=True, exist_ok=True)
            self._owned = False
        else:
            from rollart_core.procdirs import owned_tempdir

            self.root = Path(owned_tempdir("rollart-lora-"))
            self._owned = True
        self._requests: dict[int, Any] = {}
        self._users: dict[int, int] = {}
        self._lock = threading.Lock()
        self.served_version = 0

    def write(self, version: int, tensors: Mapping[str, Any]) -> Any:
        """Write ``version``'s PEFT directory; returns its ``LoRARequest``."""
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        rank, targets = adapter_layout(tensors)
        if rank > self.config.max_lora_rank:
            raise WeightSyncError(
                f"adapter v{version} has rank {rank} > the engine's lora.max_lora_rank "
                f"{self.config.max_lora_rank}: raise it (or lower the trainer's lora.rank)"
            )
        out = self.root / f"v{version}"
        tmp = self.root / f".v{version}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file(
            {n: t.detach().cpu().contiguous() for n, t in tensors.items()},
            str(tmp / "adapter_model.safetensors"),
        )
        config = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": self.base_model,
            "r": rank,
            "lora_alpha": rank,  # alpha / r is folded into lora_B by the pusher
            "lora_dropout": 0.0,
            "target_modules": targets,
            "bias": "none",
            "modules_to_save": None,
        }
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=1))
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
        request = LoRARequest(f"rollart-v{version}", version, str(out))
        with self._lock:
            self._requests[version] = request
        return request

    def serve(self, version: int) -> None:
        """New requests get ``version``'s adapter from now on (it must have been written)."""
        if version not in self._requests:
            raise WeightSyncError(f"adapter v{version} was not prepared")
        self.served_version = version

    def acquire(self) -> tuple[int, Any]:
        """The served version and its ``LoRARequest`` (None at version 0: the base model), counted
        as in use until :meth:`release`."""
        v = self.served_version
        self._users[v] = self._users.get(v, 0) + 1
        return v, self._requests.get(v)

    def release(self, version: int) -> None:
        left = self._users.get(version, 0) - 1
        if left > 0:
            self._users[version] = left
        else:
            self._users.pop(version, None)

    def unused(self) -> list[int]:
        """Versions older than the served one that no request uses any more: safe to drop."""
        with self._lock:
            return sorted(v for v in self._requests if v < self.served_version and v not in self._users)

    def drop(self, version: int) -> None:
        with self._lock:
            self._requests.pop(version, None)
        shutil.rmtree(self.root / f"v{version}", ignore_errors=True)

    def versions(self) -> list[int]:
        with self._lock:
            return sorted(self._requests)

    def close(self) -> None:
        with self._lock:
            versions = list(self._requests)
            self._requests.clear()
        if self._owned:
            shutil.rmtree(self.root, ignore_errors=True)
        else:
            for v in versions:
                shutil.rmtree(self.root / f"v{v}", ignore_errors=True)
