"""Batch preparation for every trainer: trajectories into sequences, sequences into micro-batches,
and the model's logits back into each selected target's log-probability.

Token-level packing of variable-length trajectories into fixed-token-budget micro-batches:

A packed micro-batch is one row ``[1, T]`` holding several sequences back to back; position ids restart
at 0 for every sequence and the attention is block-diagonal causal (no token attends across a sequence
boundary): the sequence boundaries for the trainer's default segment attention (``_attention``),
position ids alone for varlen (flash) attention, an explicit 4-D mask for plain eager/SDPA. The padded layout (one sequence per row, right-padded) is kept for comparison.

Only the *selected targets* get logits: token ``j`` of a sequence is predicted by the hidden state at
``j - 1``; ``select="loss"`` keeps the generated tokens (loss mask 1), ``select="all"`` every token
after the first.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rollart_core.errors import TrainerError
from rollart_core.types import Trajectory
from rollart_train._attention import SEGMENT_ATTENTION
from rollart_train.losses import trajectory_mean_weights

__all__ = [
    "MicroBatch",
    "SeqData",
    "assign_bins",
    "build_micro_batch",
    "pack_bins",
    "seq_data",
    "split_sequences",
    "target_logits",
    "target_logprobs",
    "trajectory_weights",
]


@dataclass(slots=True)
class SeqData:
    """One trajectory flattened: token ids and per-token annotations (index = token position)."""

    ids: list[int]
    mask: list[int]
    behaviour: list[float]
    versions: list[int]
    advantage: float | list[float]
    """One advantage for every token, or a list with one per token position."""
    spec: dict[int, tuple[tuple[int, ...] | None, float]] | None = None
    """position → (allowed token ids, temperature) of generated tokens, when matching sampling."""
    weight: float = 1.0
    """Weight of each of its loss tokens in the batch mean (:func:`trajectory_weights`)."""


def split_sequences(
    batch: Sequence[Trajectory], advantages: Sequence[float | Sequence[float]]
) -> tuple[list[Trajectory], list[float | list[float]]]:
    """Every trajectory's :meth:`~rollart_core.types.Trajectory.sequences` (the token sequences the
    policy saw; several when each turn's prompt held only the current observation), each with its
    share of the advantages: the trajectory's one advantage, or the per-turn advantages of its turns."""
    out_t: list[Trajectory] = []
    out_a: list[float | list[float]] = []
    for t, a in zip(batch, advantages, strict=True):
        if not isinstance(a, (int, float)) and len(a) != len(t.turns):
            raise ValueError(f"{len(a)} advantages for {len(t.turns)} turns")
        k = 0
        for s in t.sequences():
            out_t.append(s)
            out_a.append(
                float(a) if isinstance(a, (int, float)) else [float(x) for x in a[k : k + len(s.turns)]]
            )
            k += len(s.turns)
    return out_t, out_a


def trajectory_weights(batch: Sequence[Trajectory], seqs: Sequence[SeqData]) -> None:
    """Set every sequence's token weight so that each trajectory of ``batch`` (whose sequences are
    ``seqs``, in :func:`split_sequences` order) weighs the same in the batch mean, its loss tokens
    sharing that weight; the weights of all loss tokens still sum to their count."""
    per_traj: list[list[SeqData]] = []
    k = 0
    for t in batch:
        n = len(t.sequences())
        per_traj.append(list(seqs[k : k + n]))
        k += n
    if k != len(seqs):
        raise ValueError(f"{len(seqs)} sequences for {k} in the batch's trajectories")
    weights = trajectory_mean_weights([sum(sum(s.mask[1:]) for s in group) for group in per_traj])
    for group, w in zip(per_traj, weights, strict=True):
        for s in group:
            s.weight = w


def seq_data(t: Trajectory, advantage: float | Sequence[float], match_sampling: bool) -> SeqData:
    """``advantage``: one for the whole trajectory, or one per turn (applied to that turn's tokens)."""
    spec = {pos: (allowed, temp) for pos, allowed, temp in t.sampling_spec()} if match_sampling else None
    adv: float | list[float]
    if isinstance(advantage, (int, float)):
        adv = float(advantage)
    else:
        if len(advantage) != len(t.turns):
            raise ValueError(f"{len(advantage)} advantages for {len(t.turns)} turns")
        adv = []
        for turn, a in zip(t.turns, advantage, strict=True):
            adv += [0.0] * len(turn.context_ids) + [float(a)] * len(turn.output_ids)
    return SeqData(t.token_ids(), t.loss_mask(), t.behaviour_logprobs(), t.token_versions(), adv, spec)


