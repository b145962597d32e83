"""RL losses checked against float64 reference implementations written here in numpy / Python."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rollart_core.types import Trajectory, Turn
from rollart_train.losses import (
    grpo_advantages,
    ppo_clip_loss,
    step_advantages,
    token_logprobs,
    trajectory_mean_weights,
)


def traj(group: str, reward: float, i: int = 0) -> Trajectory:
    return Trajectory(
        traj_id=f"{group}-{i}", task="t", env_id="e", group_id=group, seed=i, start_version=0, reward=reward
    )


# references -------------------------------------------------------------------------------------


def ref_grpo(groups: list[str], rewards: list[float], scale_by_std: bool, eps: float = 1e-6) -> list[float]:
    out = [0.0] * len(rewards)
    for g in set(groups):
        idx = [i for i, gg in enumerate(groups) if gg == g]
        r = np.array([rewards[i] for i in idx], dtype=np.float64)
        mean = sum(r) / len(r)
        centred = [x - mean for x in r]
        if scale_by_std and len(idx) > 1:
            std = math.sqrt(sum(c * c for c in centred) / len(r))  # population std
            centred = [c / (std + eps) for c in centred]
        for j, i in enumerate(idx):
            out[i] = float(centred[j])
    return out


def ref_token_logprobs(logits: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    logits = logits.astype(np.float64)
    b, t, _ = logits.shape
    out = np.zeros((b, t - 1), dtype=np.float64)
    for bi in range(b):
        for i in range(1, t):
            row = logits[bi, i - 1]
            m = row.max()
            lse = m + math.log(np.exp(row - m).sum())
            out[bi, i - 1] = row[tokens[bi, i]] - lse
    return out


def ref_ppo(logp, blp, adv, mask, clip_eps, clip_eps_high=None):
    """Returns (loss, clip_frac, approx_kl, dloss/dlogp) computed token by token in float64."""
    hi = clip_eps if clip_eps_high is None else clip_eps_high
    logp, blp, adv, mask = (np.asarray(x, dtype=np.float64) for x in (logp, blp, adv, mask))
    n = max(mask.sum(), 1.0)
    total = clipped_count = kl = 0.0
    grad = np.zeros_like(logp)
    for idx in np.ndindex(logp.shape):
        r = math.exp(logp[idx] - blp[idx])
        a = adv[idx]
        rc = min(max(r, 1 - clip_eps), 1 + hi)
        surr_unclipped, surr_clipped = r * a, rc * a
        total += -min(surr_unclipped, surr_clipped) * mask[idx]
        if r < 1 - clip_eps or r > 1 + hi:
            clipped_count += mask[idx]
        kl += (blp[idx] - logp[idx]) * mask[idx]
        # gradient flows only through the unclipped term when it is the smaller one
        if surr_unclipped <= surr_clipped:
            grad[idx] = -a * r * mask[idx] / n
    return total / n, clipped_count / n, kl / n, grad


# grpo_advantages --------------------------------------------------------------------------------


@pytest.mark.parametrize("scale_by_std", [True, False])
def test_grpo_advantages_groups_of_different_sizes(scale_by_std: bool) -> None:
    rng = np.random.default_rng(0)
    # interleaved groups of sizes 1, 2, 3, 5 and 8
    sizes = {"a": 1, "b": 2, "c": 3, "d": 5, "e": 8}
    groups = [g for g, n in sizes.items() for _ in range(n)]
    rng.shuffle(groups)
    groups = list(groups)
    rewards = list(rng.normal(size=len(groups)) * 3 + 1)
    batch = [traj(g, r, i) for i, (g, r) in enumerate(zip(groups, rewards, strict=True))]
    got = grpo_advantages(batch, scale_by_std=scale_by_std)
    exp = ref_grpo(groups, rewards, scale_by_std)
    assert len(got) == len(batch)
    np.testing.assert_allclose(got, exp, rtol=1e-12, atol=1e-12)
    # per group: advantages sum to zero
    for g in sizes:
        assert abs(sum(a for a, gg in zip(got, groups, strict=True) if gg == g)) < 1e-9


def test_grpo_advantages_scaled_have_unit_population_std() -> None:
    rewards = [0.0, 1.0, 1.0, 0.0, 1.0, 3.0]
    got = np.array(grpo_advantages([traj("g", r, i) for i, r in enumerate(rewards)]))
    assert abs(got.mean()) < 1e-12
    assert abs(got.std() - 1.0) < 1e-5  # eps=1e-6 in the denominator


def test_grpo_advantages_all_equal_rewards_give_zeros() -> None:
    batch = [traj("same", 0.7, i) for i in range(4)] + [traj("other", 0.0, 9), traj("other", 1.0, 10)]
    got = grpo_advantages(batch)
    assert got[:4] == [0.0, 0.0, 0.0, 0.0]
    assert got[4] < 0 < got[5]
    got_unscaled = grpo_advantages(batch, scale_by_std=False)
    assert got_unscaled[:4] == [0.0, 0.0, 0.0, 0.0]
    assert got_unscaled[4:] == [-0.5, 0.5]


def test_grpo_advantages_unscaled_is_mean_centred_only() -> None:
    rewards = [1.0, 2.0, 6.0]
    got = grpo_advantages([traj("g", r, i) for i, r in enumerate(rewards)], scale_by_std=False)
    assert got == pytest.approx([-2.0, -1.0, 3.0], abs=1e-12)


def test_grpo_advantages_singleton_group_is_zero() -> None:
    assert grpo_advantages([traj("solo", 5.0)]) == [0.0]
    assert grpo_advantages([traj("solo", 5.0)], scale_by_std=False) == [0.0]


def test_grpo_advantages_empty() -> None:
    assert grpo_advantages([]) == []


# step_advantages (GiGPO) ---------------------------------------------------------------------------


def episode(group: str, reward: float, states: list[int], i: int) -> Trajectory:
    """A trajectory whose turn k observed state ``states[k]`` (the state is the turn's context)."""
    t = traj(group, reward, i)
    t.turns = [Turn(context_ids=[100, s], output_ids=[7]) for s in states]
    return t


def ref_step(
    batch: list[tuple[str, float, list[int]]], gamma: float, w: float, scale: bool, eps: float = 1e-6
) -> list[list[float]]:
    """Episode GRPO + w * (discounted return - mean of the same-state turns of the group) / std."""
    ep = ref_grpo([g for g, _, _ in batch], [r for _, r, _ in batch], scale)
    out = [[ep[i]] * len(states) for i, (_, _, states) in enumerate(batch)]
    keys = {(g, s) for g, _, states in batch for s in states}
    for key in keys:
        members = [
            (i, k, r * gamma ** (len(states) - 1 - k))
            for i, (g, r, states) in enumerate(batch)
            for k, s in enumerate(states)
            if (g, s) == key
        ]
        if len(members) < 2:
            continue
        mean = sum(m[2] for m in members) / len(members)
        std = math.sqrt(sum((m[2] - mean) ** 2 for m in members) / len(members))
        for i, k, ret in members:
            out[i][k] += w * ((ret - mean) / (std + eps) if scale else ret - mean)
    return out


@pytest.mark.parametrize("gamma,w,scale", [(1.0, 1.0, True), (0.9, 1.0, True), (0.8, 0.5, False)])
def test_step_advantages_match_reference(gamma: float, w: float, scale: bool) -> None:
    rng = np.random.default_rng(1)
    batch = []
    for i in range(14):
        g = "ab"[i % 2]
        states = [0] + [int(x) for x in rng.integers(1, 5, size=int(rng.integers(0, 5)))]
        batch.append((g, float(rng.integers(0, 2)) * (1 + i % 3), states))
    got = step_advantages(
        [episode(g, r, s, i) for i, (g, r, s) in enumerate(batch)],
        gamma=gamma,
        step_weight=w,
        scale_by_std=scale,
    )
    exp = ref_step(batch, gamma, w, scale)
    assert [len(a) for a in got] == [len(s) for _, _, s in batch]
    for a, e in zip(got, exp, strict=True):
        np.testing.assert_allclose(a, e, rtol=1e-12, atol=1e-12)


def test_step_advantages_separate_good_and_bad_actions_from_one_state() -> None:
    # both episodes reach state 5 at turn 1; from there one succeeds and one fails: each shared
    # state adds +-1 to the episode's +-1, and a state visited once (9) gets no step term
    ok = episode("g", 1.0, [0, 5], 0)
    bad = episode("g", 0.0, [0, 5, 9], 1)
    adv = step_advantages([ok, bad], gamma=0.9)
    assert adv[0] == pytest.approx([2.0, 2.0], abs=1e-4)
    assert adv[1] == pytest.approx([-2.0, -2.0, -1.0], abs=1e-4)
    # the same state in another group is a different step group
    other = episode("h", 0.0, [0, 5], 2)
    assert step_advantages([ok, bad, other], gamma=0.9)[:2] == adv


# token_logprobs ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs_matches_numpy_log_softmax_gather(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    b, t, v = 3, 7, 11
    logits = (torch.randn(b, t, v, generator=g) * 4).to(dtype)
    tokens = torch.randint(0, v, (b, t), generator=g)
    got = token_logprobs(logits, tokens)
    assert got.shape == (b, t - 1)
    assert got.dtype == torch.float32
    exp = ref_token_logprobs(logits.float().numpy(), tokens.numpy())
    np.testing.assert_allclose(got.double().numpy(), exp, rtol=0, atol=1e-5)
    assert (got <= 0).all()


def test_token_logprobs_first_token_not_scored() -> None:
    # changing the first token changes nothing; changing the last logits row changes nothing
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(1, 5, 9, generator=g)
    tokens = torch.randint(0, 9, (1, 5), generator=g)
    base = token_logprobs(logits, tokens)
    t2 = tokens.clone()
    t2[0, 0] = (t2[0, 0] + 1) % 9
    l2 = logits.clone()
    l2[0, -1] += 100.0
    assert torch.equal(token_logprobs(logits, t2), base)
    assert torch.equal(token_logprobs(l2, tokens), base)


def test_token_logprobs_gradient_flows() -> None:
    logits = torch.randn(2, 4, 5, requires_grad=True)
    tokens = torch.randint(0, 5, (2, 4))
    token_logprobs(logits, tokens).sum().backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0
    assert torch.all(logits.grad[:, -1] == 0)


# ppo_clip_loss ----------------------------------------------------------------------------------


def random_ppo_inputs(seed: int, shape=(4, 9), dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    blp = -torch.rand(shape, generator=g, dtype=dtype) * 3
    # log-ratios in [-0.7, 0.7] → ratios in [0.50, 2.01]: many outside any clip range used here
    logp = blp + (torch.rand(shape, generator=g, dtype=dtype) * 1.4 - 0.7)
    adv = torch.randn(shape, generator=g, dtype=dtype)
    mask = (torch.rand(shape, generator=g, dtype=dtype) < 0.7).to(dtype)
    return logp, blp, adv, mask


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("clip_eps,clip_eps_high", [(0.2, None), (0.2, 0.28), (0.1, 0.5), (0.3, 0.05)])
def test_ppo_clip_loss_matches_reference(seed: int, clip_eps: float, clip_eps_high: float | None) -> None:
    logp, blp, adv, mask = random_ppo_inputs(seed)
    ratio = torch.exp(logp - blp)
    hi = clip_eps if clip_eps_high is None else clip_eps_high
    # the inputs really do exercise both clip boundaries on masked tokens
    assert ((ratio > 1 + hi) & (mask > 0)).any() and ((ratio < 1 - clip_eps) & (mask > 0)).any()
    logp = logp.clone().requires_grad_(True)
    loss, info = ppo_clip_loss(logp, blp, adv, mask, clip_eps=clip_eps, clip_eps_high=clip_eps_high)
    ref_loss, ref_frac, ref_kl, ref_grad = ref_ppo(
        logp.detach().numpy(), blp.numpy(), adv.numpy(), mask.numpy(), clip_eps, clip_eps_high
    )
    assert loss.dim() == 0
    assert float(loss) == pytest.approx(ref_loss, rel=1e-12, abs=1e-12)
    assert info["clip_frac"] == pytest.approx(ref_frac, rel=1e-12, abs=1e-12)
    assert info["approx_kl"] == pytest.approx(ref_kl, rel=1e-12, abs=1e-12)
    loss.backward()
    np.testing.assert_allclose(logp.grad.numpy(), ref_grad, rtol=1e-10, atol=1e-12)


def test_ppo_clip_loss_float32_close_to_float64_reference() -> None:
    logp, blp, adv, mask = random_ppo_inputs(7, shape=(8, 33))
    loss, info = ppo_clip_loss(
        logp.float(), blp.float(), adv.float(), mask.float(), clip_eps=0.2, clip_eps_high=0.28
    )
    ref_loss, ref_frac, _, _ = ref_ppo(logp.numpy(), blp.numpy(), adv.numpy(), mask.numpy(), 0.2, 0.28)
    assert float(loss) == pytest.approx(ref_loss, abs=1e-5)
    assert info["clip_frac"] == pytest.approx(ref_frac, abs=1e-6)


def test_ppo_clip_loss_asymmetric_clip_changes_result() -> None:
    # ratio 1.25 with a positive advantage: clipped at 1.2 symmetrically, free under clip_eps_high=0.28
    blp = torch.zeros(1, 1, dtype=torch.float64)
    logp = torch.full((1, 1), math.log(1.25), dtype=torch.float64)
    adv = torch.ones(1, 1, dtype=torch.float64)
    mask = torch.ones(1, 1, dtype=torch.float64)
    sym, sym_info = ppo_clip_loss(logp, blp, adv, mask, clip_eps=0.2)
    asym, asym_info = ppo_clip_loss(logp, blp, adv, mask, clip_eps=0.2, clip_eps_high=0.28)
    assert float(sym) == pytest.approx(-1.2, abs=1e-12)
    assert float(asym) == pytest.approx(-1.25, abs=1e-12)
    assert sym_info["clip_frac"] == 1.0 and asym_info["clip_frac"] == 0.0
    # the lower bound still uses clip_eps: ratio 0.75 with a negative advantage
    logp_low = torch.full((1, 1), math.log(0.75), dtype=torch.float64)
    low, _ = ppo_clip_loss(logp_low, blp, -adv, mask, clip_eps=0.2, clip_eps_high=0.28)
    assert float(low) == pytest.approx(0.8, abs=1e-12)  # -min(-0.75, -0.8) = 0.8


def test_ppo_clip_loss_masked_tokens_do_not_matter() -> None:
    logp, blp, adv, mask = random_ppo_inputs(3)
    loss, info = ppo_clip_loss(logp, blp, adv, mask)
    garbage = (1 - mask) * 1e3
    loss2, info2 = ppo_clip_loss(logp + garbage * 0.01, blp, adv + garbage, mask)
    assert float(loss2) == pytest.approx(float(loss), rel=1e-12)
    assert info2["clip_frac"] == pytest.approx(info["clip_frac"], rel=1e-12)


def test_ppo_clip_loss_ratio_one_is_vanilla_policy_gradient() -> None:
    logp, _, adv, mask = random_ppo_inputs(4)
    logp = logp.clone().requires_grad_(True)
    loss, info = ppo_clip_loss(logp, logp.detach(), adv, mask)
    n = float(mask.sum())
    assert float(loss) == pytest.approx(-float((adv * mask).sum()) / n, rel=1e-12)
    assert info["clip_frac"] == 0.0
    assert info["approx_kl"] == 0.0
    loss.backward()
    np.testing.assert_allclose(logp.grad.numpy(), (-adv * mask / n).numpy(), rtol=1e-12, atol=1e-15)


def test_ppo_clip_loss_clip_frac_counts_masked_tokens_outside_range() -> None:
    ratios = torch.tensor([[0.5, 0.79, 0.81, 1.0, 1.19, 1.21, 2.0, 3.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 0]], dtype=torch.float64)
    blp = torch.zeros_like(ratios)
    _, info = ppo_clip_loss(ratios.log(), blp, torch.ones_like(ratios), mask, clip_eps=0.2)
    # outside [0.8, 1.2] among the 7 masked tokens: 0.5, 0.79, 1.21, 2.0
    assert info["clip_frac"] == pytest.approx(4 / 7, abs=1e-12)
    _, info = ppo_clip_loss(ratios.log(), blp, torch.ones_like(ratios), mask, clip_eps=0.2, clip_eps_high=1.5)
    # outside [0.8, 2.5]: 0.5, 0.79
    assert info["clip_frac"] == pytest.approx(2 / 7, abs=1e-12)


def test_ppo_clip_loss_empty_mask_is_zero_not_nan() -> None:
    logp, blp, adv, mask = random_ppo_inputs(5)
    loss, info = ppo_clip_loss(logp, blp, adv, torch.zeros_like(mask))
    assert float(loss) == 0.0
    assert info["clip_frac"] == 0.0 and info["approx_kl"] == 0.0


def test_trajectory_mean_weights_share_each_trajectory_equally() -> None:
    counts = [12, 1, 3, 0]  # a 12-token episode, a one-token tool call, a 3-token one, nothing to train
    w = trajectory_mean_weights(counts)
    shares = [n * x for n, x in zip(counts, w, strict=True)]
    assert shares[:3] == pytest.approx([16 / 3] * 3)  # the same share each, summing to the 16 tokens
    assert sum(shares) == pytest.approx(16) and w[3] == 1.0
    assert trajectory_mean_weights([4, 4]) == [1.0, 1.0]  # equal lengths: the token mean
