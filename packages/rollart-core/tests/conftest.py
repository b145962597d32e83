"""rollart-core's test fixtures. In-process fakes for the control plane's unit tests (named as such): a proxy whose engine echoes
one token, a trainer that counts, a weight store in memory, an env that ends after a few steps.
Each fake appends what it was asked to one shared call log, so a test can read the order of the
protocol's steps. The real components are exercised by the integration tests."""

from __future__ import annotations

import asyncio
import sys
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from rollart_core.config import RunConfig
from rollart_core.errors import ConfigError, EngineError, WeightSyncError
from rollart_core.protocols import AgentCall, AgentEpisode, AgentSession
from rollart_core.types import GenerateOutput, GenerateRequest, RewardResult, StepResult, Trajectory


@dataclass
class Script:
    """What the fakes do; tests change it."""

    log: list[tuple[Any, ...]] = field(default_factory=list)
    env_steps: int = 2
    fail_resets: int = 0
    """The first this-many env resets raise."""
    hang_seeds: set[int] = field(default_factory=set)
    """Envs reset with these seeds hang in their first step until cancelled."""
    hang_all: bool = False
    gate_seeds: dict[int, int] = field(default_factory=dict)
    """Envs reset with these seeds finish their first step only once the trainer reached this version."""
    trainer_version: int = 0
    engine_down: bool = False
    fail_push_at: int | None = None
    hang_push_at: int | None = None
    """The store never finishes writing this version."""
    step_delay_s: float = 0.001
    envs_made: list[tuple[str, bool]] = field(default_factory=list)
    """(task, held_out) of every environment the pipeline built."""
    agent: bool = False
    """Tasks run the fake agent (``ScriptedAgentEnv``) instead of ``CountdownEnv``."""
    agent_episodes: int = 0
    config_error_after: int | None = None
    """Envs built after this many raise a ConfigError (as a dataset file that went missing would)."""
    config_error_in_reset: bool = False
    """Env resets raise a ConfigError (as an agent's endpoint that cannot be built would)."""
    envs_built: int = 0


class EchoProxy:
    """Fake proxy: the 'engine' answers one token tagged with the served version."""

    def __init__(self, script: Script) -> None:
        self.s = script
        self.version = 0
        self.sessions: set[str] = set()
        """Sessions generated for and not ended yet (the real proxy's routing table)."""

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        if request.session_id:
            self.sessions.add(request.session_id)
        await asyncio.sleep(self.s.step_delay_s)
        if self.s.engine_down:
            raise EngineError("fake engine is down")
        return GenerateOutput(request.request_id, [5], [-0.1], [self.version], "stop")

    async def abort(self, request_id: str) -> int:
        return 0

    async def suspend(self) -> None:
        self.s.log.append(("suspend",))

    async def resume(self) -> None:
        self.s.log.append(("resume",))

    async def update_weights(self, version: int) -> dict[str, float]:
        self.s.log.append(("update_weights", version))
        self.version = version
        return {"fake-0": 0.0}

    async def prefetch_weights(self, version: int) -> None:
        self.s.log.append(("prefetch_weights", version))

    def end_session(self, session_id: str) -> None:
        self.sessions.discard(session_id)

    async def metrics(self, engine_stats: bool = True, timeout: float = 5.0) -> dict[str, dict[str, Any]]:
        return {}


class CountingTrainer:
    """Fake trainer: each step bumps the version and logs the batch's oldest token versions."""

    def __init__(self, script: Script) -> None:
        self.s = script
        self.version = 0
        self.trained_ids: list[str] = []
        self.batches: list[list[Trajectory]] = []

    def train_step(self, batch: list[Trajectory]) -> dict[str, float]:
        self.s.log.append(("train_step", self.version + 1, sorted({t.min_version() for t in batch})))
        self.trained_ids += [t.traj_id for t in batch]
        self.batches.append(list(batch))
        self.version += 1
        self.s.trainer_version = self.version
        return {"version": float(self.version), "loss": 0.0}

    def named_weights(self) -> list[tuple[str, Any]]:
        return [("w", self.version)]

    def save(self, path: str) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "fake_trainer.txt").write_text(str(self.version))

    def load(self, path: str) -> None:
        self.version = int((Path(path) / "fake_trainer.txt").read_text())


class MemoryStore:
    """Fake weight store: remembers pushed versions (optionally fails one)."""

    def __init__(self, script: Script) -> None:
        self.s = script
        self.versions: dict[int, Any] = {}

    def push(self, version: int, tensors: Any) -> Future[None]:
        self.s.log.append(("push", version))
        fut: Future[None] = Future()
        if version == self.s.fail_push_at:
            fut.set_exception(WeightSyncError(f"fake store refused version {version}"))
        elif version == self.s.hang_push_at:
            pass  # a store that hangs: the future never completes
        else:
            self.versions[version] = dict(tensors)
            fut.set_result(None)
        return fut

    def latest_version(self) -> int | None:
        return max(self.versions, default=None)


