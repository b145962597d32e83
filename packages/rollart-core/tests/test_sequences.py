"""Trajectory.sequences: the token sequences the policy saw, for full-history and last-turn prompts."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rollart_core.config import TaskConfig
from rollart_core.types import Fate, Trajectory, Turn


def _traj(new_sequence: bool) -> Trajectory:
    t = Trajectory("g-0", "fl", "frozenlake", "g", seed=3, start_version=2, reward=1.0, fate=Fate.FINISHED)
    for k in range(3):
        t.turns.append(
            Turn(
                context_ids=[10 + k, 20 + k],
                output_ids=[30 + k],
                output_logprobs=[-0.1 * (k + 1)],
                output_versions=[2 + k],
                allowed_token_ids=(30, 31, 32),
                temperature=0.5,
                new_sequence=new_sequence and k > 0,
            )
        )
    return t


def test_full_history_is_one_sequence() -> None:
    t = _traj(new_sequence=False)
    assert t.sequences() == [t]
    assert t.token_ids() == [10, 20, 30, 11, 21, 31, 12, 22, 32]


def test_last_turn_prompts_split_into_one_sequence_per_turn() -> None:
    t = _traj(new_sequence=True)
    seqs = t.sequences()
    assert len(seqs) == 3
    for k, s in enumerate(seqs):
        assert (s.traj_id, s.group_id, s.seed, s.reward, s.fate) == ("g-0", "g", 3, 1.0, Fate.FINISHED)
        assert s.token_ids() == [10 + k, 20 + k, 30 + k]
        assert s.loss_mask() == [0, 0, 1]
        assert s.behaviour_logprobs() == [0.0, 0.0, pytest.approx(-0.1 * (k + 1))]
        assert s.token_versions() == [-1, -1, 2 + k]
        assert s.sampling_spec() == [(2, (30, 31, 32), 0.5)]
    assert t.min_version() == 2 and len(t.turns) == 3  # the trajectory itself is untouched


def test_new_sequence_survives_persistence() -> None:
    t = _traj(new_sequence=True)
    back = Trajectory.from_dict(t.to_dict())
    assert [x.new_sequence for x in back.turns] == [False, True, True]
    assert [s.token_ids() for s in back.sequences()] == [s.token_ids() for s in t.sequences()]
    old = t.to_dict()
    for turn in old["turns"]:
        del turn["new_sequence"]  # a buffer written before the field existed
    assert len(Trajectory.from_dict(old).sequences()) == 1


def test_task_context_option() -> None:
    base = {"name": "t", "env": {"impl": "frozenlake"}, "reward": {"impl": "success"}}
    assert TaskConfig.model_validate(base).context == "full"
    assert TaskConfig.model_validate({**base, "context": "last_turn"}).context == "last_turn"
    with pytest.raises(ValidationError, match="context"):
        TaskConfig.model_validate({**base, "context": "last"})
