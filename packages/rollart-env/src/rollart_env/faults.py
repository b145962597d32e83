"""Fault injection for tests and benchmarks: wrap any environment with start-up delay, log-normal
step latency, crashes and hangs, all seeded.

Everything is a pure function of ``(seed, instance)`` for the start-up delay and of
``(seed, episode seed, call index)`` for the rest, so a test can predict exactly which episodes
will fail (:func:`plan_episode`). Per episode one fault is drawn: with ``crash_prob`` the env
raises :class:`InjectedCrash` (an :class:`~rollart_core.errors.EnvError`) at one call, with
``hang_prob`` it hangs there (forever, or ``hang_s``); the call is drawn uniformly from
``0 .. fault_within_calls - 1`` where call 0 is ``reset`` and call i the i-th ``step``.

:class:`StragglerEnv` (entry point ``straggler``) is :class:`FaultyEnv` with a fresh instance number
per environment object: ``rollart bench`` uses it so that the members of one group straggle and fail
independently. With ``paired_scope`` it draws by (episode seed, how many environments of the scope
reset on that seed before) instead: common random numbers, so that runs launching the same seeds in
the same order face the same latencies and crashes.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
from collections import Counter
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rollart_core.config import ComponentConfig
from rollart_core.errors import EnvError
from rollart_core.protocols import Environment
from rollart_core.types import StepResult
from rollart_env._text import sub_seed

__all__ = [
    "EpisodePlan",
    "FaultSpec",
    "FaultyEnv",
    "FaultyEnvConfig",
    "InjectedCrash",
    "StragglerEnv",
    "StragglerEnvConfig",
    "plan_episode",
]


class InjectedCrash(EnvError):
    """A crash injected by :class:`FaultyEnv`."""


class FaultSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)

    seed: int = 0
    start_delay_s: float = Field(0.0, ge=0)
    """Median start-up delay (simulated container pull), paid in ``start()``."""
    start_delay_sigma: float = Field(0.0, ge=0)
    """Log-normal spread of the start-up delay (0 = always the median)."""
    step_latency_s: float = Field(0.0, ge=0)
    """Median latency added to every reset/step."""
    step_latency_sigma: float = Field(0.0, ge=0)
    """Log-normal spread of the step latency: 1.0 gives a heavy tail (p99 ≈ 10× the median)."""
    crash_prob: float = Field(0.0, ge=0, le=1)
    """Per episode: probability that one call raises InjectedCrash."""
    hang_prob: float = Field(0.0, ge=0, le=1)
    """Per episode: probability that one call never returns (or returns after ``hang_s``)."""
    hang_s: float | None = Field(None, gt=0)
    """How long a hang lasts; None = forever (until cancelled)."""
    fault_within_calls: int = Field(4, ge=1)
    """The faulty call is drawn from the first this-many calls (0 = reset)."""
    per_instance: bool = False
    """Draw faults and latencies per (instance, episode number) instead of per episode seed, so the
    members of a GRPO group (same seed) fail and straggle independently. Still deterministic per
    instance; False makes :func:`plan_episode` predict each episode from its seed alone."""

    @model_validator(mode="after")
    def _probs(self) -> FaultSpec:
        if self.crash_prob + self.hang_prob > 1:
            raise ValueError("crash_prob + hang_prob must be <= 1")
        return self


@dataclass(frozen=True, slots=True)
class EpisodePlan:
    fault: Literal["none", "crash", "hang"]
    at_call: int
    """0 = reset, i = the i-th step."""


def plan_episode(
    spec: FaultSpec, episode_seed: int, instance_key: tuple[int, ...] | None = None
) -> EpisodePlan:
    """Which fault (if any) the episode started by ``reset(episode_seed)`` gets, and at which call.

    With ``per_instance`` the key is ``instance_key`` = (instance, episode number) instead, or
    (instance, incarnation, episode number) for a rebuilt instance.
    """
    key = instance_key if spec.per_instance and instance_key is not None else episode_seed
    rng = random.Random(sub_seed("fault-plan", spec.seed, key))
    u = rng.random()
    at = rng.randrange(spec.fault_within_calls)
    if u < spec.crash_prob:
        return EpisodePlan("crash", at)
    if u < spec.crash_prob + spec.hang_prob:
        return EpisodePlan("hang", at)
    return EpisodePlan("none", -1)


def _lognormal(rng: random.Random, median: float, sigma: float) -> float:
    if median <= 0:
        return 0.0
    return median * math.exp(sigma * rng.gauss(0.0, 1.0)) if sigma > 0 else median


class FaultyEnvConfig(BaseModel):
    """Options of the ``faulty`` entry point: the wrapped env and its faults."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    env: ComponentConfig
    """The environment to wrap (``impl`` + ``options``)."""
    faults: FaultSpec = FaultSpec()
    instance: int = 0
    """Seeds the start-up delay; the EnvManager numbers its instances."""
    incarnation: int = Field(0, ge=0)
    """How often this instance was rebuilt (a replica respawned at a reset): a rebuilt instance draws
    fresh start-up delay, latencies and faults instead of replaying its first life's."""


