"""Hardware affinity (R1): decorators that *record* where a worker runs best, and nothing else.

The spec is turned into Ray actor options only when the pipeline is built, so every decorated
class stays usable and testable without Ray.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, TypeVar

from rollart_core.errors import ConfigError

__all__ = ["AffinitySpec", "affinity", "get_affinity", "ray_actor_options"]

C = TypeVar("C", bound=type)
_ATTR = "__rollart_affinity__"


@dataclass(frozen=True, slots=True)
class AffinitySpec:
    pool: str | None = None
    """Named pool / hardware class (a Ray custom resource), e.g. ``"H800"``, ``"H20"``, ``"env"``."""
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    memory_bytes: int | None = None
    count: int = 1
    colocate_with: str | None = None
    """Name of another worker whose node(s) this one must share (one placement group, packed)."""
    serverless: bool = False
    labels: tuple[tuple[str, str], ...] = ()
    """Node labels the worker needs (``ray start --labels k=v``), as sorted ``(key, value)`` pairs."""

    @property
    def label_selector(self) -> dict[str, str]:
        return dict(self.labels)


def affinity(
    *,
    pool: str | None = None,
    num_cpus: float = 1.0,
    num_gpus: float = 0.0,
    memory_bytes: int | None = None,
    count: int = 1,
    colocate_with: str | None = None,
    serverless: bool = False,
    labels: dict[str, str] | None = None,
) -> Any:
    """Record an :class:`AffinitySpec` on the decorated class and return the class unchanged."""
    if num_cpus < 0 or num_gpus < 0 or count < 1:
        raise ConfigError("affinity: num_cpus/num_gpus must be >= 0 and count >= 1")
    if serverless and (num_gpus or colocate_with or labels):
        raise ConfigError("affinity: a serverless worker takes no GPUs, colocation or node labels")
    spec = AffinitySpec(
        pool,
        num_cpus,
        num_gpus,
        memory_bytes,
        count,
        colocate_with,
        serverless,
        tuple(sorted((labels or {}).items())),
    )

    def deco(cls: C) -> C:
        setattr(cls, _ATTR, spec)
        return cls

    return deco


def get_affinity(cls: type, **overrides: Any) -> AffinitySpec:
    """The class's recorded spec (a default one if undecorated), with non-None overrides applied."""
    spec = getattr(cls, _ATTR, None) or AffinitySpec()
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if isinstance(overrides.get("labels"), dict):
        overrides["labels"] = tuple(sorted(overrides["labels"].items()))
    return replace(spec, **overrides) if overrides else spec


def ray_actor_options(spec: AffinitySpec) -> dict[str, Any]:
    """Ray ``.options(...)`` for one actor of this spec: CPUs, GPUs, memory and one pool unit."""
    if spec.serverless:
        raise ConfigError("a serverless worker has no actor placement")
    opts: dict[str, Any] = {"num_cpus": spec.num_cpus, "num_gpus": spec.num_gpus}
    if spec.memory_bytes:
        opts["memory"] = spec.memory_bytes
    if spec.pool:
        opts["resources"] = {spec.pool: 1}
    if spec.labels:
        opts["label_selector"] = spec.label_selector
    return opts
