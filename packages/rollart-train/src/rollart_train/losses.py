"""RL losses and advantage estimators (torch). Every function is checked against float64 references.

Notation (per generated token): ``logp`` — current policy (with grad); ``proximal_logp`` — the
trainer's weights at the start of the step (recomputed, no grad); ``behaviour_logp`` — the engine that
sampled the token (recorded per token in the trajectory); ``ref_logp`` — a frozen reference policy.

- :func:`ppo_clip_loss` — classic PPO-clip, the old policy is the behaviour policy.
- :func:`decoupled_ppo_loss` — AReaL's decoupled objective: clip against the proximal policy, and
  weight each token by the behaviour→proximal importance ratio, truncated (:func:`behaviour_weights`).
- :func:`kl_penalty` — k1/k2/k3 estimators of KL(π‖π_ref) per token.
- :func:`entropy_from_logits` — per-token entropy (works on restricted, ``-inf``-masked logits).
- :func:`masked_mean` and :func:`lag_stats` — aggregation and per-batch policy-lag reporting.
- :func:`policy_loss` — one micro-batch's whole loss as both trainers assemble it (decoupled PPO,
  entropy bonus, KL penalty) with its statistics.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Literal, Protocol

import torch

from rollart_core.types import Trajectory

__all__ = [
    "batch_advantages",
    "behaviour_weights",
    "decoupled_ppo_loss",
    "entropy_from_logits",
    "grpo_advantages",
    "kl_penalty",
    "lag_stats",
    "masked_mean",
    "policy_loss",
    "ppo_clip_loss",
    "step_advantages",
    "token_logprobs",
    "trajectory_mean_weights",
]

KlEstimator = Literal["k1", "k2", "k3"]
TisMode = Literal["truncate", "mask"]


def grpo_advantages(
    trajectories: Sequence[Trajectory], *, scale_by_std: bool = True, eps: float = 1e-6
) -> list[float]:
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


def _normalise(values: Sequence[float], scale_by_std: bool, eps: float) -> list[float]:
    x = torch.tensor(values, dtype=torch.float64)
    if len(values) < 2:
        return [0.0] * len(values)
    centred = x - x.mean()
    if scale_by_std:
        centred = centred / (x.std(unbiased=False) + eps)
    return centred.tolist()


def batch_advantages(
    batch: Sequence[Trajectory], kind: str, *, gamma: float, step_weight: float, scale_by_std: bool
) -> list[float] | list[list[float]]:
    """A trainer's ``advantage`` option: ``grpo`` (:func:`grpo_advantages`, one per trajectory) or
    ``gigpo`` (:func:`step_advantages`, one per turn)."""
    if kind == "gigpo":
        return step_advantages(batch, gamma=gamma, step_weight=step_weight, scale_by_std=scale_by_std)
    if kind == "grpo":
        return grpo_advantages(batch, scale_by_std=scale_by_std)
    raise ValueError(f"advantage must be 'grpo' or 'gigpo', got {kind!r}")


def step_advantages(
    trajectories: Sequence[Trajectory],
    *,
    gamma: float = 1.0,
    step_weight: float = 1.0,
    scale_by_std: bool = True,
    eps: float = 1e-6,
) -> list[list[float]]:
    """Per-turn advantages for multi-turn episodes: episode-level GRPO plus a step-level term
    (GiGPO, Feng et al. 2025).

    The trajectories of a group share the environment seed, so they pass through the same states;
    turns whose context (the observation tokens of that turn) is identical form a *step group*.
    Each turn's discounted return ``gamma**(T-1-k) * reward`` (the episode's reward arrives after
    its last turn ``T-1``) is compared with the other members of its step group, normalised like
    GRPO; a turn whose state no other turn of the group visited gets step advantage 0. Turn ``k``
    of trajectory ``i`` gets ``episode_adv[i] + step_weight * step_adv[i][k]``.
    """
    episode = grpo_advantages(trajectories, scale_by_std=scale_by_std, eps=eps)
    steps: dict[tuple[str, tuple[int, ...]], list[tuple[int, int, float]]] = defaultdict(list)
    for i, t in enumerate(trajectories):
        n = len(t.turns)
        for k, turn in enumerate(t.turns):
            steps[(t.group_id, tuple(turn.context_ids))].append((i, k, t.reward * gamma ** (n - 1 - k)))
    adv = [[episode[i]] * len(t.turns) for i, t in enumerate(trajectories)]
    for members in steps.values():
        for (i, k, _), a in zip(
            members, _normalise([r for *_, r in members], scale_by_std, eps), strict=True
        ):
            adv[i][k] += step_weight * a
    return adv


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``logp[b, i] = log softmax(logits[b, i-1])[tokens[b, i]]`` for i >= 1 (shape [B, T-1])."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)


def trajectory_mean_weights(token_counts: Sequence[int]) -> list[float]:
    """``loss_agg: trajectory_mean``: the weight of each loss token of every trajectory (whose loss
    tokens number ``token_counts``) so that each trajectory with loss tokens weighs the same in the
    batch mean and its tokens share that weight; the weighted tokens still sum to their count, so the
    loss keeps the scale of a token mean. A trajectory without loss tokens gets 1.0 (it adds nothing)."""
    total, owners = sum(token_counts), sum(1 for n in token_counts if n)
    return [total / (owners * n) if n else 1.0 for n in token_counts]


def masked_mean(x: torch.Tensor, mask: torch.Tensor, n: torch.Tensor | float | None = None) -> torch.Tensor:
    """``sum(x * mask) / n`` with ``n`` the mask's sum by default (0 when the mask is empty)."""
    denom = mask.sum() if n is None else torch.as_tensor(n, dtype=x.dtype, device=x.device)
    return (x * mask).sum() / denom.clamp(min=1.0)


