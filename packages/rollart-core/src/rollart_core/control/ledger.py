"""The fate ledger: every trajectory's fate counted once, in one place.

Its only writer is the run's :class:`~rollart_core.control.state.RunState`: it records each
trajectory when it is settled, and moves the count when a finished one turns out too old to train by
the time its group is taken (``aborted_stale``). The step metrics, the run summary and the bench all
read this ledger, so their counts agree: the sum over fates is the number of trajectories that ended.

It also keeps what the stall detector needs: when a trajectory last finished, and the fates of the
most recent ones (the failure share).
"""

from __future__ import annotations

import time
from collections import Counter, deque

from rollart_core.types import Fate, Trajectory

__all__ = ["FAILED_FATES", "FateLedger"]

FAILED_FATES = {
    Fate.ENV_FAILED.value: "env",
    Fate.TIMED_OUT.value: "env",
    Fate.GENERATION_FAILED.value: "engine",
    Fate.REWARD_FAILED.value: "reward",
}
"""Fates that mean a stage failed, and the stage they name."""


class FateLedger:
    def __init__(self, window: int = 64) -> None:
        self.counts: Counter[str] = Counter()
        """Fates since the run started (``finished`` later found stale move to ``aborted_stale``)."""
        self._step: Counter[str] = Counter()
        self.recent: deque[str] = deque(maxlen=window)
        self.last_finished_at = time.monotonic()
        self.errors: Counter[str] = Counter()
        """The most frequent error text per failed fate (first 200 characters), for stall reports."""

    def record(self, traj: Trajectory) -> None:
        if traj.fate is None:
            raise ValueError(f"trajectory {traj.traj_id} has no fate")
        fate = traj.fate.value
        self.counts[fate] += 1
        self._step[fate] += 1
        self.recent.append(fate)
        if traj.fate is Fate.FINISHED:
            self.last_finished_at = time.monotonic()
        elif fate in FAILED_FATES and traj.error:
            self.errors[f"{fate}: {traj.error[:200]}"] += 1

    def relabel(self, old: Fate, new: Fate) -> None:
        """A trajectory counted as ``old`` ends as ``new`` (the buffer found it stale)."""
        for c in (self.counts, self._step):
            c[old.value] -= 1
            c[new.value] += 1

    def take_step(self) -> dict[str, int]:
        """Fate changes since the last call (a relabel of an earlier step's trajectory shows as -1/+1)."""
        out = {k: v for k, v in self._step.items() if v}
        self._step.clear()
        return out

    def failure_share(self) -> tuple[float, str | None]:
        """Share of failed fates among the recent ones, and the stage failing most."""
        if not self.recent:
            return 0.0, None
        failed = Counter(FAILED_FATES[f] for f in self.recent if f in FAILED_FATES)
        share = sum(failed.values()) / len(self.recent)
        return share, (failed.most_common(1)[0][0] if failed else None)

    def total(self) -> int:
        return sum(self.counts.values())
