"""Megatron-core ``GPTModel`` from a Hugging Face Qwen2/Llama directory, and the parallel set-up.

:func:`init_parallel` joins (or forms) the process group and sets up Megatron's tensor / pipeline /
data-parallel groups; :func:`transformer_config` maps a Hugging Face ``config.json`` to Megatron's
``TransformerConfig``; :func:`build_gpt` builds one pipeline stage and :func:`load_local` fills it with
this rank's tensor-parallel shards of the converted weights (:mod:`rollart_train.megatron_convert`).
Used by :class:`~rollart_train.megatron_trainer.MegatronTrainer`; extra ``[megatron]``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from rollart_core.errors import ConfigError, TrainerError
from rollart_core.extras import require
from rollart_train._megatron_cpu import cuda_current_device_is_cpu, init_cpu_rng
from rollart_train._rendezvous import backend_for, free_port, join_process_group
from rollart_train.megatron_config import MegatronTrainerConfig
from rollart_train.megatron_convert import GptShape, hf_to_megatron, split_tp_shard

__all__ = [
    "INSTALL",
    "build_gpt",
    "build_gpt_model_cpu_for_tests",
    "causal_mask",
    "global_name",
    "hf_shape",
    "init_parallel",
    "load_local",
    "read_hf",
    "require_mcore",
    "transformer_config",
]

INSTALL = "pip install 'rollart-train[megatron]'"


def require_mcore() -> Any:
    return require("megatron.core", INSTALL)


def transformer_config(
    hf: dict[str, Any], *, tp: int = 1, pp: int = 1, bf16: bool = False, cpu_init: bool = False
) -> Any:
    """Megatron ``TransformerConfig`` equivalent to a Hugging Face Qwen2/Llama ``config.json``."""
    require_mcore()
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    if hf.get("model_type") not in ("qwen2", "llama"):
        raise ConfigError(f"MegatronTrainer supports qwen2/llama checkpoints, not {hf.get('model_type')!r}")
    heads = hf["num_attention_heads"]
    return TransformerConfig(
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        ffn_hidden_size=hf["intermediate_size"],
        kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads,
        normalization="RMSNorm",
        layernorm_epsilon=hf.get("rms_norm_eps", 1e-6),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=hf.get("model_type") == "qwen2" or bool(hf.get("attention_bias")),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_cpu_initialization=cpu_init,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )


def build_gpt(hf: dict[str, Any], tcfg: Any, *, pre: bool, post: bool, vocab: int) -> Any:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return GPTModel(
        config=tcfg,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=vocab,
        max_sequence_length=hf.get("max_position_embeddings", 4096),
        pre_process=pre,
        post_process=post,
        parallel_output=False,
        share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings", False)),
        position_embedding_type="rope",
        rotary_base=int(hf.get("rope_theta", 10000)),
    )


def read_hf(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    cfg = json.loads((path / "config.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    if not tensors:
        raise TrainerError(f"no safetensors weights in {path}")
    return cfg, tensors


def causal_mask(b: int, s: int, device: torch.device) -> torch.Tensor:
    return torch.triu(torch.ones(s, s, dtype=torch.bool, device=device), diagonal=1)[None, None].expand(
        b, 1, s, s
    )


def build_gpt_model_cpu_for_tests(path: Path, hf_state: dict[str, torch.Tensor]) -> Any:
    """A tiny GPTModel on CPU (world of one over gloo) with converted HF weights: checks the conversion
    against the real megatron-core modules. CPU patches: the RNG tracker without CUDA
    (``inference_rng_tracker``) and ``torch.cuda.current_device`` answering ``"cpu"`` during forward."""
    require_mcore()
    init_parallel(MegatronTrainerConfig(device="cpu", bf16=False))
    init_cpu_rng(0)
    hf = json.loads((path / "config.json").read_text())
    model = build_gpt(hf, transformer_config(hf, cpu_init=True), pre=True, post=True, vocab=hf["vocab_size"])
    shape = hf_shape(hf)
    full = hf_to_megatron(hf_state, shape, tied=bool(hf.get("tie_word_embeddings", False)))
    load_local(model, full, layer_offset=0, tp_rank=0, tp_size=1)
    model.eval()

    class _Wrapped(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = model

        def forward(
            self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: Any
        ) -> torch.Tensor:
            mask = causal_mask(input_ids.shape[0], input_ids.shape[1], input_ids.device)
            with cuda_current_device_is_cpu():
                return self.inner(input_ids=input_ids, position_ids=position_ids, attention_mask=mask)

    return _Wrapped()


class _Obj:
    def __init__(self, d: dict[str, Any]) -> None:
        self.__dict__.update(d)


def hf_shape(hf: dict[str, Any]) -> GptShape:
    """The attention / vocabulary shape of a Hugging Face ``config.json``."""
    return GptShape.from_hf_config(_Obj(hf))


def init_parallel(c: MegatronTrainerConfig) -> None:
    """Join (or form) the process group and set up Megatron's tensor / pipeline / data-parallel groups.

    A process group that exists already is used as it is (a worker group's rank or torchrun joined it);
    else torchrun's environment is used, or a world of one on 127.0.0.1 is formed. ConfigError when the
    world does not fit the config (its ``world_size``, TP x PP) or Megatron's groups were set up with
    other sizes."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    tp, pp = c.tensor_parallel, c.pipeline_parallel
    if not dist.is_initialized():
        if "WORLD_SIZE" in os.environ:  # torchrun
            dist.init_process_group(backend_for(c))
        else:
            master = ("127.0.0.1", free_port())
            join_process_group(
                rank=0, world_size=1, master=master, backend=backend_for(c), timeout_s=c.rank_timeout_s
            )
    if c.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
        torch.cuda.set_device(local % torch.cuda.device_count())
    world = dist.get_world_size()
    if c.world_size is not None and c.world_size != world:
        raise ConfigError(f"world_size is {c.world_size} but the process group has {world} ranks")
    if world % (tp * pp):
        raise ConfigError(
            f"tensor_parallel ({tp}) x pipeline_parallel ({pp}) = {tp * pp} must divide the world size "
            f"({world})"
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tp, pp)
        return
    have = (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_world_size(),
    )
    if have != (tp, pp):
        raise ConfigError(
            f"Megatron's parallel groups in this process are TP={have[0]}, PP={have[1]}; the config asks "
            f"for TP={tp}, PP={pp}"
        )


def global_name(local: str, offset: int) -> str:
    """A pipeline stage's local parameter name with its layer index made global."""
    parts = local.split(".")
    if local.startswith("decoder.layers."):
        parts[2] = str(int(parts[2]) + offset)
    return ".".join(parts)


def load_local(
    model: torch.nn.Module, full: dict[str, torch.Tensor], *, layer_offset: int, tp_rank: int, tp_size: int
) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            g = global_name(name, layer_offset)
            if g not in full:
                raise TrainerError(f"no converted weight for Megatron parameter {g}")
            shard = split_tp_shard(g, full[g], tp_rank, tp_size)
            if g.endswith(("word_embeddings.weight", "output_layer.weight")) and shard.shape[0] != p.shape[0]:
                padded = shard.new_zeros(p.shape)
                padded[: shard.shape[0]] = shard
                shard = padded
            if shard.shape != p.shape:
                raise TrainerError(f"{g}: converted shape {tuple(shard.shape)} != parameter {tuple(p.shape)}")
            p.copy_(shard.to(p.dtype))
