"""Segment attention for packed micro-batches without a varlen kernel (CPU, or GPUs without flash-attn).

A packed row holds several sequences back to back. With a dense block-causal ``[T, T]`` mask, SDPA
still computes every one of the ``T²`` scores and throws most of them away: a pack of 16 sequences of
370 tokens costs 16× the attention it needs, and dominated the torch trainer's step on CPU. This
attention function runs causal SDPA on each sequence's slice of the row instead (``Σ nᵢ²``), with no
mask at all, given the sequence boundaries ``cu_seq_lens_q`` (the name Hugging Face's flash
attention uses, passed down to every attention layer as a keyword of the model's forward).

Registered with Hugging Face's ``AttentionInterface`` under :data:`SEGMENT_ATTENTION`; a model
loaded with that ``attn_implementation`` gets no mask built for it, and calls without boundaries (a
padded batch, generation) fall back to plain SDPA.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

SEGMENT_ATTENTION = "rollart_segment_sdpa"


def segment_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    cu_seq_lens_q: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``query`` ``[1, H, T, D]`` (key/value ``[1, Hkv, T, D]``) → ``[1, T, H, D]``, causal within each
    segment ``cu_seq_lens_q[i]:cu_seq_lens_q[i+1]``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    kwargs.pop("cu_seq_lens_k", None)
    kwargs.pop("max_length_q", None)
    kwargs.pop("max_length_k", None)
    if cu_seq_lens_q is None or attention_mask is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"segment attention expects one packed row, got a batch of {query.shape[0]}")
    window = kwargs.pop("sliding_window", None)
    kwargs.pop("is_causal", None)
    bounds = cu_seq_lens_q.tolist()
    if bounds[0] != 0 or bounds[-1] != query.shape[2]:
        raise ValueError(
            f"cu_seq_lens_q {bounds[:3]}…{bounds[-1:]} does not cover the packed row of {query.shape[2]}"
        )
    outs = []
    for s, e in itertools.pairwise(bounds):
        if e == s:
            continue
        mask = None
        if window is not None and e - s > window:  # causal and at most ``window`` tokens back
            i = torch.arange(e - s, device=query.device)
            mask = ((i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < window))[None, None]
        out, _ = sdpa_attention_forward(
            module, query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], mask, is_causal=mask is None, **kwargs
        )
        outs.append(out)
    return torch.cat(outs, dim=1), None


def register_segment_attention() -> str:
    """Make :data:`SEGMENT_ATTENTION` a valid ``attn_implementation`` (idempotent); returns the name."""
    from transformers import AttentionInterface

    if SEGMENT_ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(SEGMENT_ATTENTION, segment_sdpa)
    return SEGMENT_ATTENTION
