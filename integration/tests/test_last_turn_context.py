"""Current-state-only prompts (task ``context: last_turn``) on the real pipeline: tiny Qwen2 in vLLM
(CPU) in a Ray actor, FrozenLake, the torch trainer. Every turn's prompt is the system prompt plus the
current map only, and each turn is trained as a sequence of its own with its own behaviour logprob,
policy version and advantage."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from rollart_core.control.train import train
from rollart_core.metrics import MemorySink
from rollart_core.types import Fate, Trajectory
from rollart_env.frozenlake import FrozenLakeConfig, FrozenLakeEnv

from .conftest import rollout_step, slice_config

pytestmark = [pytest.mark.vllm, pytest.mark.ray]


@pytest.fixture(scope="module")
async def last_turn_pipeline(
    tmp_path_factory: pytest.TempPathFactory, tiny_model: Path
) -> AsyncIterator[object]:
    from rollart_core.control.pipeline import Pipeline

    cfg = slice_config(tmp_path_factory.mktemp("last-turn"), model_path=tiny_model)
    task = cfg.tasks[0]
    task.context = "last_turn"
    task.env.options["instructions"] = False  # the map alone: each prompt is a few dozen tokens
    cfg.trainer.options.update({"advantage": "gigpo", "gamma": 0.9, "lr": 0.01})
    async with Pipeline(cfg) as p:
        yield p


async def _replayed_prompts(p, traj: Trajectory, env_options: dict) -> list[list[int]]:
    """The prompt of every turn, rebuilt by replaying the trajectory's actions on a fresh env."""
    env = FrozenLakeEnv(FrozenLakeConfig(**env_options))
    assert env.system_prompt is None
    obs, _ = await env.reset(traj.seed)
    prompts = []
    for turn in traj.turns:
        prompts.append(p.chat.first_turn(env.system_prompt, obs))
        step = await env.step(turn.action_text)
        obs = step.observation
    return prompts


async def _check_rollout(p, trajs: list[Trajectory], version: int) -> None:
    assert trajs and all(t.fate is Fate.FINISHED for t in trajs)
    assert any(len(t.turns) > 1 for t in trajs)
    for t in trajs:
        # each turn's prompt is exactly the current observation's first turn: no history
        assert [turn.context_ids for turn in t.turns] == await _replayed_prompts(
            p, t, p.config.tasks[0].env.options
        )
        assert [turn.new_sequence for turn in t.turns] == [k > 0 for k in range(len(t.turns))]
        seqs = t.sequences()
        assert len(seqs) == len(t.turns)
        for s, turn in zip(seqs, t.turns, strict=True):
            assert s.token_ids() == turn.context_ids + turn.output_ids and len(turn.output_ids) == 1
            assert s.token_versions()[-1] == version
            # the recorded behaviour logprob is the action's logprob given this turn's prompt alone
            assert abs(p.trainer.logprobs(s.token_ids())[-1] - turn.output_logprobs[0]) < 1e-3


async def test_last_turn_rollout_train_and_update(last_turn_pipeline) -> None:
    p = last_turn_pipeline
    assert p.trainer.version == 0
    batch = await rollout_step(p, step=1)
    await _check_rollout(p, batch, version=0)
    if len({t.reward for t in batch}) == 1:  # all-equal rewards give zero advantages: force a signal
        batch[0].reward = 1.0 - batch[0].reward
    m = p.trainer.train_step(batch)
    n_turns = sum(len(t.turns) for t in batch)
    assert m["train_tokens"] == n_turns  # one sequence per turn, one action token each
    assert m["packed_tokens"] == sum(len(turn.context_ids) + 1 for t in batch for turn in t.turns)
    assert m["approx_kl"] < 1e-4  # trainer and engine scored every action in the same (per-turn) context
    assert m["token_lag_max"] == 0 and p.trainer.version == 1

    await asyncio.wrap_future(p.store.push(1, dict(p.trainer.named_weights())))
    await p.proxy.update_weights(1)
    nxt = await rollout_step(p, step=2)
    await _check_rollout(p, nxt, version=1)


async def test_last_turn_through_the_training_loop(last_turn_pipeline) -> None:
    p = last_turn_pipeline
    start = p.trainer.version
    cfg = p.config.model_copy(deep=True)
    cfg.loop.steps, cfg.loop.eval_every, cfg.loop.eval_episodes = 2, 2, 4
    summary = await train(cfg, sink=MemorySink(), pipeline=p)
    assert summary["final_version"] == start + 2
    assert sum(summary["fates"].values()) == summary["launched"] > 0
    # every trained sequence is one turn: a map-only prompt (same length for every 4x4 map) + one action
    per_turn = len(p.chat.first_turn(None, "SFFF\nFFFF\nFFFF\nFFFG")) + 1
    assert all(h["packed_tokens"] == per_turn * h["train_tokens"] for h in summary["history"])
    assert 0.0 <= summary["history"][-1]["eval_success"] <= 1.0
