"""The rollart error hierarchy: one root, user mistakes apart from runtime failures."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pydantic import ValidationError

__all__ = [
    "ConfigError",
    "EngineError",
    "EnvError",
    "EnvTimeoutError",
    "InvalidActionError",
    "MissingExtraError",
    "RegistryError",
    "RewardError",
    "RollartError",
    "TrainerError",
    "WeightSyncError",
    "validation_details",
]


class RollartError(Exception):
    """Root of every error rollart raises on purpose."""


class ConfigError(RollartError, ValueError):
    """A user-supplied configuration is invalid (names the file and field where known)."""


class RegistryError(ConfigError):
    """An implementation name or ``package.module:Class`` path could not be resolved."""


class MissingExtraError(RollartError, ImportError):
    """An optional back-end is not installed; the message names the install command."""


class EngineError(RollartError):
    """An inference engine failed or rejected a request."""


class EnvError(RollartError):
    """An environment failed (raised, hung, or its worker died)."""


class EnvTimeoutError(EnvError):
    """An environment call (reset/step/start-up) exceeded its timeout."""


class InvalidActionError(RollartError):
    """The model's action is one the environment cannot carry out (a tool call that overflows, a
    command the environment rejects): the model's fault, not the environment's.

    An environment raises it from ``step()`` instead of letting the action crash it; the runner ends
    the episode (``terminated``) with ``reward`` as the turn's reward, the task's failure reward, and
    scores the trajectory as usual: fate ``finished``, never ``env_failed``, so a policy cannot
    escape a bad episode by crashing its environment. Not an :class:`EnvError`, which is kept for
    the environment's own faults (a dead actor, a host timeout, a bug not caused by the action)."""

    def __init__(self, message: str, reward: float = 0.0) -> None:
        super().__init__(message)
        self.reward = float(reward)

    def __reduce__(self) -> tuple[type[InvalidActionError], tuple[str, float]]:
        # across process boundaries (Ray actors): keep the reward, not only the message
        return (type(self), (str(self), self.reward))


class RewardError(RollartError):
    """A reward function failed after its retries."""


class TrainerError(RollartError):
    """A trainer failed to take a step or to save/load state."""


class WeightSyncError(RollartError):
    """A weight store could not commit or deliver a version."""


def validation_details(exc: ValidationError, prefix: str = "") -> list[str]:
    """One ``field: message`` per error of a pydantic ``ValidationError``, the field's path dotted
    and put under ``prefix`` (``(root)`` for an error about the whole object)."""
    out = []
    for err in exc.errors():
        loc = ".".join(str(part) for part in err["loc"])
        field = f"{prefix}.{loc}" if prefix and loc else (prefix or loc or "(root)")
        out.append(f"{field}: {err['msg']}")
    return out
