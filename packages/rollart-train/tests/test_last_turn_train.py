"""Training on current-state-only prompts (task ``context: last_turn``): every turn is its own sequence,
carrying its own behaviour logprobs, versions and (GiGPO) per-turn advantage."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollart_core.types import Trajectory, Turn
from rollart_train import TorchTrainer, TorchTrainerConfig
from rollart_train._packing import seq_data, split_sequences, trajectory_weights
from rollart_train.losses import step_advantages
from rollart_train.tiny import create_tiny_model

# per trajectory: (prompt of every turn, its one-token action), reward
EPISODES = [
    ([([5, 6, 7, 8], [40]), ([5, 9, 7, 8], [41]), ([5, 9, 9, 8], [40])], 1.0),
    ([([5, 6, 7, 8], [41]), ([5, 6, 6, 8], [42])], 0.0),
    ([([5, 6, 7, 8], [40]), ([5, 9, 7, 8], [42])], 0.0),
]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_tiny_model(tmp_path_factory.mktemp("tiny") / "m")


def _last_turn_batch(trainer: TorchTrainer, version: int = 0) -> list[Trajectory]:
    """Behaviour logprobs of each action given *its own turn's prompt only* (what the engine saw)."""
    batch = []
    for i, (turns, reward) in enumerate(EPISODES):
        built = [
            Turn(
                context_ids=list(ctx),
                output_ids=list(out),
                output_logprobs=trainer.logprobs(ctx + out)[-1:],
                output_versions=[version],
                new_sequence=k > 0,
            )
            for k, (ctx, out) in enumerate(turns)
        ]
        batch.append(
            Trajectory(f"g-{i}", "t", "e", "g", seed=0, start_version=version, turns=built, reward=reward)
        )
    return batch


def test_split_sequences_carries_each_turns_tokens_and_advantage(tiny_model: Path) -> None:
    trainer = TorchTrainer(TorchTrainerConfig(), model_path=tiny_model)
    try:
        batch = _last_turn_batch(trainer)
    finally:
        trainer.close()
    adv = step_advantages(batch, gamma=0.9)
    seqs, seq_adv = split_sequences(batch, adv)
    assert len(seqs) == sum(len(t.turns) for t in batch) == 7
    flat = [(t, k) for t in batch for k in range(len(t.turns))]
    for s, a, (t, k) in zip(seqs, seq_adv, flat, strict=True):
        turn = t.turns[k]
        d = seq_data(s, a, match_sampling=False)
        assert d.ids == turn.context_ids + turn.output_ids
        assert d.mask == [0] * len(turn.context_ids) + [1]
        assert d.behaviour[-1] == turn.output_logprobs[0] and d.versions[-1] == turn.output_versions[0]
        assert d.advantage[-1] == pytest.approx(adv[batch.index(t)][k])
    # a one-advantage-per-trajectory estimator hands each turn its trajectory's advantage
    _, flat_adv = split_sequences(batch, [1.0, -2.0, 0.5])
    assert flat_adv == [1.0] * 3 + [-2.0] * 2 + [0.5] * 2
    with pytest.raises(ValueError, match="advantages for"):
        split_sequences(batch[:1], [[1.0, 2.0]])


def test_train_step_scores_each_turn_in_its_own_prompt(tiny_model: Path) -> None:
    cfg = TorchTrainerConfig(lr=1e-2, advantage="gigpo", gamma=0.9, scale_adv_by_std=True, packing=False)
    trainer = TorchTrainer(cfg, model_path=tiny_model)
    try:
        batch = _last_turn_batch(trainer)
        adv = step_advantages(batch, gamma=0.9)
        before = [trainer.logprobs(t.turns[0].context_ids + t.turns[0].output_ids)[-1] for t in batch]
        m = trainer.train_step(batch)
        # the trainer's logprob of every action, in its own turn's prompt, equals the recorded one:
        # scored in a concatenation of the turns it would differ (approx_kl would not be ~0)
        assert m["approx_kl"] == pytest.approx(0.0, abs=1e-6) and m["clip_frac"] == 0.0
        assert m["train_tokens"] == 7
        assert m["packed_tokens"] == sum(len(turn.context_ids) + 1 for t in batch for turn in t.turns)
        # ratio 1: the policy-gradient loss is minus the token-mean of the per-turn advantages
        flat_adv = [a for row in adv for a in row]
        assert m["pg_loss"] == pytest.approx(-sum(flat_adv) / len(flat_adv), abs=1e-5)
        assert m["token_lag_max"] == 0 and m["version"] == 1
        # the shared first state: the successful episode's action gained probability
        after = trainer.logprobs(batch[0].turns[0].context_ids + batch[0].turns[0].output_ids)[-1]
        assert adv[0][0] > 0 and after > before[0]
    finally:
        trainer.close()


def test_trajectory_weights_give_every_trajectory_the_same_share(tiny_model: Path) -> None:
    trainer = TorchTrainer(TorchTrainerConfig(), model_path=tiny_model)
    try:
        batch = _last_turn_batch(trainer)
    finally:
        trainer.close()
    seqs_t, seq_adv = split_sequences(batch, [0.0] * len(batch))
    seqs = [seq_data(t, a, False) for t, a in zip(seqs_t, seq_adv, strict=True)]
    trajectory_weights(batch, seqs)
    shares, k = [], 0
    for t in batch:  # 3, 2 and 2 one-token turns
        n = len(t.sequences())
        shares.append(sum(sum(s.mask[1:]) * s.weight for s in seqs[k : k + n]))
        k += n
    assert shares == pytest.approx([7 / 3] * 3)  # the weights still sum to the 7 loss tokens
    with pytest.raises(ValueError, match="sequences for"):
        trajectory_weights(batch, seqs[:-1])


@pytest.mark.parametrize("loss_agg", ["token_mean", "trajectory_mean"])
def test_loss_agg_averages_over_tokens_or_over_trajectories(tiny_model: Path, loss_agg: str) -> None:
    cfg = TorchTrainerConfig(lr=1e-2, loss_agg=loss_agg)  # type: ignore[arg-type]
    trainer = TorchTrainer(cfg, model_path=tiny_model)
    try:
        batch = _last_turn_batch(trainer)  # rewards 1, 0, 0 over 3, 2 and 2 turns
        m = trainer.train_step(batch)
    finally:
        trainer.close()
    rewards = [t.reward for t in batch]
    mean = sum(rewards) / len(rewards)
    std = (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5
    adv = [(r - mean) / (std + 1e-6) for r in rewards]
    turns = [len(t.turns) for t in batch]
    # ratio 1: minus the mean advantage, over tokens (the 3-turn success counts 3 times) or over
    # trajectories (each once: GRPO's advantages of a group sum to 0)
    if loss_agg == "token_mean":
        expected = -sum(a * n for a, n in zip(adv, turns, strict=True)) / sum(turns)
    else:
        expected = -sum(adv) / len(adv)
    assert m["pg_loss"] == pytest.approx(expected, abs=1e-5)
    assert m["train_tokens"] == 7