def _clip_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, clip_eps: float, hi: float
) -> torch.Tensor:
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + hi) * advantages
    return -torch.minimum(unclipped, clipped)


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
    per_token = _clip_surrogate(ratio, advantages, clip_eps, hi)
    n = mask.sum().clamp(min=1.0)
    loss = (per_token * mask).sum() / n
    with torch.no_grad():
        clip_frac = (((ratio < 1 - clip_eps) | (ratio > 1 + hi)).float() * mask).sum() / n
        approx_kl = ((behaviour_logp - logp) * mask).sum() / n
    return loss, {"clip_frac": float(clip_frac), "approx_kl": float(approx_kl)}


def behaviour_weights(
    proximal_logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    *,
    cap: float | None,
    mode: TisMode = "truncate",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Importance weight behaviour → proximal, ``exp(proximal - behaviour)``, without gradient.

    ``mode="truncate"`` (truncated importance sampling): ``min(w, cap)``. ``mode="mask"`` (AReaL's
    ``behav_imp_weight_cap``): tokens whose weight exceeds ``cap`` get weight 0. ``cap=None``: no cap.
    Returns ``(weights, capped)`` where ``capped`` flags the tokens the cap changed.
    """
    w = torch.exp(proximal_logp.detach() - behaviour_logp.detach())
    if cap is None:
        return w, torch.zeros_like(w, dtype=torch.bool)
    capped = w > cap
    if mode == "truncate":
        return torch.clamp(w, max=cap), capped
    if mode == "mask":
        return torch.where(capped, torch.zeros_like(w), w), capped
    raise ValueError(f"unknown TIS mode {mode!r} (truncate | mask)")


def decoupled_ppo_loss(
    logp: torch.Tensor,
    proximal_logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    tis_cap: float | None = 2.0,
    tis_mode: TisMode = "truncate",
    n: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Decoupled PPO (AReaL): ``-w_behav · min(r·A, clip(r)·A)`` with ``r = π/π_prox`` and the
    behaviour weight ``w_behav = π_prox/π_behav`` capped (:func:`behaviour_weights`).

    Where ``proximal_logp == behaviour_logp`` (tokens generated by the trainer's current version)
    the weight is 1 and this is plain PPO-clip. Averaged over ``n`` tokens (default: the mask's sum).
    Returns the loss and per-batch statistics as 0-dim tensors (sums over masked tokens / n).
    """
    hi = clip_eps if clip_eps_high is None else clip_eps_high
    ratio = torch.exp(logp - proximal_logp.detach())
    w, capped = behaviour_weights(proximal_logp, behaviour_logp, cap=tis_cap, mode=tis_mode)
    per_token = w * _clip_surrogate(ratio, advantages, clip_eps, hi)
    loss = masked_mean(per_token, mask, n)
    with torch.no_grad():
        stats = {
            "clip_frac": masked_mean(((ratio < 1 - clip_eps) | (ratio > 1 + hi)).to(mask.dtype), mask, n),
            "approx_kl": masked_mean(proximal_logp - logp, mask, n),
            "behav_weight": masked_mean(w, mask, n),
            "tis_capped_frac": masked_mean(capped.to(mask.dtype), mask, n),
        }
    return loss, stats


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: KlEstimator = "k3") -> torch.Tensor:
    """Per-token estimate of KL(π‖π_ref) from samples of π (Schulman's k1/k2/k3).

    k1 = log π - log π_ref (unbiased, high variance, can be negative); k2 = ½ (log π - log π_ref)²;
    k3 = π_ref/π - log(π_ref/π) - 1 (unbiased, always ≥ 0). Gradient flows through ``logp`` only.
    """
    d = logp - ref_logp.detach()
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return torch.exp(-d) + d - 1.0
    raise ValueError(f"unknown KL estimator {estimator!r} (k1 | k2 | k3)")


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` along the last axis, in float32; ``-inf`` logits count as p=0."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    # masked (-inf) entries contribute 0 *and no gradient*: ``where(p > 0, p * logp, 0)`` would
    # backpropagate 0 * -inf = nan through the product and poison every parameter's gradient
    finite = torch.isfinite(logp)
    safe = torch.where(finite, logp, torch.zeros_like(logp))
    return -(safe.exp() * finite * safe).sum(-1)


def lag_stats(token_versions: torch.Tensor, mask: torch.Tensor, version: int) -> dict[str, float]:
    """Policy lag of the trained tokens: ``version - token_version`` (0 = generated by the current weights)."""
    sel = token_versions[mask > 0]
    if sel.numel() == 0:
        return {"token_lag_mean": 0.0, "token_lag_max": 0.0, "stale_token_frac": 0.0}
    lag = (version - sel).double()
    return {
        "token_lag_mean": float(lag.mean()),
        "token_lag_max": float(lag.max()),
        "stale_token_frac": float((lag > 0).double().mean()),
    }


class LossSettings(Protocol):
    """The loss fields both trainers' configs have (read only)."""

    @property
    def loss(self) -> str: ...
    @property
    def clip_eps(self) -> float: ...
    @property
    def clip_eps_high(self) -> float | None: ...
    @property
    def tis_cap(self) -> float | None: ...
    @property
    def tis_mode(self) -> TisMode: ...
    @property
    def kl_coef(self) -> float: ...
    @property
    def kl_estimator(self) -> KlEstimator: ...


def policy_loss(
    logp: torch.Tensor,
    logits: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    settings: LossSettings,
    *,
    n: torch.Tensor | float,
    entropy_coef: float,
    proximal_logp: torch.Tensor | None = None,
    versions: torch.Tensor | None = None,
    version: int = 0,
    ref_logp: torch.Tensor | None = None,
    entropy_stats: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One micro-batch's loss: :func:`decoupled_ppo_loss` (truncated importance weights only when
    ``settings.loss`` is ``decoupled_ppo``), minus ``entropy_coef`` × the mean entropy, plus
    ``kl_coef`` × the KL penalty against ``ref_logp`` (default: the behaviour policy). Tokens whose
    ``versions`` equal the trainer's ``version`` use their behaviour logprob as the proximal one (the
    current weights sampled them). Returns the loss and its statistics (``pg_loss``, ``entropy``,
    ``kl``, ``loss`` and :func:`decoupled_ppo_loss`'s), each a mean over ``n`` tokens.
    ``entropy_stats`` False: no entropy statistic without an entropy bonus (it costs a float32 copy
    of the logits, large for big vocabularies)."""
    proximal = behaviour_logp
    if proximal_logp is not None:
        if versions is None:
            raise ValueError("proximal_logp needs the tokens' versions")
        proximal = torch.where(versions == version, behaviour_logp, proximal_logp)
    pg, stats = decoupled_ppo_loss(
        logp,
        proximal,
        behaviour_logp,
        advantages,
        mask,
        clip_eps=settings.clip_eps,
        clip_eps_high=settings.clip_eps_high,
        tis_cap=settings.tis_cap if settings.loss == "decoupled_ppo" else None,
        tis_mode=settings.tis_mode,
        n=n,
    )
    loss = pg
    stats["pg_loss"] = pg.detach()
    if entropy_coef > 0:
        entropy = entropy_from_logits(logits)
        loss = loss - entropy_coef * masked_mean(entropy, mask, n)
        stats["entropy"] = masked_mean(entropy.detach(), mask, n)
    elif entropy_stats:
        with torch.no_grad():
            stats["entropy"] = masked_mean(entropy_from_logits(logits), mask, n)
    if settings.kl_coef > 0:
        kl = kl_penalty(logp, behaviour_logp if ref_logp is None else ref_logp, settings.kl_estimator)
        loss = loss + settings.kl_coef * masked_mean(kl, mask, n)
        stats["kl"] = masked_mean(kl.detach(), mask, n)
    else:
        stats["kl"] = torch.zeros(())
    stats["loss"] = loss.detach()
    return loss, stats
