"""The configuration of :class:`~rollart_proxy.engines.vllm_engine.VllmEngine`: :class:`VllmEngineConfig`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rollart_proxy.engines.vllm_lora import VllmLoraConfig

__all__ = ["VllmEngineConfig"]


class VllmEngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    max_model_len: int = Field(2048, ge=16)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_num_seqs: int = Field(64, ge=1)
    kv_cache_gib: float = Field(1.0, gt=0)
    """KV cache size on CPU (``VLLM_CPU_KVCACHE_SPACE``); ignored on GPU."""
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    """Fraction of GPU memory (on vLLM's CPU build: of host memory) to reserve; None = vLLM's default."""
    enforce_eager: bool = True
    seed: int = 0
    engine_args: dict[str, Any] = Field(default_factory=dict)
    """Extra ``AsyncEngineArgs`` fields, passed through."""
    weight_update: Literal["staged", "in_place"] = "staged"
    """``staged``: load and post-process the next weights into a shadow copy of the model while
    generation goes on, then swap them in during a short pause (one extra copy of the weights; needs
    ``enforce_eager``). ``in_place``: vLLM's ``reload_weights`` runs inside the pause."""
    update_stage_timeout_s: float = Field(300.0, gt=0)
    """Bound on each stage of a weight update (pulling from the store, staging, swapping in or
    loading): a stage that takes longer fails the update with an error naming it and the engine."""
    lora: VllmLoraConfig | None = None
    """Serve LoRA adapters (vLLM ``enable_lora``): every pushed version must then be an adapter in
    PEFT naming, which new requests get from the update on; version 0 is the base model. None: every
    version is full weights."""

    @model_validator(mode="after")
    def _staged_needs_eager(self) -> VllmEngineConfig:
        if self.weight_update == "staged" and not self.enforce_eager:
            raise ValueError(
                "weight_update='staged' needs enforce_eager=True (a captured graph keeps the old "
                "weights); use weight_update='in_place' with graphs"
            )
        return self
