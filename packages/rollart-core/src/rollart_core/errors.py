"""The rollart error hierarchy: one root, user mistakes apart from runtime failures."""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "EngineError",
    "EnvError",
    "EnvTimeoutError",
    "MissingExtraError",
    "RegistryError",
    "RewardError",
    "RollartError",
    "TrainerError",
    "WeightSyncError",
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


class RewardError(RollartError):
    """A reward function failed after its retries."""


class TrainerError(RollartError):
    """A trainer failed to take a step or to save/load state."""


class WeightSyncError(RollartError):
    """A weight store could not commit or deliver a version."""
