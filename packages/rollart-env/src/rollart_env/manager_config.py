"""What :class:`~rollart_env.manager.EnvManager` is configured with: its environment groups
(:class:`EnvGroupConfig`), actors, timeouts and replication (:class:`EnvManagerConfig`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rollart_env.faults import FaultSpec

__all__ = ["EnvGroupConfig", "EnvManagerConfig"]


class EnvGroupConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    impl: str
    """Registered env name (``rollart.env`` entry point) or ``package.module:Class``."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Validated by the env's own ``Config`` inside the actor."""
    num_envs: int = Field(8, ge=1)
    """Environments kept alive for this task (replacements restore the count)."""
    faults: FaultSpec | None = None
    """Wrap every instance in :class:`~rollart_env.faults.FaultyEnv` (tests, benchmarks)."""
    replicas: int | None = Field(None, ge=1)
    """Environments per trajectory (:class:`~rollart_env.replicas.ReplicatedEnv`): every call goes to
    each, the first answer wins, so one replica's straggling step, crash or hang is masked without
    more generation. Only for environments deterministic given seed and actions. Extra replicas are
    taken from idle ready environments no waiting trajectory needs (size ``num_envs`` for
    ``replicas`` x concurrent trajectories); 1 disables; None: the manager's ``replicas``."""
    replica_scope: Literal["actors", "actor"] = "actors"
    """``actors``: a trajectory's replicas are other ready environments of the group, on other actors
    first (an actor's death is masked too; every env call is ``replicas`` Ray calls from the caller).
    ``actor``: every environment of the group is itself ``replicas`` instances in one actor, hedged
    on the actor's event loop: one Ray call per env call (for callers whose CPU is the limit), a
    replica dropped in an episode is rebuilt at the next reset, and an actor's death takes all the
    replicas (the trajectory fails as env_failed; ``num_envs`` counts the hedged environments)."""


class EnvManagerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    groups: dict[str, EnvGroupConfig] = Field(min_length=1)
    """Task name → its environments."""
    envs_per_actor: int = Field(16, ge=1)
    num_cpus_per_actor: float = Field(0.25, ge=0)
    pool: str | None = "env"
    """Ray custom resource of the CPU pool (one unit per actor); None = any node."""
    start_timeout_s: float = Field(300.0, gt=0)
    """Creating + starting one environment (image pulls can be slow)."""
    reset_timeout_s: float = Field(60.0, gt=0)
    step_timeout_s: float = Field(60.0, gt=0)
    episode_timeout_s: float | None = Field(None, gt=0)
    """Wall clock from reset; a call after it (or running past it) raises EnvTimeoutError."""
    acquire_timeout_s: float | None = Field(600.0, gt=0)
    """Waiting for a ready environment."""
    reuse: bool = True
    """Reuse a healthy environment for the next episode (False: a fresh one per episode)."""
    max_start_failures: int = Field(5, ge=1)
    """Consecutive failed starts of a group after which acquiring from it raises EnvError."""
    replicas: int = Field(1, ge=1)
    """Default environment replicas per trajectory for groups that do not set ``replicas`` (a run
    config reaches it as ``env_manager.options.replicas``); 1 = no replication."""

    @model_validator(mode="after")
    def _check(self) -> EnvManagerConfig:
        for name, g in self.groups.items():
            if g.impl == "faulty" and g.faults is not None:
                raise ValueError(f"groups.{name}: use either impl 'faulty' or 'faults', not both")
        return self
