"""Model-caused failures are scored, not dropped: an environment that rejects the model's action with
InvalidActionError ends the episode with the failure reward (fate ``finished``); any other exception
from the environment is its own fault (``env_failed``). In-process fakes (named as such): a generator
that answers each trajectory's scripted action, a chat format that decodes it, a two-step env."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from rollart_core.control.runner import run_trajectory
from rollart_core.errors import InvalidActionError
from rollart_core.types import (
    Fate,
    GenerateOutput,
    GenerateRequest,
    RewardResult,
    SamplingParams,
    StepResult,
    Trajectory,
)

ACTIONS = {1: "good", 2: "poor", 3: "crash", 4: "bug"}
"""Token id → the action text the fake chat decodes it to."""


class FakeScriptedGenerator:
    """Fake engine: trajectory ``traj_id`` answers with ``plan[traj_id]`` (one token)."""

    def __init__(self, plan: dict[str, int]) -> None:
        self.plan = plan

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        assert request.session_id is not None
        return GenerateOutput(request.request_id, [self.plan[request.session_id]], [-0.5], [0], "stop")

    async def abort(self, request_id: str) -> int:
        return 0


class FakeChat:
    def first_turn(self, system: str | None, user: str) -> list[int]:
        return [7]

    def next_turn(self, user: str, previous_output: list[int]) -> list[int]:
        return [8]

    def action_token_ids(self, actions: list[str]) -> list[int]:
        return list(ACTIONS)

    def stop_token_ids(self) -> list[int]:
        return []

    def decode(self, ids: list[int]) -> str:
        return " ".join(ACTIONS[i] for i in ids)


class FakeToolEnv:
    """Fake environment: ``good`` earns 1, ``poor`` 0.25; ``crash`` is an action the tool cannot carry
    out (InvalidActionError with the failure reward -0.5); ``bug`` hits a bug of the env itself."""

    action_vocabulary = None
    system_prompt = None
    FAILURE_REWARD = -0.5

    def __init__(self) -> None:
        self.closed = False

    async def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        return "go", {}

    async def step(self, action_text: str) -> StepResult:
        if action_text == "crash":
            raise InvalidActionError("calc error: overflow", reward=self.FAILURE_REWARD)
        if action_text == "bug":
            raise KeyError("the env's own bug")
        return StepResult("done", 1.0 if action_text == "good" else 0.25, True, False)

    async def close(self) -> None:
        self.closed = True


class FakeEnvReturnScorer:
    async def score(self, trajectory: Trajectory) -> RewardResult:
        return RewardResult(trajectory.env_return)


async def _run_group(plan: dict[str, int]) -> list[Trajectory]:
    generator = FakeScriptedGenerator(plan)
    out = []
    for traj_id in plan:
        traj = Trajectory(traj_id, "tool", "e", "g0", seed=1, start_version=0)
        env = FakeToolEnv()
        out.append(
            await run_trajectory(
                traj,
                env=env,
                generator=generator,
                chat=FakeChat(),
                scorer=FakeEnvReturnScorer(),
                sampling=SamplingParams(max_tokens=4),
                max_turns=3,
            )
        )
        assert env.closed
    return out


def _group_advantages(group: list[Trajectory]) -> list[float]:
    """Group-relative advantages (GRPO's centring) over the members that can be trained on."""
    trainable = [t for t in group if t.fate is Fate.FINISHED]
    mean = sum(t.reward for t in trainable) / len(trainable)
    return [t.reward - mean if t.fate is Fate.FINISHED else 0.0 for t in group]


async def test_an_action_that_crashes_the_env_is_scored_with_the_failure_reward() -> None:
    group = await _run_group({"t0": 2, "t1": 2, "t2": 3, "t3": 2})  # three poor answers, one crash
    crashed = group[2]
    assert crashed.fate is Fate.FINISHED and crashed.terminated and crashed.error is None
    assert crashed.reward == FakeToolEnv.FAILURE_REWARD
    assert crashed.turns[0].env_reward == FakeToolEnv.FAILURE_REWARD
    assert crashed.info["invalid_action"] == "calc error: overflow"
    advantages = _group_advantages(group)
    assert advantages[2] < 0 < advantages[0]  # crashing is pushed down, not dropped from the group


async def test_a_policy_cannot_raise_its_expected_reward_by_crashing() -> None:
    """Against every mix of answers, replacing one member's answer by a crash never raises that
    member's reward nor its advantage: a bad episode cannot be escaped through the environment."""
    for honest in (1, 2):
        base = await _run_group({"a": honest, "b": 1, "c": 2})
        crash = await _run_group({"a": 3, "b": 1, "c": 2})
        assert crash[0].reward <= base[0].reward
        assert _group_advantages(crash)[0] <= _group_advantages(base)[0]
        assert _group_advantages(crash)[0] < 0


async def test_an_env_bug_not_caused_by_the_action_stays_env_failed() -> None:
    (traj,) = await _run_group({"t0": 4})
    assert traj.fate is Fate.ENV_FAILED and "the env's own bug" in (traj.error or "")


def test_invalid_action_error_keeps_its_reward_across_processes() -> None:
    exc = pickle.loads(pickle.dumps(InvalidActionError("bad", reward=-1.0)))
    assert isinstance(exc, InvalidActionError) and str(exc) == "bad" and exc.reward == -1.0


@pytest.mark.parametrize("reward", [0.0, -2.5])
def test_invalid_action_error_reward(reward: float) -> None:
    assert InvalidActionError("x", reward).reward == reward
