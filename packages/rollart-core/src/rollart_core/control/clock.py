"""The version clock: the policy versions the control plane reasons with, and their rules.

A run's clock belongs to its :class:`~rollart_core.control.state.RunState`, which moves it (and wakes
whoever waits on a version); the planner's simulation keeps one of its own.

- ``trained``: the version of the trainer's current weights (0 initially, +1 per train step);
- ``served``: the version the engines serve; new trajectories start on it;
- ``coming``: a newer version the engines will serve without waiting for anything the rollout does
  (async mode, update on arrival: set once a batch is taken for training); groups may be admitted
  on it ahead of time, their first generation waits for it;
- ``last_batch``: the trainer version at which the last batch was taken.

Invariants, checked on every move (a violation is a bug in a recipe, raised as ``ClockError``):
``served <= trained``, ``served < coming <= trained + 1``, ``last_batch <= trained``, and every
version only moves forward.
"""

from __future__ import annotations

from rollart_core.errors import RollartError

__all__ = ["ClockError", "VersionClock"]


class ClockError(RollartError):
    """A recipe moved a version backwards or past another it depends on."""


class VersionClock:
    def __init__(self, trained: int = 0) -> None:
        self.trained = trained
        self.served = trained
        self.coming: int | None = None
        self.last_batch: int | None = None

    def trained_to(self, version: int) -> None:
        """The trainer produced ``version`` (normally ``trained + 1``; more after a restart that
        rebased its versions)."""
        if version <= self.trained:
            raise ClockError(f"trained version went from {self.trained} to {version}")
        self.trained = version

    def serve(self, version: int) -> None:
        """The engines serve ``version`` from now on."""
        if not self.served <= version <= self.trained:
            raise ClockError(f"cannot serve version {version}: served {self.served}, trained {self.trained}")
        self.served = version
        if self.coming is not None and self.coming <= version:
            self.coming = None

    def expect(self, version: int) -> None:
        """``version`` will be served without waiting for the rollout (groups may start on it)."""
        if not self.served < version <= self.trained + 1:
            raise ClockError(f"cannot expect version {version}: served {self.served}, trained {self.trained}")
        self.coming = version

    def batch_taken(self) -> None:
        """A batch was taken for training at the current trained version."""
        self.last_batch = self.trained

    def next_batch_version(self) -> int:
        """The earliest trainer version the next batch can be trained at."""
        return max(self.served, (self.last_batch if self.last_batch is not None else -1) + 1)

    def start_versions(self) -> list[int]:
        """Versions a group launched now may start on: the served one, then the coming one."""
        return [self.served] + (
            [self.coming] if self.coming is not None and self.coming > self.served else []
        )

    def resume_at(self, version: int) -> None:
        """A run resumed from a checkpoint: trainer and engines are at ``version``."""
        self.trained = self.served = version
        self.coming = self.last_batch = None

    def __repr__(self) -> str:
        return (
            f"VersionClock(trained={self.trained}, served={self.served}, coming={self.coming}, "
            f"last_batch={self.last_batch})"
        )
