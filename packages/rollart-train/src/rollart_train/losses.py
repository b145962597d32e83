"""RL losses and advantage estimators (torch). Every function is checked against float64 references."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch

from rollart_core.types import Trajectory

__all__ = ["grpo_advantages", "ppo_clip_loss", "token_logprobs"]


def grpo_advantages(trajectories: Sequence[Trajectory], *, scale_by_std: bool = True, eps: float = 1e-6) -> list[float]:
    """Group-relative advantage: reward minus its group's mean (divided by the group's std)."""
    groups: dict[str, list[int]] = defaultdict(list)
    for i, t in enumerate(trajectories):
        groups[t.group_id].append(i)
    adv = [0.0] * len(trajectories)
    for idx in groups.values():
        rewards = torch.tensor([trajectories[i].reward for i in idx], dtype=torch.float64)
        centred = rewards - rewards.mean()
        if scale_by_std and len(idx) > 1:
            centred = centred / (rewards.std(unbiased=False) + eps)
        for j, i in enumerate(idx):
            adv[i] = float(centred[j])
    return adv


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``logp[b, i] = log softmax(logits[b, i-1])[tokens[b, i]]`` for i >= 1 (shape [B, T-1])."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)


def ppo_clip_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-level PPO-clip surrogate, averaged over the masked tokens of the whole batch.

    ``advantages`` is per token (broadcast a per-sequence advantage before calling).
    """
    hi = clip_eps if clip_eps_high is None else clip_eps_high
    ratio = torch.exp(logp - behaviour_logp)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + hi) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    n = mask.sum().clamp(min=1.0)
    loss = (per_token * mask).sum() / n
    with torch.no_grad():
        clip_frac = (((ratio < 1 - clip_eps) | (ratio > 1 + hi)).float() * mask).sum() / n
        approx_kl = ((behaviour_logp - logp) * mask).sum() / n
    return loss, {"clip_frac": float(clip_frac), "approx_kl": float(approx_kl)}
