"""Reward executors. ``InlineExecutor`` runs the function in the caller's event loop, with retries."""

from __future__ import annotations

import logging
import time

from rollart_core.errors import RewardError
from rollart_core.protocols import RewardFunction
from rollart_core.types import RewardResult, Trajectory

__all__ = ["InlineExecutor"]

log = logging.getLogger(__name__)


class InlineExecutor:
    """Calls ``fn.score`` in-process; retries a raising function, then raises :class:`RewardError`."""

    def __init__(self, fn: RewardFunction, *, retries: int = 1) -> None:
        self.fn = fn
        self.retries = retries
        self.calls = 0
        self.failures = 0
        self.busy_s = 0.0

    async def score(self, trajectory: Trajectory) -> RewardResult:
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            t0 = time.perf_counter()
            try:
                self.calls += 1
                return await self.fn.score(trajectory)
            except Exception as exc:
                last = exc
                self.failures += 1
                log.warning("reward for %s failed (attempt %d): %r", trajectory.traj_id, attempt + 1, exc)
            finally:
                self.busy_s += time.perf_counter() - t0
        raise RewardError(f"reward for {trajectory.traj_id} failed after {self.retries + 1} attempts: {last}")
