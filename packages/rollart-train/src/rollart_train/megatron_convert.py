"""Hugging Face (Qwen2 / Llama) ↔ Megatron-core GPTModel weight names and layouts (torch only).

Megatron-core names (``GPTModel`` with the local or the Transformer-Engine layer spec)::

    embedding.word_embeddings.weight                       ↔ model.embed_tokens.weight
    decoder.layers.{i}.self_attention.linear_qkv.weight    ↔ model.layers.{i}.self_attn.{q,k,v}_proj.weight
    decoder.layers.{i}.self_attention.linear_qkv.bias      ↔ model.layers.{i}.self_attn.{q,k,v}_proj.bias (Qwen2)
    decoder.layers.{i}.self_attention.linear_proj.weight   ↔ model.layers.{i}.self_attn.o_proj.weight
    decoder.layers.{i}.input_layernorm.weight              ↔ model.layers.{i}.input_layernorm.weight
      (TE spec: decoder.layers.{i}.self_attention.linear_qkv.layer_norm_weight)
    decoder.layers.{i}.pre_mlp_layernorm.weight            ↔ model.layers.{i}.post_attention_layernorm.weight
      (TE spec: decoder.layers.{i}.mlp.linear_fc1.layer_norm_weight)
    decoder.layers.{i}.mlp.linear_fc1.weight               ↔ model.layers.{i}.mlp.{gate,up}_proj.weight
    decoder.layers.{i}.mlp.linear_fc2.weight               ↔ model.layers.{i}.mlp.down_proj.weight
    decoder.final_layernorm.weight                         ↔ model.norm.weight
    output_layer.weight                                    ↔ lm_head.weight

Layouts: the fused QKV holds, for each of the ``num_kv_heads`` query groups in turn, that group's
query heads, then its key head, then its value head (Megatron's ``get_query_key_value_tensors``
splits it so). ``linear_fc1`` is ``[gate; up]``. Under tensor parallelism every rank holds a slice of
these fused tensors: :func:`merge_tp_shards` rebuilds the full tensor (for ``linear_fc1`` each
shard is ``[gate_r; up_r]``). Pipeline stages number their layers from 0: pass ``layer_offset``.
Megatron pads the vocabulary; conversion to HF trims it to ``vocab_size``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "GptShape",
    "hf_to_megatron",
    "megatron_to_hf",
    "merge_qkv",
    "merge_tp_shards",
    "split_qkv",
    "split_tp_shard",
    "tp_partition_dim",
]

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


@dataclass(frozen=True, slots=True)
class GptShape:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    """The Hugging Face vocabulary size (rows beyond it are Megatron padding)."""

    @classmethod
    def from_hf_config(cls, cfg: Any) -> GptShape:
        heads = cfg.num_attention_heads
        return cls(
            num_layers=cfg.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            vocab_size=cfg.vocab_size,
        )

    @property
    def q_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads


def split_qkv(qkv: torch.Tensor, s: GptShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused Megatron QKV (weight ``[(h + 2·kv)·d, hidden]`` or bias ``[(h + 2·kv)·d]``) → HF q, k, v."""
    rest = qkv.shape[1:]
    g = qkv.reshape(s.num_kv_heads, (s.q_per_group + 2) * s.head_dim, *rest)
    q, k, v = torch.split(g, [s.q_per_group * s.head_dim, s.head_dim, s.head_dim], dim=1)
    return (
        q.reshape(s.num_heads * s.head_dim, *rest),
        k.reshape(s.num_kv_heads * s.head_dim, *rest),
        v.reshape(s.num_kv_heads * s.head_dim, *rest),
    )


def merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: GptShape) -> torch.Tensor:
    """HF q, k, v → Megatron's fused QKV (inverse of :func:`split_qkv`)."""
    rest = q.shape[1:]
    parts = (
        q.reshape(s.num_kv_heads, s.q_per_group * s.head_dim, *rest),
        k.reshape(s.num_kv_heads, s.head_dim, *rest),
        v.reshape(s.num_kv_heads, s.head_dim, *rest),
    )
    return torch.cat(parts, dim=1).reshape(-1, *rest)


_SIMPLE_LAYER = {
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
_SIMPLE = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}


