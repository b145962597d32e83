"""Shared data types: sampling parameters, generation requests/outputs, turns and trajectories.

Every trajectory carries everything the trainer and the metrics need: task, env id, group id, the
policy version at its start, per-turn token ids with logprobs, loss mask and the policy version of
every generated token, its reward, timing per stage, and its fate. Nothing is dropped silently: a
trajectory always ends with exactly one :class:`Fate`.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "Fate",
    "GenerateOutput",
    "GenerateRequest",
    "RewardResult",
    "SamplingParams",
    "StepResult",
    "Trajectory",
    "Turn",
]


class Fate(str, enum.Enum):
    """How a trajectory ended. Each launched trajectory gets exactly one, and each is counted."""

    FINISHED = "finished"
    ABORTED_STALE = "aborted_stale"
    ENV_FAILED = "env_failed"
    TIMED_OUT = "timed_out"
    CANCELLED_REDUNDANT = "cancelled_redundant"
    CANCELLED_AT_STOP = "cancelled_at_stop"
    """Still running when the run ended (or was cancelled): never trained, not a failure."""
    REWARD_FAILED = "reward_failed"
    GENERATION_FAILED = "generation_failed"


class SamplingParams(BaseModel):
    """Sampling parameters of one generation request (engine-neutral; mapped by each engine)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int = Field(16, ge=1, description="Most tokens to generate in this turn.")
    temperature: float = Field(1.0, ge=0.0, description="0 means greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, description="-1 disables top-k.")
    stop: tuple[str, ...] = Field((), description="Stop strings (not included in the output).")
    stop_token_ids: tuple[int, ...] = Field((), description="Token ids that end generation.")
    allowed_token_ids: tuple[int, ...] | None = Field(
        None, description="Restrict sampling to these token ids (discrete action vocabularies)."
    )
    seed: int | None = Field(None, description="Per-request sampling seed.")

    @model_validator(mode="after")
    def _check(self) -> SamplingParams:
        if self.allowed_token_ids is not None and len(self.allowed_token_ids) == 0:
            raise ValueError("allowed_token_ids must be non-empty when given")
        if any(t < 0 for t in (*self.stop_token_ids, *(self.allowed_token_ids or ()))):
            raise ValueError("token ids must be >= 0")
        return self


@dataclass(slots=True)
class GenerateRequest:
    """One turn of one trajectory: token ids in."""

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    session_id: str | None = None
    """Trajectory id: all turns of a session prefer the worker that holds its prefix cache."""
    task: str | None = None
    """Task name: the proxy routes a task only to workers of its pool."""
    prompt_logprobs: bool = False
    """Also return the logprob of every prompt token (token i given tokens < i)."""


@dataclass(slots=True)
class GenerateOutput:
    """Token ids out, with the logprob and the policy version of every generated token."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    worker: str = ""
    prompt_logprobs: list[float | None] | None = None
    """Aligned with the prompt; the first entry is None (nothing precedes it)."""

    @property
    def start_version(self) -> int | None:
        return self.versions[0] if self.versions else None

    @property
    def end_version(self) -> int | None:
        return self.versions[-1] if self.versions else None


@dataclass(slots=True)
class StepResult:
    """What an environment returns for one action."""

    observation: str
    reward: float
    terminated: bool
    truncated: bool
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class RewardResult:
    """A reward function's verdict on a finished trajectory."""

    score: float
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class Turn:
    """One turn: context tokens fed before generation (not trained on), then generated tokens."""

    context_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_versions: list[int] = field(default_factory=list)
    finish_reason: str = ""
    action_text: str = ""
    env_reward: float = 0.0
    allowed_token_ids: tuple[int, ...] | None = None
    """The sampling restriction the outputs were drawn under (the trainer can apply the same)."""
    temperature: float = 1.0
    new_sequence: bool = False
    """``context_ids`` is this turn's whole prompt: it does not continue the earlier turns' tokens
    (current-state-only prompts, task ``context: last_turn``). See :meth:`Trajectory.sequences`."""


@dataclass(slots=True)
class Trajectory:
    """A whole multi-turn episode as the trainer sees it."""

    traj_id: str
    task: str
    env_id: str  # the environment implementation (an EnvManager's instance: ``info["env_instance"]``)
    group_id: str
    seed: int
    start_version: int
    turns: list[Turn] = field(default_factory=list)
    reward: float = 0.0
    env_return: float = 0.0
    fate: Fate | None = None
    terminated: bool = False
    truncated: bool = False
    error: str | None = None
    timings: dict[str, float] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)

    def sequences(self) -> list[Trajectory]:
        """The token sequences the policy actually saw, as trajectories sharing this one's ids,
        reward and fate: one per run of turns that extend each other (a turn with ``new_sequence``
        starts the next). Just ``[self]`` for an ordinary multi-turn trajectory."""
        if not any(t.new_sequence for t in self.turns[1:]):
            return [self]
        out: list[Trajectory] = []
        for t in self.turns:
            if not out or t.new_sequence:
                out.append(dataclasses.replace(self, turns=[]))
            out[-1].turns.append(t)
        return out

    def token_ids(self) -> list[int]:
        out: list[int] = []
        for t in self.turns:
            out += t.context_ids
            out += t.output_ids
        return out

    def loss_mask(self) -> list[int]:
        out: list[int] = []
        for t in self.turns:
            out += [0] * len(t.context_ids)
            out += [1] * len(t.output_ids)
        return out

    def behaviour_logprobs(self) -> list[float]:
        """Per-token logprobs under the behaviour policy; 0.0 where the loss mask is 0."""
        out: list[float] = []
        for t in self.turns:
            out += [0.0] * len(t.context_ids)
            out += t.output_logprobs
        return out

    def sampling_spec(self) -> list[tuple[int, tuple[int, ...] | None, float]]:
        """``(position, allowed_token_ids, temperature)`` of every generated token."""
        out: list[tuple[int, tuple[int, ...] | None, float]] = []
        pos = 0
        for t in self.turns:
            pos += len(t.context_ids)
            out += [(pos + i, t.allowed_token_ids, t.temperature) for i in range(len(t.output_ids))]
            pos += len(t.output_ids)
        return out

    def token_versions(self) -> list[int]:
        """Policy version of every token; -1 where the token was not generated."""
        out: list[int] = []
        for t in self.turns:
            out += [-1] * len(t.context_ids)
            out += t.output_versions
        return out

    def num_generated(self) -> int:
        return sum(len(t.output_ids) for t in self.turns)

    def min_version(self) -> int:
        """Oldest policy version that produced any token (start version if none generated)."""
        vs = [v for t in self.turns for v in t.output_versions]
        return min(vs) if vs else self.start_version

    def add_timing(self, stage: str, seconds: float) -> None:
        self.timings[stage] = self.timings.get(stage, 0.0) + seconds

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (``info`` must itself be JSON-serialisable)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "turns"}
        d["turns"] = [dataclasses.asdict(t) for t in self.turns]
        d["fate"] = self.fate.value if self.fate is not None else None
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Trajectory:
        d = dict(d)
        turns = []
        for t in d.pop("turns", []):
            t = dict(t)
            if t.get("allowed_token_ids") is not None:
                t["allowed_token_ids"] = tuple(t["allowed_token_ids"])
            turns.append(Turn(**t))
        fate = d.pop("fate", None)
        traj = cls(**d, turns=turns)
        traj.fate = Fate(fate) if fate is not None else None
        return traj


def fate_counts(trajectories: Sequence[Trajectory]) -> dict[str, int]:
    """Count trajectories by fate (``"running"`` for those without one yet)."""
    counts: dict[str, int] = {}
    for t in trajectories:
        key = t.fate.value if t.fate is not None else "running"
        counts[key] = counts.get(key, 0) + 1
    return counts
