"""In-process reward executors: ``InlineExecutor`` (the caller's event loop) and ``PoolExecutor`` (a
fixed pool of worker slots, i.e. a dedicated colocated reward worker sized for the peak)."""

from __future__ import annotations

import asyncio
import logging
import time

from pydantic import BaseModel, ConfigDict, Field

from rollart_core.errors import RewardError
from rollart_core.protocols import RewardFunction
from rollart_core.types import RewardResult, Trajectory
from rollart_reward.metrics import UtilisationMeter

__all__ = ["InlineExecutor", "PoolExecutor"]

log = logging.getLogger(__name__)


async def score_with_retries(fn: RewardFunction, trajectory: Trajectory, retries: int,
                             meter: UtilisationMeter, queue_s: float = 0.0) -> RewardResult:
    """``fn.score`` with ``retries`` extra attempts; :class:`RewardError` after the last one."""
    last: Exception | None = None
    for attempt in range(retries + 1):
        t0 = time.perf_counter()
        try:
            result = await fn.score(trajectory)
        except Exception as exc:
            last = exc
            meter.record(busy_s=time.perf_counter() - t0, queue_s=queue_s, ok=False)
            if attempt < retries:
                meter.retries += 1
            log.warning("reward for %s failed (attempt %d/%d): %r", trajectory.traj_id, attempt + 1,
                        retries + 1, exc)
            queue_s = 0.0
            continue
        meter.record(busy_s=time.perf_counter() - t0, queue_s=queue_s)
        return result
    raise RewardError(f"reward for {trajectory.traj_id} failed after {retries + 1} attempts: {last!r}") from last


class InlineExecutor:
    """Calls ``fn.score`` in-process; retries a raising function, then raises :class:`RewardError`.

    ``stats()['provisioned_s']`` is wall time since creation (one event loop held for rewards)."""

    def __init__(self, fn: RewardFunction, *, retries: int = 1) -> None:
        self.fn = fn
        self.retries = retries
        self.meter = UtilisationMeter(slots=1)

    # kept for callers of the original API
    @property
    def calls(self) -> int:
        return self.meter.calls

    @property
    def failures(self) -> int:
        return self.meter.failures

    @property
    def busy_s(self) -> float:
        return self.meter.busy_s

    async def score(self, trajectory: Trajectory) -> RewardResult:
        self.meter.enter()
        try:
            return await score_with_retries(self.fn, trajectory, self.retries, self.meter)
        finally:
            self.meter.leave()

    def stats(self) -> dict[str, float]:
        return self.meter.stats()


class PoolExecutorConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    workers: int = Field(4, ge=1)
    """Fixed number of concurrent slots, provisioned for the whole run (a dedicated reward worker)."""
    retries: int = Field(1, ge=0)


class PoolExecutor:
    """A fixed pool: at most ``workers`` calls run at once; others queue. Provisioned time is
    ``workers x wall time`` whether or not the slots are used (the colocated baseline)."""

    Config = PoolExecutorConfig

    def __init__(self, config: PoolExecutorConfig | None = None, *, fn: RewardFunction) -> None:
        self.config = config or PoolExecutorConfig()
        self.fn = fn
        self.meter = UtilisationMeter(slots=self.config.workers)
        self._sem = asyncio.Semaphore(self.config.workers)

    async def score(self, trajectory: Trajectory) -> RewardResult:
        t0 = time.perf_counter()
        async with self._sem:
            self.meter.enter()
            try:
                return await score_with_retries(self.fn, trajectory, self.config.retries, self.meter,
                                                queue_s=time.perf_counter() - t0)
            finally:
                self.meter.leave()

    def stats(self) -> dict[str, float]:
        return self.meter.stats()