@dataclass(slots=True)
class MicroBatch:
    """Model inputs plus, for every selected target token, what the loss needs (flat, length n)."""

    input_ids: torch.Tensor  # [B, T]
    position_ids: torch.Tensor  # [B, T]
    attention_mask: (
        torch.Tensor | None
    )  # [B, T] (padded), [1, 1, T, T] (packed, eager/SDPA) or None (varlen, segments)
    pred_index: torch.Tensor  # [n] flat index into B*T of the position that predicts each target
    targets: torch.Tensor  # [n]
    seq_index: torch.Tensor  # [n] index of the target's sequence in the whole batch
    token_pos: torch.Tensor  # [n] position of the target inside its sequence
    mask: torch.Tensor  # [n] loss mask (float)
    behaviour: torch.Tensor  # [n]
    versions: torch.Tensor  # [n]
    advantages: torch.Tensor  # [n]
    temperature: torch.Tensor | None  # [n]
    allowed_id: torch.Tensor | None  # [n], -1 = unrestricted
    allowed_sets: list[tuple[int, ...]]
    packed: bool
    cu_seqlens: torch.Tensor | None = None  # [k+1] sequence boundaries in the packed row (segment attention)

    @property
    def num_targets(self) -> int:
        return int(self.targets.numel())

    def to(self, device: torch.device) -> MicroBatch:
        for name in self.__slots__:
            value = getattr(self, name)
            if isinstance(value, torch.Tensor):
                setattr(self, name, value.to(device, non_blocking=True))
        return self