def megatron_to_hf(
    named: Iterable[tuple[str, torch.Tensor]], shape: GptShape, *, layer_offset: int = 0
) -> Iterator[tuple[str, torch.Tensor]]:
    """Full (TP-merged) Megatron tensors → HF names and layouts; ``_extra_state`` entries are skipped."""
    for name, t in named:
        name = name.removeprefix("module.")
        if name.endswith("_extra_state"):
            continue
        if name in _SIMPLE:
            if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
                t = t[: shape.vocab_size]
            yield _SIMPLE[name], t
            continue
        m = _LAYER.match(name)
        if m is None:
            raise KeyError(f"unknown Megatron parameter {name!r}")
        i, rest = int(m.group(1)) + layer_offset, m.group(2)
        pre = f"model.layers.{i}."
        if rest in _SIMPLE_LAYER:
            yield pre + _SIMPLE_LAYER[rest], t
        elif rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
            kind = rest.rsplit(".", 1)[1]
            for proj, part in zip("qkv", split_qkv(t, shape), strict=True):
                yield f"{pre}self_attn.{proj}_proj.{kind}", part
        elif rest == "mlp.linear_fc1.weight":
            gate, up = torch.chunk(t, 2, dim=0)
            yield pre + "mlp.gate_proj.weight", gate
            yield pre + "mlp.up_proj.weight", up
        else:
            raise KeyError(f"unknown Megatron parameter {name!r}")


def hf_to_megatron(
    hf: Mapping[str, torch.Tensor],
    shape: GptShape,
    *,
    te_layernorm: bool = False,
    padded_vocab_size: int | None = None,
    tied: bool = False,
) -> dict[str, torch.Tensor]:
    """HF state dict → full Megatron tensors (the local layer spec's names, or TE's fused layer-norm
    names with ``te_layernorm``). Embedding/output rows are zero-padded to ``padded_vocab_size``."""

    def pad(t: torch.Tensor) -> torch.Tensor:
        if padded_vocab_size is None or padded_vocab_size == t.shape[0]:
            return t
        return torch.cat([t, t.new_zeros(padded_vocab_size - t.shape[0], *t.shape[1:])])

    out = {
        "embedding.word_embeddings.weight": pad(hf["model.embed_tokens.weight"]),
        "decoder.final_layernorm.weight": hf["model.norm.weight"],
    }
    if not tied:
        out["output_layer.weight"] = pad(hf.get("lm_head.weight", hf["model.embed_tokens.weight"]))
    ln_in = "self_attention.linear_qkv.layer_norm_weight" if te_layernorm else "input_layernorm.weight"
    ln_mlp = "mlp.linear_fc1.layer_norm_weight" if te_layernorm else "pre_mlp_layernorm.weight"
    for i in range(shape.num_layers):
        p, d = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[d + ln_in] = hf[p + "input_layernorm.weight"]
        out[d + ln_mlp] = hf[p + "post_attention_layernorm.weight"]
        q, k, v = (hf[f"{p}self_attn.{x}_proj.weight"] for x in "qkv")
        out[d + "self_attention.linear_qkv.weight"] = merge_qkv(q, k, v, shape)
        if p + "self_attn.q_proj.bias" in hf:
            q, k, v = (hf[f"{p}self_attn.{x}_proj.bias"] for x in "qkv")
            out[d + "self_attention.linear_qkv.bias"] = merge_qkv(q, k, v, shape)
        out[d + "self_attention.linear_proj.weight"] = hf[p + "self_attn.o_proj.weight"]
        out[d + "mlp.linear_fc1.weight"] = torch.cat(
            [hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]]
        )
        out[d + "mlp.linear_fc2.weight"] = hf[p + "mlp.down_proj.weight"]
    return out


def tp_partition_dim(name: str) -> int | None:
    """Tensor-parallel split axis of a Megatron parameter (None: replicated on every TP rank)."""
    name = name.removeprefix("module.")
    if name.endswith(
        (
            "linear_qkv.weight",
            "linear_qkv.bias",
            "linear_fc1.weight",
            "linear_fc1.bias",
            "word_embeddings.weight",
            "output_layer.weight",
        )
    ):
        return 0
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1
    return None


def merge_tp_shards(name: str, shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """Full tensor from the TP ranks' slices (in rank order)."""
    dim = tp_partition_dim(name)
    if dim is None or len(shards) == 1:
        return shards[0]
    if name.endswith(("linear_fc1.weight", "linear_fc1.bias")):  # each shard is [gate_r; up_r]
        halves = [torch.chunk(s, 2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(list(shards), dim=dim)


def split_tp_shard(name: str, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This TP rank's slice of a full Megatron tensor (inverse of :func:`merge_tp_shards`)."""
    dim = tp_partition_dim(name)
    if dim is None or tp_size == 1:
        return full
    if name.endswith(("linear_fc1.weight", "linear_fc1.bias")):
        gate, up = torch.chunk(full, 2, dim=0)
        return torch.cat([torch.chunk(gate, tp_size)[tp_rank], torch.chunk(up, tp_size)[tp_rank]])
    return torch.chunk(full, tp_size, dim=dim)[tp_rank]