class CountdownEnv:
    """Fake env: ends (success) after ``env_steps`` steps; fails or hangs as scripted."""

    action_vocabulary = None
    system_prompt = None

    def __init__(self, script: Script) -> None:
        self.s = script
        self.left = script.env_steps
        self.seed = -1

    async def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        if self.s.config_error_in_reset:
            raise ConfigError("fake endpoint: model dir has no tokenizer.json")
        if self.s.fail_resets > 0:
            self.s.fail_resets -= 1
            raise RuntimeError("fake env failed to reset")
        self.seed = seed
        return "obs", {}

    async def step(self, action_text: str) -> StepResult:
        if self.s.hang_all or self.seed in self.s.hang_seeds:
            await asyncio.Event().wait()
        while self.s.trainer_version < self.s.gate_seeds.get(self.seed, 0):
            await asyncio.sleep(0.001)
        await asyncio.sleep(self.s.step_delay_s)
        self.left -= 1
        done = self.left <= 0
        return StepResult("obs", 1.0 if done else 0.0, done, False, {"success": done})

    async def close(self) -> None:
        pass


class ScriptedAgentEnv:
    """Fake agent env (``SupportsAgentEpisode``): three model calls through the session's generator;
    every other episode rewrites its history before the third (its prompt does not extend the
    sequence so far). Logs ``("agent", trajectory id, calls, rewrites)``."""

    def __init__(self, script: Script) -> None:
        self.s = script

    async def run_episode(self, session: AgentSession) -> AgentEpisode:
        rewrite = self.s.agent_episodes % 2 == 1
        self.s.agent_episodes += 1
        calls: list[AgentCall] = []
        prompt = [1, 2]
        for k in range(3):
            if k == 2 and rewrite:
                prompt = [9, 9]  # an edited history: a new sequence
            out = await session.generator.generate(
                GenerateRequest(f"{session.session_id}-c{k}", prompt, session.sampling, session.session_id)
            )
            calls.append(AgentCall(prompt, out.token_ids, out.logprobs, out.versions, out.finish_reason))
            prompt = [*prompt, *out.token_ids, 3]
        self.s.log.append(("agent", session.session_id, len(calls), int(rewrite)))
        return AgentEpisode(calls, answer="a", reward=1.0, info={"success": True})

    async def close(self) -> None:
        pass


class EchoChat:
    def first_turn(self, system: str | None, user: str) -> list[int]:
        return [1, 2]

    def next_turn(self, user: str, previous_output: list[int]) -> list[int]:
        return [3]

    def action_token_ids(self, actions: list[str]) -> list[int]:
        return [5] * len(actions)

    def stop_token_ids(self) -> list[int]:
        return []

    def decode(self, ids: list[int]) -> str:
        return "a"


class EnvReward:
    async def score(self, trajectory: Trajectory) -> RewardResult:
        return RewardResult(trajectory.env_return)

    def stats(self) -> dict[str, float]:
        return {}


class FakePipeline:
    """Quacks like :class:`rollart_core.control.pipeline.Pipeline` with the fakes above."""

    def __init__(self, config: RunConfig, script: Script) -> None:
        self.config, self.script = config, script
        self.trainer = CountingTrainer(script)
        self.store = MemoryStore(script)
        self.proxy = EchoProxy(script)
        self.chat = EchoChat()
        self.rewards = {t.name: EnvReward() for t in config.tasks}
        self.timings: dict[str, float] = {}

    def make_env(self, task: Any, index: int, *, held_out: bool = False) -> CountdownEnv | ScriptedAgentEnv:
        self.script.envs_made.append((task.name, held_out))
        self.script.envs_built += 1
        if (
            self.script.config_error_after is not None
            and self.script.envs_built > self.script.config_error_after
        ):
            raise ConfigError("dataset data.jsonl, line 3: no key 'answer'")
        return ScriptedAgentEnv(self.script) if self.script.agent else CountdownEnv(self.script)

    async def acquire_env(self, task: Any, index: int) -> CountdownEnv | ScriptedAgentEnv:
        return self.make_env(task, index)


def fake_config(tmp: Path, **loop: Any) -> RunConfig:
    tasks = loop.pop("tasks", None) or [
        {
            "name": "t",
            "env": {"impl": "fake"},
            "reward": {"impl": "fake"},
            "group_size": 2,
            "groups_per_step": 2,
            "max_turns": 4,
        }
    ]
    return RunConfig.model_validate(
        {
            "output_dir": str(tmp / "run"),
            "model": {"path": str(tmp / "model")},
            "engines": [{"name": "gen"}],
            "tasks": tasks,
            "loop": {"steps": 3, "stall_timeout_s": 30, **loop},
        }
    )


@pytest.fixture
def fakes() -> ModuleType:
    """This module: the fakes, for tests that build their own runs."""
    return sys.modules[__name__]