def pack_bins(lengths: Sequence[int], token_budget: int, max_seqs: int) -> list[list[int]]:
    """First-fit decreasing: sequences (by index) into bins of at most ``token_budget`` tokens and
    ``max_seqs`` sequences; a sequence longer than the budget gets a bin of its own. Deterministic."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        for b, load in enumerate(loads):
            if load + lengths[i] <= token_budget and len(bins[b]) < max_seqs:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    for members in bins:
        members.sort()
    return bins


def assign_bins(bins: list[list[int]], lengths: Sequence[int], world_size: int) -> list[list[list[int]]]:
    """Spread bins over ranks, heaviest first onto the least-loaded rank (deterministic)."""
    per_rank: list[list[list[int]]] = [[] for _ in range(world_size)]
    loads = [0] * world_size
    for b in sorted(bins, key=lambda b: (-sum(lengths[i] for i in b), b[0])):
        r = min(range(world_size), key=lambda k: (loads[k], k))
        per_rank[r].append(b)
        loads[r] += sum(lengths[i] for i in b)
    return per_rank


def _block_causal_mask(lengths: Sequence[int], dtype: torch.dtype, boolean: bool) -> torch.Tensor:
    total = sum(lengths)
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(list(lengths)))
    allowed = (seg[:, None] == seg[None, :]) & torch.ones(total, total, dtype=torch.bool).tril()
    if boolean:
        return allowed[None, None]
    out = torch.zeros(total, total, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    return out[None, None]


def build_micro_batch(
    seqs: Sequence[SeqData],
    indices: Sequence[int],
    *,
    select: str,
    packed: bool,
    pad_id: int,
    attn_impl: str,
    mask_dtype: torch.dtype,
    width: int | None = None,
) -> MicroBatch:
    """Lay out ``seqs[indices]`` as one packed row (or a padded batch) and collect the selected targets.
    ``width``: the padded layout's row length when every micro-batch must have one shape (pipeline
    parallelism's point-to-point sends need it); at least the longest sequence's."""
    lengths = [len(seqs[i].ids) for i in indices]
    width = sum(lengths) if packed else max(max(lengths), width or 0)
    rows = 1 if packed else len(indices)
    input_ids = torch.full((rows, width), pad_id, dtype=torch.long)
    position_ids = torch.zeros((rows, width), dtype=torch.long)
    pred, tgt, sidx, tpos, mask, beh, ver, adv, temp, allow = ([] for _ in range(10))
    allowed_sets: dict[tuple[int, ...], int] = {}
    any_spec = False
    offset = 0
    for k, i in enumerate(indices):
        s = seqs[i]
        row, base = (0, offset) if packed else (k, 0)
        n = len(s.ids)
        input_ids[row, base : base + n] = torch.tensor(s.ids, dtype=torch.long)
        position_ids[row, base : base + n] = torch.arange(n)
        for j in range(1, n):
            if select == "loss" and not s.mask[j]:
                continue
            pred.append(row * width + base + j - 1)
            tgt.append(s.ids[j])
            sidx.append(i)
            tpos.append(j)
            mask.append(float(s.mask[j]) * s.weight)
            beh.append(s.behaviour[j])
            ver.append(s.versions[j])
            adv.append(s.advantage[j] if isinstance(s.advantage, list) else s.advantage)
            allowed, t = (s.spec or {}).get(j, (None, 1.0))
            any_spec = any_spec or s.spec is not None
            temp.append(t if t > 0 else 1.0)
            allow.append(
                -1 if allowed is None else allowed_sets.setdefault(tuple(allowed), len(allowed_sets))
            )
        offset += n
    cu_seqlens = None
    if packed:
        if attn_impl.startswith("flash") or attn_impl.endswith("flash_attention_2"):
            attention_mask = None  # varlen attention splits sequences at position-id resets
        elif attn_impl == SEGMENT_ATTENTION:
            attention_mask = None  # attention per sequence, at these boundaries
            cu_seqlens = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
        else:
            attention_mask = _block_causal_mask(lengths, mask_dtype, boolean=attn_impl == "sdpa")
    else:
        attention_mask = torch.zeros((rows, width), dtype=torch.long)
        for k, n in enumerate(lengths):
            attention_mask[k, :n] = 1
    return MicroBatch(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=attention_mask,
        pred_index=torch.tensor(pred, dtype=torch.long),
        targets=torch.tensor(tgt, dtype=torch.long),
        seq_index=torch.tensor(sidx, dtype=torch.long),
        token_pos=torch.tensor(tpos, dtype=torch.long),
        mask=torch.tensor(mask, dtype=torch.float32),
        behaviour=torch.tensor(beh, dtype=torch.float32),
        versions=torch.tensor(ver, dtype=torch.long),
        advantages=torch.tensor(adv, dtype=torch.float32),
        temperature=torch.tensor(temp, dtype=torch.float32) if any_spec else None,
        allowed_id=torch.tensor(allow, dtype=torch.long) if allowed_sets else None,
        allowed_sets=list(allowed_sets),
        packed=packed,
        cu_seqlens=cu_seqlens,
    )


def target_logits(logits: torch.Tensor, mb: MicroBatch, vocab_size: int | None = None) -> torch.Tensor:
    """float32 logits ``[n, V]`` of the selected targets from the model's output: ``[1, n, V]`` for a
    packed micro-batch (the model kept only those positions), else ``[B, T, V]`` (gathered at
    ``pred_index``), cut to
    ``vocab_size`` (a padded vocabulary), under each target's sampling temperature and allowed-token
    restriction when present (greedy, temperature 0, was sampled as the argmax: logits as they are)."""
    if mb.packed:
        flat = logits[0]
    else:
        flat = logits.reshape(-1, logits.shape[-1])[mb.pred_index]
    flat = flat[:, :vocab_size].float()
    if mb.temperature is not None:
        flat = flat / mb.temperature.unsqueeze(-1)
    if mb.allowed_id is not None:
        v = flat.shape[-1]
        allow = torch.ones(flat.shape, dtype=torch.bool, device=flat.device)
        for k, ids in enumerate(mb.allowed_sets):
            if not ids or max(ids) >= v or min(ids) < 0:
                raise TrainerError(
                    f"allowed_token_ids {list(ids[:8])} (of {len(ids)}): empty or outside the "
                    f"vocabulary (0..{v - 1})"
                )
            row = torch.zeros(v, dtype=torch.bool, device=flat.device)
            row[list(ids)] = True
            allow[mb.allowed_id == k] = row
        flat = flat.masked_fill(~allow, float("-inf"))
    return flat


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits)[targets]``: each selected target's log-probability, ``[n]``."""
    return torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
