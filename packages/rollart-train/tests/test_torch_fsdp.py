"""TorchTrainer across ranks: FSDP2 over 2 real gloo ranks (127.0.0.1) against one in-process rank."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

from rollart_core.types import Trajectory, Turn
from rollart_train import TorchTrainer, TorchTrainerConfig
from rollart_train.tiny import create_tiny_model

CFG = {"lr": 1e-3, "micro_batch_tokens": 48, "num_threads": 1}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return create_tiny_model(tmp_path_factory.mktemp("tiny-fsdp") / "m")


def make_batch(trainer: TorchTrainer) -> list[Trajectory]:
    """Eight trajectories of different lengths in two groups; behaviour logprobs are the trainer's own,
    one token in four is stale (version -1 never equals a trainer version)."""
    g = torch.Generator().manual_seed(11)
    out = []
    for i in range(8):
        ctx = torch.randint(3, 400, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
        gen = torch.randint(3, 400, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist()
        lps = trainer.logprobs(ctx + gen)[-len(gen) :]
        turn = Turn(
            context_ids=ctx,
            output_ids=gen,
            output_logprobs=[x - 0.05 * (k % 3) for k, x in enumerate(lps)],
            output_versions=[0] * len(gen),
        )
        out.append(
            Trajectory(
                traj_id=f"t{i}",
                task="t",
                env_id="e",
                group_id=f"g{i % 2}",
                seed=i,
                start_version=0,
                turns=[turn],
                reward=float((i * 7) % 5),
            )
        )
    return out


@pytest.fixture(scope="module")
def one_rank(tiny_model):
    """One in-process rank: the batch, weights before/after one step, logprobs after."""
    trainer = TorchTrainer(TorchTrainerConfig(**CFG), model_path=tiny_model)
    batch = make_batch(trainer)
    before = {n: w.clone() for n, w in trainer.named_weights()}
    metrics = trainer.train_step(batch)
    after = {n: w.clone() for n, w in trainer.named_weights()}
    return {"trainer": trainer, "batch": batch, "before": before, "after": after, "metrics": metrics}


@pytest.fixture(scope="module")
def two_ranks(tiny_model, one_rank):
    trainer = TorchTrainer(TorchTrainerConfig(**CFG, world_size=2), model_path=tiny_model)
    yield trainer
    pids = trainer.pids
    trainer.close()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_two_ranks_same_update_as_one(one_rank, two_ranks, tmp_path) -> None:
    before_2 = dict(two_ranks.named_weights())
    assert set(before_2) == set(one_rank["before"])
    for n, w in before_2.items():  # full (unsharded) tensors, identical start
        assert w.shape == one_rank["before"][n].shape, n
        assert torch.equal(w, one_rank["before"][n]), n
    # same logprobs through the sharded model
    ids = one_rank["batch"][0].token_ids()
    m2 = two_ranks.train_step(one_rank["batch"])
    m1 = one_rank["metrics"]
    assert m2["version"] == 1.0 and two_ranks.version == 1
    for k in ("loss", "clip_frac", "approx_kl", "entropy", "train_tokens"):
        assert m2[k] == pytest.approx(m1[k], rel=1e-4, abs=1e-6), k
    assert m2["grad_norm"] == pytest.approx(m1["grad_norm"], rel=1e-4)
    after_2 = dict(two_ranks.named_weights())
    max_delta = max(float((one_rank["after"][n] - one_rank["before"][n]).abs().max()) for n in after_2)
    assert max_delta > 5e-4  # lr 1e-3 Adam: the step really moved the weights
    for n, w in after_2.items():
        torch.testing.assert_close(w, one_rank["after"][n], rtol=0, atol=2e-5, msg=n)
    assert two_ranks.logprobs(ids) == pytest.approx(one_rank["trainer"].logprobs(ids), abs=1e-4)


def test_two_rank_checkpoint_resumes_on_one_rank(one_rank, two_ranks, tiny_model, tmp_path) -> None:
    # two_ranks has taken exactly one step (previous test); its checkpoint continues in-process
    assert two_ranks.version == 1
    ckpt = tmp_path / "checkpoint-1"
    two_ranks.save(ckpt, extra={"consumed": 8})
    state = json.loads((ckpt / "rollart_trainer.json").read_text())
    assert state["version"] == 1 and state["world_size"] == 2 and state["extra"] == {"consumed": 8}
    resumed = TorchTrainer.resume(tmp_path, TorchTrainerConfig(**CFG), model_path=tiny_model)
    assert resumed.version == 1 and resumed.resumed_state["extra"] == {"consumed": 8}
    for n, w in resumed.named_weights():
        torch.testing.assert_close(w, one_rank["after"][n], rtol=0, atol=2e-5, msg=n)
    # a second step on both sides agrees: the Adam moments travelled with the checkpoint
    batch = one_rank["batch"]
    two_ranks.train_step(batch)
    resumed.train_step(batch)
    w2 = dict(two_ranks.named_weights())
    for n, w in resumed.named_weights():
        torch.testing.assert_close(w, w2[n], rtol=0, atol=5e-5, msg=n)


def test_rank_failure_is_reported(two_ranks) -> None:
    from rollart_core.errors import TrainerError

    with pytest.raises(TrainerError, match="empty batch"):
        two_ranks.train_step([])
    with pytest.raises(TrainerError, match="no generated tokens"):
        two_ranks.train_step(
            [
                Trajectory(
                    traj_id="x",
                    task="t",
                    env_id="e",
                    group_id="g",
                    seed=0,
                    start_version=0,
                    turns=[Turn(context_ids=[1, 2, 3])],
                )
            ]
        )
    assert two_ranks.logprobs([5, 6, 7]) is not None  # still usable afterwards


def test_a_thread_count_that_does_not_take_is_warned(tiny_model, monkeypatch, caplog) -> None:
    """An in-process vLLM CPU engine replaces ``torch.set_num_threads`` with a no-op (stood in for
    here, as vLLM does it): the rank says its ``num_threads`` did not take instead of training with
    another thread count in silence."""
    want = torch.get_num_threads() % 4 + 1  # never the current count
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    with caplog.at_level("WARNING", logger="rollart_train.torch_rank"):
        trainer = TorchTrainer(TorchTrainerConfig(**{**CFG, "num_threads": want}), model_path=tiny_model)
    assert f"asked for {want} torch threads but runs with {torch.get_num_threads()}" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="rollart_train.torch_rank"):
        trainer.set_num_threads(torch.get_num_threads())  # what it has: nothing to say
    assert "torch threads" not in caplog.text
    trainer.close()


def test_spawned_single_rank_gives_the_in_process_update(one_rank, tiny_model) -> None:
    """``spawn: true`` with one rank: the same step as in process, computed in a child process (so the
    step never holds the caller's GIL; in process, a busy Python thread beside it slowed a step of
    this model from 0.04 s to 4 s)."""
    from rollart_core.errors import TrainerError

    trainer = TorchTrainer(TorchTrainerConfig(**CFG, spawn=True), model_path=tiny_model)
    try:
        assert len(trainer.pids) == 1 and trainer.pids[0] != os.getpid()
        with pytest.raises(TrainerError, match="spawned ranks"):
            _ = trainer.model
        with pytest.raises(TrainerError, match="at least 1 thread"):
            trainer.set_num_threads(0)
        trainer.set_num_threads(1)
        # a terminal's Ctrl-C reaches the rank too (same process group): the driver, not the signal,
        # ends it, so it goes on answering
        os.kill(trainer.pids[0], signal.SIGINT)
        for n, w in trainer.named_weights():
            assert torch.equal(w, one_rank["before"][n]), n
        m = trainer.train_step(one_rank["batch"])
        assert m["loss"] == pytest.approx(one_rank["metrics"]["loss"], rel=1e-5, abs=1e-7)
        assert trainer.version == 1
        for n, w in trainer.named_weights():
            torch.testing.assert_close(w, one_rank["after"][n], rtol=0, atol=1e-6, msg=n)
    finally:
        pids = trainer.pids
        trainer.close()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_dead_spawned_rank_is_a_trainer_error(one_rank, tiny_model) -> None:
    """A rank killed outright (OOM killer, SIGKILL) fails the next command with a TrainerError naming
    it, not a bare pipe error (before: ConnectionResetError)."""
    from rollart_core.errors import TrainerError

    trainer = TorchTrainer(TorchTrainerConfig(**CFG, spawn=True), model_path=tiny_model)
    (pid,) = trainer.pids
    try:
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(TrainerError, match=r"rank 0.*died|died.*exit code -9"):
            trainer.train_step(one_rank["batch"])
        with pytest.raises(TrainerError, match=r"died|closed"):  # and so does every later one
            trainer.logprobs([5, 6, 7])
    finally:
        trainer.close()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
