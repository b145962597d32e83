"""Off-policy losses (decoupled PPO, truncated IS), KL estimators, entropy, lag stats and the learning-rate
schedule, each against a float64 reference written token by token here."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rollart_train.losses import (
    behaviour_weights,
    decoupled_ppo_loss,
    entropy_from_logits,
    kl_penalty,
    lag_stats,
    ppo_clip_loss,
)
from rollart_train.torch_config import TorchTrainerConfig, lr_factor


def inputs(seed: int, shape=(5, 11)):
    g = torch.Generator().manual_seed(seed)
    blp = -torch.rand(shape, generator=g, dtype=torch.float64) * 3
    prox = blp + (torch.rand(shape, generator=g, dtype=torch.float64) * 2.0 - 0.6)  # weights in [0.55, 4.1]
    logp = prox + (torch.rand(shape, generator=g, dtype=torch.float64) * 1.4 - 0.7)
    adv = torch.randn(shape, generator=g, dtype=torch.float64)
    mask = (torch.rand(shape, generator=g, dtype=torch.float64) < 0.75).double()
    return logp, prox, blp, adv, mask


def ref_decoupled(logp, prox, blp, adv, mask, clip_eps, hi, cap, mode):
    logp, prox, blp, adv, mask = (np.asarray(x, dtype=np.float64) for x in (logp, prox, blp, adv, mask))
    n = max(mask.sum(), 1.0)
    total = clipped = kl = wsum = capped = 0.0
    grad = np.zeros_like(logp)
    for i in np.ndindex(logp.shape):
        r = math.exp(logp[i] - prox[i])
        w = math.exp(prox[i] - blp[i])
        is_capped = cap is not None and w > cap
        if is_capped:
            w = cap if mode == "truncate" else 0.0
        a = adv[i]
        rc = min(max(r, 1 - clip_eps), 1 + hi)
        total += -w * min(r * a, rc * a) * mask[i]
        clipped += (r < 1 - clip_eps or r > 1 + hi) * mask[i]
        kl += (prox[i] - logp[i]) * mask[i]
        wsum += w * mask[i]
        capped += is_capped * mask[i]
        if r * a <= rc * a:
            grad[i] = -w * a * r * mask[i] / n
    return total / n, clipped / n, kl / n, wsum / n, capped / n, grad


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("cap,mode", [(None, "truncate"), (2.0, "truncate"), (1.5, "mask"), (3.0, "mask")])
@pytest.mark.parametrize("clip_eps,clip_eps_high", [(0.2, None), (0.2, 0.28)])
def test_decoupled_ppo_matches_reference(seed, cap, mode, clip_eps, clip_eps_high) -> None:
    logp, prox, blp, adv, mask = inputs(seed)
    w = torch.exp(prox - blp)
    if cap is not None:  # the cap is really exercised on masked tokens
        assert ((w > cap) & (mask > 0)).any() and ((w <= cap) & (mask > 0)).any()
    logp = logp.clone().requires_grad_(True)
    loss, st = decoupled_ppo_loss(
        logp, prox, blp, adv, mask, clip_eps=clip_eps, clip_eps_high=clip_eps_high, tis_cap=cap, tis_mode=mode
    )
    hi = clip_eps if clip_eps_high is None else clip_eps_high
    r_loss, r_clip, r_kl, r_w, r_capped, r_grad = ref_decoupled(
        logp.detach(), prox, blp, adv, mask, clip_eps, hi, cap, mode
    )
    assert float(loss) == pytest.approx(r_loss, rel=1e-12, abs=1e-12)
    assert float(st["clip_frac"]) == pytest.approx(r_clip, abs=1e-12)
    assert float(st["approx_kl"]) == pytest.approx(r_kl, rel=1e-12, abs=1e-12)
    assert float(st["behav_weight"]) == pytest.approx(r_w, rel=1e-12)
    assert float(st["tis_capped_frac"]) == pytest.approx(r_capped, abs=1e-12)
    loss.backward()
    np.testing.assert_allclose(logp.grad.numpy(), r_grad, rtol=1e-10, atol=1e-13)


def test_decoupled_ppo_reduces_to_ppo_clip_when_proximal_is_behaviour() -> None:
    logp, _, blp, adv, mask = inputs(3)
    a, _ = decoupled_ppo_loss(logp, blp, blp, adv, mask, tis_cap=1.0)
    b, _ = ppo_clip_loss(logp, blp, adv, mask)
    assert float(a) == pytest.approx(float(b), rel=1e-14)


def test_decoupled_ppo_explicit_token_count_and_no_grad_through_proximal() -> None:
    logp, prox, blp, adv, mask = inputs(4)
    prox = prox.clone().requires_grad_(True)
    full, _ = decoupled_ppo_loss(logp, prox, blp, adv, mask)
    half, _ = decoupled_ppo_loss(logp, prox, blp, adv, mask, n=2 * float(mask.sum()))
    assert float(half) == pytest.approx(float(full) / 2, rel=1e-12)
    assert not full.requires_grad  # neither proximal nor behaviour logprobs carry gradient


def test_behaviour_weights_modes() -> None:
    prox = torch.tensor([0.0, 1.0, 2.0], dtype=torch.float64)
    blp = torch.zeros(3, dtype=torch.float64)
    w, capped = behaviour_weights(prox, blp, cap=2.0)
    np.testing.assert_allclose(w.numpy(), [1.0, 2.0, 2.0])
    assert capped.tolist() == [False, True, True]
    w, _ = behaviour_weights(prox, blp, cap=2.0, mode="mask")
    np.testing.assert_allclose(w.numpy(), [1.0, 0.0, 0.0])
    w, capped = behaviour_weights(prox, blp, cap=None)
    np.testing.assert_allclose(w.numpy(), np.exp([0.0, 1.0, 2.0]), rtol=1e-15)
    assert not capped.any()
    with pytest.raises(ValueError, match="TIS mode"):
        behaviour_weights(prox, blp, cap=1.0, mode="clip")  # type: ignore[arg-type]


def ref_kl(logp: float, ref: float, est: str) -> tuple[float, float]:
    """Value and d/dlogp in float64."""
    d = logp - ref
    if est == "k1":
        return d, 1.0
    if est == "k2":
        return 0.5 * d * d, d
    return math.exp(-d) + d - 1.0, -math.exp(-d) + 1.0


@pytest.mark.parametrize("est", ["k1", "k2", "k3"])
def test_kl_estimators_match_reference(est: str) -> None:
    g = torch.Generator().manual_seed(5)
    logp = (-torch.rand(40, generator=g, dtype=torch.float64) * 4).requires_grad_(True)
    ref = -torch.rand(40, generator=g, dtype=torch.float64) * 4
    got = kl_penalty(logp, ref, est)  # type: ignore[arg-type]
    got.sum().backward()
    for i in range(40):
        v, dv = ref_kl(float(logp[i]), float(ref[i]), est)
        assert float(got[i]) == pytest.approx(v, rel=1e-12, abs=1e-14)
        assert float(logp.grad[i]) == pytest.approx(dv, rel=1e-12, abs=1e-14)
    if est == "k3":
        assert (got >= 0).all()
    assert torch.equal(kl_penalty(ref, ref, est), torch.zeros_like(ref))  # type: ignore[arg-type]


def test_kl_estimators_are_unbiased_or_biased_as_documented() -> None:
    # sample from p, estimate KL(p||q) for two categoricals; k1 and k3 are unbiased, k2 is not exact
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    exact = float((p * (p / q).log()).sum())
    lp, lq = p.log(), q.log()
    for est in ("k1", "k3"):  # exact expectation over the support
        expect = float((p * kl_penalty(lp, lq, est)).sum())  # type: ignore[arg-type]
        assert expect == pytest.approx(exact, rel=1e-12)
    assert float((p * kl_penalty(lp, lq, "k2")).sum()) != pytest.approx(exact, rel=1e-3)
    with pytest.raises(ValueError, match="KL estimator"):
        kl_penalty(lp, lq, "k4")  # type: ignore[arg-type]


def test_entropy_matches_reference_with_restricted_logits() -> None:
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(6, 13, generator=g, dtype=torch.float64) * 3
    logits[2, [0, 4, 7]] = float("-inf")  # an allowed-token restriction
    logits[5, 1:] = float("-inf")  # a single allowed token: entropy 0
    got = entropy_from_logits(logits)
    assert got.dtype == torch.float32
    for r in range(6):
        row = [x for x in logits[r].tolist() if x != float("-inf")]
        m = max(row)
        z = sum(math.exp(x - m) for x in row)
        ps = [math.exp(x - m) / z for x in row]
        ent = -sum(p * math.log(p) for p in ps if p > 0)
        assert float(got[r]) == pytest.approx(ent, abs=1e-5)
    assert float(got[5]) == 0.0 and torch.isfinite(got).all()


def test_entropy_gradient_is_finite_and_exact_with_restricted_logits() -> None:
    # an entropy bonus on allowed-token-restricted logits must not produce nan gradients (which
    # make the trainer skip every optimiser step); reference: dH/dz_i = -p_i (log p_i + H) on the support
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(3, 9, generator=g, dtype=torch.float64) * 2
    logits[:, [1, 2, 5, 8]] = float("-inf")
    logits[2, [0, 3, 4, 6]] = float("-inf")  # one allowed token left: H = 0, gradient 0
    logits.requires_grad_(True)
    entropy_from_logits(logits).sum().backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()
    for r in range(3):
        row = logits[r].detach()
        keep = torch.isfinite(row)
        p = torch.softmax(row[keep], -1)
        h = -(p * p.log()).sum()
        exp = torch.zeros_like(row)
        exp[keep] = -p * (p.log() + h)
        torch.testing.assert_close(logits.grad[r], exp, rtol=1e-5, atol=1e-6)


def test_lag_stats() -> None:
    versions = torch.tensor([3, 3, 2, 0, 1, 3])
    mask = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 0.0])
    st = lag_stats(versions, mask, version=3)
    assert st == {"token_lag_mean": pytest.approx(1.0), "token_lag_max": 3.0, "stale_token_frac": 0.5}
    assert lag_stats(versions, torch.zeros(6), 3)["token_lag_max"] == 0.0


def test_lr_schedules() -> None:
    const = TorchTrainerConfig()
    assert [lr_factor(const, s) for s in range(3)] == [1.0, 1.0, 1.0]
    warm = TorchTrainerConfig(warmup_steps=4)
    assert [lr_factor(warm, s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    cos = TorchTrainerConfig(lr_schedule="cosine", warmup_steps=2, total_steps=12, min_lr_ratio=0.1)
    for s in range(16):
        if s < 2:
            exp = (s + 1) / 2
        else:
            prog = min((s - 2) / 10, 1.0)
            exp = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * prog))
        assert lr_factor(cos, s) == pytest.approx(exp, rel=1e-12)
    lin = TorchTrainerConfig(lr_schedule="linear", total_steps=4)
    assert [lr_factor(lin, s) for s in range(6)] == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0, 0.0])


@pytest.mark.parametrize(
    "bad",
    [
        {"tis_cap": 2.0},  # needs decoupled_ppo
        {"lr_schedule": "cosine"},  # needs total_steps
        {"warmup_steps": 5, "total_steps": 3},
        {"ref_model_path": "/x"},  # unused without kl_coef
        {"loss": "grpo"},
        {"micro_batch_tokens": 0},
        {"unknown": 1},
    ],
)
def test_config_rejects_bad_input(bad) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        TorchTrainerConfig(**bad)


@pytest.mark.parametrize("loss", ["ppo_clip", "decoupled_ppo"])
@pytest.mark.parametrize(("entropy_coef", "kl_coef"), [(0.0, 0.0), (0.05, 0.1)])
def test_policy_loss_assembles_ppo_entropy_and_kl_token_by_token(
    loss: str, entropy_coef: float, kl_coef: float
) -> None:
    """policy_loss (both trainers' micro-batch loss) against the terms written out here: tokens of the
    trainer's own version take their behaviour logprob as proximal, the rest the recomputed one."""
    from rollart_train.losses import policy_loss

    logp, prox, blp, adv, mask = inputs(7)
    g = torch.Generator().manual_seed(8)
    logits = torch.randn((*logp.shape, 6), generator=g, dtype=torch.float64)
    ref = blp - 0.3
    versions = torch.randint(0, 2, logp.shape, generator=g)  # version 1 = the trainer's own
    n = float(mask.sum()) + 3.0  # a global count larger than this micro-batch's
    decoupled = loss == "decoupled_ppo"
    cfg = TorchTrainerConfig(
        loss=loss, clip_eps=0.2, clip_eps_high=0.28, tis_cap=2.0 if decoupled else None, kl_coef=kl_coef
    )
    # the trainers recompute proximal logprobs only for decoupled PPO
    got, stats = policy_loss(
        logp, logits, blp, adv, mask, cfg, n=n, entropy_coef=entropy_coef,
        proximal_logp=prox if decoupled else None, versions=versions, version=1, ref_logp=ref,
    )  # fmt: skip
    total, ent_sum, kl_sum = 0.0, 0.0, 0.0
    for i, j in zip(*torch.nonzero(mask, as_tuple=True), strict=True):
        own = int(versions[i, j]) == 1 or not decoupled
        p = float(blp[i, j]) if own else float(prox[i, j])
        w = min(math.exp(p - float(blp[i, j])), 2.0)
        r = math.exp(float(logp[i, j]) - p)
        a = float(adv[i, j])
        total += -w * min(r * a, min(max(r, 0.8), 1.28) * a)
        probs = torch.softmax(logits[i, j], -1)
        ent_sum += float(-(probs * torch.log(probs)).sum())
        d = float(ref[i, j]) - float(logp[i, j])
        kl_sum += math.exp(d) - d - 1.0  # k3
    want = total / n - entropy_coef * ent_sum / n + kl_coef * kl_sum / n
    # entropy is computed in float32 (entropy_from_logits), the rest in float64
    assert float(got) == pytest.approx(want, rel=1e-6, abs=1e-9)
    assert float(stats["pg_loss"]) == pytest.approx(total / n, rel=1e-9, abs=1e-12)
    assert float(stats["entropy"]) == pytest.approx(ent_sum / n, rel=1e-6)
    assert float(stats["kl"]) == pytest.approx(kl_sum / n if kl_coef else 0.0, rel=1e-9, abs=1e-12)
    with pytest.raises(ValueError, match="versions"):
        policy_loss(logp, logits, blp, adv, mask, cfg, n=n, entropy_coef=0.0, proximal_logp=prox)
