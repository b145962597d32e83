"""One-rank TorchTrainer features on the tiny model: token-level packing, gradient accumulation,
the decoupled objective and per-token versions, KL / entropy terms, mixed precision, checkpoint resume."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from rollart_core.errors import TrainerError
from rollart_core.types import Trajectory, Turn
from rollart_train import TorchTrainer, TorchTrainerConfig
from rollart_train._attention import SEGMENT_ATTENTION
from rollart_train._packing import SeqData, assign_bins, build_micro_batch, pack_bins
from rollart_train.tiny import create_tiny_model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return create_tiny_model(tmp_path_factory.mktemp("tiny-pack") / "m")


@pytest.fixture(scope="module")
def ref(tiny_model) -> TorchTrainer:
    """Never trained: gives behaviour logprobs (version 0 weights)."""
    return TorchTrainer(TorchTrainerConfig(), model_path=tiny_model)


def make_batch(
    ref: TorchTrainer,
    n: int = 6,
    seed: int = 3,
    version: int = 0,
    shift: float = 0.0,
    allowed: tuple[int, ...] | None = None,
    temperature: float = 1.0,
) -> list[Trajectory]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        turns, prefix = [], []
        for _ in range(1 + i % 2):  # one or two turns
            ctx = torch.randint(3, 400, (int(torch.randint(2, 10, (1,), generator=g)),), generator=g).tolist()
            pool = allowed or tuple(range(3, 400))
            gen = [
                pool[int(k)]
                for k in torch.randint(
                    0, len(pool), (int(torch.randint(1, 6, (1,), generator=g)),), generator=g
                )
            ]
            prefix += ctx + gen
            if allowed is None and temperature == 1.0:
                lps = ref.logprobs(prefix)[-len(gen) :]
            else:
                lps = [0.0] * len(gen)  # filled in by the test when it matters
            turns.append(
                Turn(
                    context_ids=ctx,
                    output_ids=gen,
                    output_logprobs=[x - shift for x in lps],
                    output_versions=[version] * len(gen),
                    allowed_token_ids=allowed,
                    temperature=temperature,
                )
            )
        out.append(
            Trajectory(
                traj_id=f"t{i}",
                task="t",
                env_id="e",
                group_id=f"g{i % 2}",
                seed=i,
                start_version=0,
                turns=turns,
                reward=float(i % 3),
            )
        )
    return out


def step_weights(tiny_model, batch, **cfg) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    trainer = TorchTrainer(TorchTrainerConfig(lr=1e-3, **cfg), model_path=tiny_model)
    m = trainer.train_step(batch)
    return {n: w.clone() for n, w in trainer.named_weights()}, m


def assert_same_weights(a, b, atol=5e-5, mean_atol=2e-7) -> None:
    """Equal up to float noise. Adam's first step is ~lr·sign(g): an element whose gradient is
    ~1e-8 can move by a visible fraction of lr (1e-3 here) under a different summation order, so
    the bound on single elements is 5% of one step, and the mean difference must be tiny."""
    assert set(a) == set(b)
    for n in a:
        d = (a[n] - b[n]).abs()
        assert float(d.max()) <= atol, (n, float(d.max()))
        assert float(d.mean()) <= mean_atol, (n, float(d.mean()))


# packing ----------------------------------------------------------------------------------------


def test_pack_bins_respects_budget_and_is_deterministic() -> None:
    lengths = [5, 17, 3, 9, 30, 2, 8, 8]
    bins = pack_bins(lengths, 20, max_seqs=3)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    for b in bins:
        assert len(b) <= 3
        assert sum(lengths[i] for i in b) <= 20 or len(b) == 1  # 30 > budget: alone
    assert bins == pack_bins(lengths, 20, max_seqs=3)
    per_rank = assign_bins(bins, lengths, 2)
    assert sorted(map(tuple, per_rank[0] + per_rank[1])) == sorted(map(tuple, bins))


def test_packed_micro_batch_layout() -> None:
    seqs = [
        SeqData([1, 2, 3], [0, 1, 1], [0, -1.0, -2.0], [-1, 4, 4], 0.5),
        SeqData([7, 8], [0, 1], [0, -3.0], [-1, 5], -1.0),
    ]
    mb = build_micro_batch(
        seqs, [0, 1], select="loss", packed=True, pad_id=0, attn_impl="sdpa", mask_dtype=torch.float32
    )
    assert mb.input_ids.tolist() == [[1, 2, 3, 7, 8]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 0, 1]]
    assert mb.pred_index.tolist() == [0, 1, 3] and mb.targets.tolist() == [2, 3, 8]
    assert mb.versions.tolist() == [4, 4, 5] and mb.advantages.tolist() == [0.5, 0.5, -1.0]
    allowed = mb.attention_mask[0, 0]
    assert allowed.dtype == torch.bool
    assert allowed[3].tolist() == [False, False, False, True, False]  # seq 2 sees only itself
    assert allowed[2].tolist() == [True, True, True, False, False]


@pytest.mark.parametrize("layout", ["segments", "dense_mask"])
def test_packed_logprobs_equal_unpacked(ref, layout) -> None:
    worker = ref._local
    assert worker.attn_impl == SEGMENT_ATTENTION  # the default with packing
    batch = make_batch(ref, n=5)
    from rollart_train._packing import seq_data

    seqs = [seq_data(t, 0.0, False) for t in batch]
    packed = build_micro_batch(
        seqs,
        range(5),
        select="all",
        packed=True,
        pad_id=ref._local.pad_id,
        attn_impl=worker.attn_impl if layout == "segments" else "sdpa",
        mask_dtype=torch.float32,
    )
    assert (packed.cu_seqlens is not None) == (layout == "segments")
    assert (packed.attention_mask is None) == (layout == "segments")
    with torch.no_grad():
        lp = torch.log_softmax(worker._logits(worker.model, packed), -1).gather(-1, packed.targets[:, None])[
            :, 0
        ]
    padded = build_micro_batch(
        seqs,
        range(5),
        select="all",
        packed=False,
        pad_id=ref._local.pad_id,
        attn_impl=worker.attn_impl,
        mask_dtype=torch.float32,
    )
    with torch.no_grad():
        lp_pad = torch.log_softmax(worker._logits(worker.model, padded), -1).gather(
            -1, padded.targets[:, None]
        )[:, 0]
    k = 0
    for i, t in enumerate(batch):
        alone = ref.logprobs(t.token_ids())  # one sequence, no packing
        n = len(alone)
        assert packed.seq_index[k : k + n].tolist() == [i] * n
        torch.testing.assert_close(lp[k : k + n], torch.tensor(alone), rtol=0, atol=2e-5)
        torch.testing.assert_close(lp_pad[k : k + n], torch.tensor(alone), rtol=0, atol=2e-5)
        k += n
    assert k == lp.numel()


def test_packed_attention_does_not_cross_sequences(ref) -> None:
    worker = ref._local
    a = SeqData([5, 6, 7, 8], [1] * 4, [0.0] * 4, [0] * 4, 0.0)
    b = SeqData([9, 10, 11], [1] * 3, [0.0] * 3, [0] * 3, 0.0)
    b2 = SeqData([9, 10, 11], [1] * 3, [0.0] * 3, [0] * 3, 0.0)
    a2 = SeqData([300, 301, 302, 303], [1] * 4, [0.0] * 4, [0] * 4, 0.0)

    def lps(seqs):
        mb = build_micro_batch(
            seqs,
            [0, 1],
            select="all",
            packed=True,
            pad_id=0,
            attn_impl=worker.attn_impl,
            mask_dtype=torch.float32,
        )
        with torch.no_grad():
            return torch.log_softmax(worker._logits(worker.model, mb), -1).gather(-1, mb.targets[:, None])[
                :, 0
            ]

    # b's logprobs do not change when the sequence packed before it changes
    torch.testing.assert_close(lps([a, b])[3:], lps([a2, b2])[3:], rtol=0, atol=1e-6)


def test_segment_attention_matches_a_dense_mask_with_gqa_and_a_sliding_window() -> None:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from rollart_train._attention import segment_sdpa

    class Attn(torch.nn.Module):
        num_key_value_groups = 2
        is_causal = True

    g = torch.Generator().manual_seed(0)
    lengths = [5, 1, 9, 4]
    q = torch.randn(1, 4, sum(lengths), 8, generator=g)
    k, v = (torch.randn(1, 2, sum(lengths), 8, generator=g) for _ in range(2))
    cu = torch.tensor([0, 5, 6, 15, 19], dtype=torch.int32)
    seg = torch.repeat_interleave(torch.arange(4), torch.tensor(lengths))
    pos = torch.cat([torch.arange(n) for n in lengths])
    for window in (None, 3):
        allowed = (seg[:, None] == seg[None, :]) & (pos[:, None] >= pos[None, :])
        if window is not None:
            allowed &= pos[:, None] - pos[None, :] < window
        want, _ = sdpa_attention_forward(Attn(), q, k, v, allowed[None, None], sliding_window=window)
        got, _ = segment_sdpa(Attn(), q, k, v, None, cu_seq_lens_q=cu, sliding_window=window)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="does not cover"):
        segment_sdpa(Attn(), q, k, v, None, cu_seq_lens_q=cu[:-1])


def test_packed_and_padded_training_give_the_same_update(tiny_model, ref) -> None:
    batch = make_batch(ref)
    packed, mp = step_weights(tiny_model, batch, packing=True, micro_batch_tokens=40)
    padded, mq = step_weights(tiny_model, batch, packing=False, micro_batch_size=2)
    assert mp["micro_batches"] < mq["micro_batches"]  # packing needs fewer forward passes
    assert mp["loss"] == pytest.approx(mq["loss"], abs=1e-6)
    assert_same_weights(packed, padded)


def test_gradient_accumulation_matches_one_micro_batch(tiny_model, ref) -> None:
    batch = make_batch(ref)
    one, m1 = step_weights(tiny_model, batch, micro_batch_tokens=10_000)
    many, m2 = step_weights(tiny_model, batch, micro_batch_tokens=12, micro_batch_size=1)
    assert m1["micro_batches"] == 1 and m2["micro_batches"] == len(batch)
    assert m1["grad_norm"] == pytest.approx(m2["grad_norm"], rel=1e-5)
    assert_same_weights(one, many)


def test_mini_batches_and_epochs_take_several_optimizer_steps(tiny_model, ref) -> None:
    batch = make_batch(ref)
    _, m = step_weights(tiny_model, batch, mini_batches=2, ppo_epochs=3)
    assert m["optimizer_steps"] == 6.0 and m["version"] == 1.0
    assert m["clip_frac"] > 0  # later epochs see ratios away from 1


# decoupled objective and per-token versions ------------------------------------------------------


def test_decoupled_with_current_tokens_equals_ppo_clip_and_skips_recompute(tiny_model, ref) -> None:
    batch = make_batch(ref, shift=0.1)  # behaviour ≠ trainer, but the tokens carry the current version 0
    a, _ = step_weights(tiny_model, batch, loss="ppo_clip")
    b, mb = step_weights(tiny_model, batch, loss="decoupled_ppo", tis_cap=2.0)
    assert mb["proximal_recomputed"] == 0.0 and mb["stale_token_frac"] == 0.0
    assert mb["behav_weight"] == pytest.approx(1.0)
    assert_same_weights(a, b, atol=1e-7)


def test_decoupled_with_stale_tokens_recomputes_proximal(tiny_model, ref) -> None:
    trainer = TorchTrainer(
        TorchTrainerConfig(lr=1e-3, loss="decoupled_ppo", tis_cap=1.05, ppo_epochs=2), model_path=tiny_model
    )
    trainer.train_step(make_batch(ref, seed=9))  # now at version 1
    batch = make_batch(ref, shift=0.3, version=0)  # generated by version 0, behaviour logprobs off by 0.3
    m = trainer.train_step(batch)
    assert m["proximal_recomputed"] == 1.0
    assert m["token_lag_mean"] == 1.0 and m["token_lag_max"] == 1.0 and m["stale_token_frac"] == 1.0
    # proximal (version 1) vs behaviour (version 0 - 0.3): weights ≈ e^0.3 > cap → truncated
    assert m["tis_capped_frac"] > 0.5
    assert m["behav_weight"] <= 1.05 + 1e-6
    # ppo_clip on the same stale batch would clip against the behaviour policy instead
    ppo = TorchTrainer(TorchTrainerConfig(lr=1e-3), model_path=tiny_model)
    ppo.train_step(make_batch(ref, seed=9))
    assert ppo.train_step(batch)["clip_frac"] > m["clip_frac"]


def test_match_sampling_restricted_tokens_train(tiny_model, ref) -> None:
    allowed = (10, 20, 30, 40)
    batch = make_batch(ref, allowed=allowed, temperature=0.7)
    trainer = TorchTrainer(TorchTrainerConfig(lr=1e-3, match_sampling=True), model_path=tiny_model)
    # behaviour logprobs of the processed distribution, computed independently of the packing code
    for t in batch:
        ids = t.token_ids()
        with torch.no_grad():
            logits = trainer.model(input_ids=torch.tensor([ids])).logits[0].double() / 0.7
        restricted = torch.full_like(logits, float("-inf"))
        restricted[:, list(allowed)] = logits[:, list(allowed)]
        lp = torch.log_softmax(restricted, -1)
        pos = 0
        for turn in t.turns:
            pos += len(turn.context_ids)
            turn.output_logprobs = [float(lp[pos + j - 1, tok]) for j, tok in enumerate(turn.output_ids)]
            pos += len(turn.output_ids)
    m = trainer.train_step(batch)
    assert abs(m["approx_kl"]) < 1e-5 and m["clip_frac"] == 0.0  # the trainer saw the same distribution
    assert m["entropy"] <= torch.log(torch.tensor(4.0)).item() + 1e-5  # at most 4 allowed tokens
    # with an entropy bonus on the restricted logits the optimiser still steps (no nan gradient)
    bonus = TorchTrainer(
        TorchTrainerConfig(lr=1e-3, match_sampling=True, entropy_coef=0.01), model_path=tiny_model
    )
    mb = bonus.train_step(batch)
    assert math.isfinite(mb["grad_norm"]) and mb["grad_norm"] > 0 and mb["skipped_steps"] == 0


# KL, entropy, precision --------------------------------------------------------------------------


def test_kl_to_reference_is_zero_at_start_then_positive(tiny_model, ref) -> None:
    batch = make_batch(ref)
    trainer = TorchTrainer(TorchTrainerConfig(lr=1e-2, kl_coef=0.1, kl_estimator="k3"), model_path=tiny_model)
    m1 = trainer.train_step(batch)
    assert abs(m1["kl"]) < 1e-6  # the policy starts as the reference
    m2 = trainer.train_step(batch)
    assert m2["kl"] > 1e-5
    assert m2["loss"] == pytest.approx(m2["pg_loss"] + 0.1 * m2["kl"], abs=1e-6)


def test_kl_to_behaviour_and_entropy_bonus_change_the_update(tiny_model, ref) -> None:
    batch = make_batch(ref, shift=0.2)
    base, _ = step_weights(tiny_model, batch)
    kl, mk = step_weights(tiny_model, batch, kl_coef=0.5, kl_reference="behaviour", kl_estimator="k1")
    assert mk["kl"] == pytest.approx(0.2, abs=1e-4)  # log π - log π_behav = shift
    ent, me = step_weights(tiny_model, batch, entropy_coef=0.1)
    assert me["loss"] == pytest.approx(me["pg_loss"] - 0.1 * me["entropy"], abs=1e-6)
    for other in (kl, ent):
        assert any(not torch.allclose(base[n], other[n], atol=1e-7) for n in base)


def test_bf16_mixed_precision_keeps_fp32_master_weights(tiny_model, ref) -> None:
    trainer = TorchTrainer(TorchTrainerConfig(lr=1e-3, dtype="bfloat16"), model_path=tiny_model)
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    m = trainer.train_step(make_batch(ref))
    assert torch.isfinite(torch.tensor(m["loss"])) and m["grad_norm"] > 0
    pure = TorchTrainer(
        TorchTrainerConfig(lr=1e-3, dtype="bfloat16", mixed_precision=False), model_path=tiny_model
    )
    assert all(p.dtype == torch.bfloat16 for p in pure.model.parameters())
    pure.train_step(make_batch(ref))


# checkpoints and resume --------------------------------------------------------------------------


def test_resume_continues_version_optimizer_and_counters(tiny_model, ref, tmp_path) -> None:
    b1, b2 = make_batch(ref, seed=1), make_batch(ref, seed=2)
    cfg = TorchTrainerConfig(lr=1e-3, lr_schedule="cosine", total_steps=10, warmup_steps=1)
    a = TorchTrainer(cfg, model_path=tiny_model)
    a.train_step(b1)
    a.save(tmp_path / "run" / "checkpoint-1", extra={"buffer_cursor": 6})
    a.train_step(b1)
    a.save(tmp_path / "run" / "checkpoint-2", extra={"buffer_cursor": 12})
    m_a = a.train_step(b2)
    state = json.loads((tmp_path / "run" / "checkpoint-2" / "rollart_trainer.json").read_text())
    assert state["version"] == 2 and state["optimizer_steps"] == 2 and state["samples_seen"] == 12
    # the run directory resumes from its newest checkpoint, through the config field
    b = TorchTrainer(cfg.model_copy(update={"resume_from": str(tmp_path / "run")}), model_path=tiny_model)
    assert b.version == 2 and b.resumed_state["extra"] == {"buffer_cursor": 12}
    assert b.resumed_state["samples_seen"] == 12
    m_b = b.train_step(b2)
    assert m_b["version"] == m_a["version"] == 3.0
    assert m_b["lr"] == pytest.approx(m_a["lr"], rel=1e-12)  # the schedule continues at step 3
    assert_same_weights(dict(a.named_weights()), dict(b.named_weights()), atol=1e-6)
    # without the optimiser state the same step lands elsewhere (Adam moments matter)
    c = TorchTrainer(
        TorchTrainerConfig(lr=1e-3, lr_schedule="cosine", total_steps=10, warmup_steps=1),
        model_path=tmp_path / "run" / "checkpoint-2",
    )
    c.version = 2
    c._local.version = 2
    c.train_step(b2)
    wa = dict(a.named_weights())
    assert any(not torch.allclose(wa[n], w, atol=1e-6) for n, w in c.named_weights())


def test_resume_errors(tmp_path, tiny_model) -> None:
    with pytest.raises(TrainerError, match="no trainer checkpoint"):
        TorchTrainer.resume(tmp_path)
    with pytest.raises(TrainerError, match="no trainer checkpoint"):
        TorchTrainer(TorchTrainerConfig(resume_from=str(tiny_model)), model_path=tiny_model)


def test_save_is_atomic_and_overwrites(tiny_model, tmp_path) -> None:
    t = TorchTrainer(TorchTrainerConfig(), model_path=tiny_model)
    out = tmp_path / "ckpt"
    t.save(out)
    t.save(out)  # overwrite in place
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary directory left
    assert (out / "model.safetensors").is_file() and (out / "trainer_state.pt").is_file()


# per-turn advantages, zero-signal sequences ---------------------------------------------------------


def test_gigpo_and_skip_zero_adv_in_a_train_step(tiny_model, ref) -> None:
    batch = make_batch(ref)
    # g0 = t0, t2, t4 with distinct rewards (none at the mean); g1 = t1, t3, t5 without signal
    for t, r in zip(batch, [0.0, 1.0, 2.0, 1.0, 0.5, 1.0], strict=True):
        t.reward = r
    base = TorchTrainer(TorchTrainerConfig(lr=1e-3), model_path=tiny_model).train_step(batch)
    skip = TorchTrainer(TorchTrainerConfig(lr=1e-3, skip_zero_adv=True), model_path=tiny_model).train_step(
        batch
    )
    g0_tokens = sum(len(t.token_ids()) for t in batch if t.group_id == "g0")
    assert skip["packed_tokens"] == g0_tokens < base["packed_tokens"]
    # gigpo: every turn of these random contexts is its own step group, so it equals grpo here
    gi = TorchTrainer(
        TorchTrainerConfig(lr=1e-3, advantage="gigpo", gamma=0.9), model_path=tiny_model
    ).train_step(batch)
    assert gi["pg_loss"] == pytest.approx(base["pg_loss"], abs=1e-6)