class FaultyEnv:
    """Wraps ``inner`` (any Environment) and injects the faults of ``spec``."""

    Config = FaultyEnvConfig

    @classmethod
    def check_config(cls, config: FaultyEnvConfig) -> None:
        """The wrapped env's own check (``SupportsConfigCheck``)."""
        from rollart_core.registry import check

        check("env", config.env.impl, config.env.options, "env.options")

    def __init__(
        self,
        config: FaultyEnvConfig | None = None,
        *,
        inner: Environment | None = None,
        spec: FaultSpec | None = None,
        instance: int | None = None,
        incarnation: int | None = None,
    ) -> None:
        if inner is None:
            if config is None:
                raise EnvError("FaultyEnv needs a config (with the env to wrap) or an inner env")
            from rollart_core.registry import build

            inner = build("env", config.env.impl, config.env.options, "faulty.env.options")
        self.inner = inner
        self.spec = spec or (config.faults if config else FaultSpec())
        self.instance = instance if instance is not None else (config.instance if config else 0)
        self.incarnation = incarnation if incarnation is not None else (config.incarnation if config else 0)
        self.action_vocabulary = inner.action_vocabulary
        self.system_prompt = inner.system_prompt
        self.plan = EpisodePlan("none", -1)
        self.draw_key: tuple[Any, ...] | None = None
        """Set by a wrapper before ``reset``: the episode draws its latencies and fault from this key
        instead of (instance, episode number) or its seed (:class:`StragglerEnv`'s pairing)."""
        self.episode_seed = 0
        self.calls = 0
        self.episodes = 0
        self.started = False
        self.stats = {"crashes": 0, "hangs": 0}

    async def start(self) -> None:
        """Pay the simulated start-up delay once (the EnvManager calls this at creation)."""
        if self.started:
            return
        rng = random.Random(sub_seed("start", self.spec.seed, *self._who()))
        await asyncio.sleep(_lognormal(rng, self.spec.start_delay_s, self.spec.start_delay_sigma))
        start = getattr(self.inner, "start", None)
        if callable(start):
            await start()
        self.started = True

    async def _before(self) -> None:
        spec = self.spec
        call = self.calls
        self.calls += 1
        rng = random.Random(sub_seed("latency", spec.seed, self._key(), call))
        delay = _lognormal(rng, spec.step_latency_s, spec.step_latency_sigma)
        if delay:
            await asyncio.sleep(delay)
        if call == self.plan.at_call:
            if self.plan.fault == "crash":
                self.stats["crashes"] += 1
                raise InjectedCrash(f"injected crash (episode seed {self.episode_seed}, call {call})")
            if self.plan.fault == "hang":
                self.stats["hangs"] += 1
                if spec.hang_s is None:
                    await asyncio.Event().wait()
                else:
                    await asyncio.sleep(spec.hang_s)

    def _who(self) -> tuple[int, ...]:
        return (self.instance,) if not self.incarnation else (self.instance, self.incarnation)

    def _key(self) -> Any:
        if self.draw_key is not None:
            return self.draw_key
        return (*self._who(), self.episodes) if self.spec.per_instance else self.episode_seed

    async def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        if not self.started:
            await self.start()
        self.episode_seed, self.calls = seed, 0
        self.episodes += 1
        self.plan = plan_episode(self.spec, seed, self.draw_key or (*self._who(), self.episodes))
        await self._before()
        return await self.inner.reset(seed)

    async def step(self, action_text: str) -> StepResult:
        await self._before()
        return await self.inner.step(action_text)

    async def close(self) -> None:
        await self.inner.close()


class StragglerEnvConfig(BaseModel):
    """Options of the ``straggler`` entry point."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    env: ComponentConfig
    """The environment to wrap."""
    faults: dict[str, Any] = Field(default_factory=dict)
    """A :class:`FaultSpec` (validated by ``faulty``); ``per_instance`` is forced on."""
    paired_scope: str | None = Field(None, min_length=1)
    """Common random numbers: the n-th environment of this scope (in this process) to reset on a
    seed draws its latencies and fault from (seed, n) instead of from its instance number. Two runs
    that launch the same seeds in the same order (the modes of one ``rollart bench`` round, each its
    own scope) then face the same environment, so the difference between them is the mode's and not
    the draw's; the members of a group (one seed) still draw apart. None: by instance."""


class StragglerEnv:
    """The ``faulty`` wrapper with a fresh instance number per environment object, so each
    trajectory (also within a group: same seed) draws its own latencies and crash; with
    ``paired_scope``, by (seed, its rank among the scope's resets on that seed)."""

    Config = StragglerEnvConfig
    _instances = itertools.count()
    _resets_on_seed: ClassVar[Counter[tuple[str, int]]] = Counter()

    @classmethod
    def check_config(cls, config: StragglerEnvConfig) -> None:
        """The wrapped env's own check (``SupportsConfigCheck``), without numbering an instance."""
        from rollart_core.registry import check

        check("env", config.env.impl, config.env.options, "env.options")

    def __init__(self, config: StragglerEnvConfig) -> None:
        from rollart_core.registry import build

        self.inner = build(
            "env",
            "faulty",
            {
                "env": config.env.model_dump(),
                "instance": next(self._instances),
                "faults": {**config.faults, "per_instance": True},
            },
            "straggler.options",
        )
        self.paired_scope = config.paired_scope
        self.action_vocabulary = self.inner.action_vocabulary
        self.system_prompt = self.inner.system_prompt

    async def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        if self.paired_scope is not None:  # counted before the first await: launch order decides n
            n = self._resets_on_seed[(self.paired_scope, seed)]
            self._resets_on_seed[(self.paired_scope, seed)] += 1
            self.inner.draw_key = ("paired", seed, n)
        return await self.inner.reset(seed)

    async def step(self, action_text: str) -> StepResult:
        return await self.inner.step(action_text)

    async def close(self) -> None:
        await self.inner.close()
