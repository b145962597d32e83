"""In-process reward executors: ``InlineExecutor`` (the caller's event loop) and ``PoolExecutor`` (a
fixed pool of worker slots, i.e. a dedicated colocated reward worker sized for the peak).

Every call has a timeout (``timeout_s``): past it the call is cancelled and the executor raises a
:class:`RewardError` naming the reward and the limit (a timed-out call is not retried: the same input
would time out again). A timeout can only cancel a reward that yields to the event loop; the built-in
rewards do (their CPU-bound parts run in killable worker processes, :mod:`rollart_reward._bounded`).
"""

from __future__ import annotations

import asyncio
import logging
import time

from pydantic import BaseModel, ConfigDict, Field

from rollart_core.errors import RewardError
from rollart_core.protocols import RewardFunction
from rollart_core.types import RewardResult, Trajectory
from rollart_reward.metrics import UtilisationMeter

__all__ = ["InlineExecutor", "InlineExecutorConfig", "PoolExecutor", "PoolExecutorConfig"]

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 60.0


async def score_with_retries(
    fn: RewardFunction,
    trajectory: Trajectory,
    retries: int,
    meter: UtilisationMeter,
    queue_s: float = 0.0,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
) -> RewardResult:
    """``fn.score`` with ``retries`` extra attempts, each at most ``timeout_s``; :class:`RewardError` after
    the last attempt or on a timeout."""
    last: Exception | None = None
    for attempt in range(retries + 1):
        t0 = time.perf_counter()
        try:
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation that arrives
            # as the call completes, and a cancelled caller then runs on (a bench worker looped forever)
            async with asyncio.timeout(timeout_s):
                result = await fn.score(trajectory)
        except TimeoutError:
            meter.record(busy_s=time.perf_counter() - t0, queue_s=queue_s, ok=False)
            raise RewardError(
                f"reward {type(fn).__name__} for {trajectory.traj_id} timed out after "
                f"{timeout_s:g} s (executor timeout_s)"
            ) from None
        except Exception as exc:
            last = exc
            meter.record(busy_s=time.perf_counter() - t0, queue_s=queue_s, ok=False)
            if attempt < retries:
                meter.retries += 1
            log.warning(
                "reward for %s failed (attempt %d/%d): %r", trajectory.traj_id, attempt + 1, retries + 1, exc
            )
            queue_s = 0.0
            continue
        meter.record(busy_s=time.perf_counter() - t0, queue_s=queue_s)
        return result
    raise RewardError(
        f"reward for {trajectory.traj_id} failed after {retries + 1} attempts: {last!r}"
    ) from last


class InlineExecutorConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    retries: int = Field(1, ge=0)
    timeout_s: float = Field(DEFAULT_TIMEOUT_S, gt=0)
    """Limit of one reward call; past it the call is cancelled and a RewardError names the reward."""


class InlineExecutor:
    """Calls ``fn.score`` in-process; retries a raising function, then raises :class:`RewardError`.

    ``InlineExecutor(fn, retries=1, timeout_s=60)`` or, from a config, ``InlineExecutor(config, fn=fn)``.
    ``stats()['provisioned_s']`` is wall time since creation (one event loop held for rewards)."""

    Config = InlineExecutorConfig

    def __init__(
        self,
        fn_or_config: RewardFunction | InlineExecutorConfig | None = None,
        /,
        *,
        fn: RewardFunction | None = None,
        retries: int | None = None,
        timeout_s: float | None = None,
    ) -> None:
        config = fn_or_config if isinstance(fn_or_config, InlineExecutorConfig) else None
        fn = fn if config is not None or fn_or_config is None else fn_or_config  # type: ignore[assignment]
        if fn is None:
            raise TypeError(
                "InlineExecutor needs a reward function: InlineExecutor(fn) or InlineExecutor(config, fn=fn)"
            )
        overrides = {k: v for k, v in (("retries", retries), ("timeout_s", timeout_s)) if v is not None}
        self.config = InlineExecutorConfig.model_validate(
            {**(config or InlineExecutorConfig()).model_dump(), **overrides}
        )
        self.fn = fn
        self.retries = self.config.retries
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
            return await score_with_retries(
                self.fn, trajectory, self.retries, self.meter, timeout_s=self.config.timeout_s
            )
        finally:
            self.meter.leave()

    def stats(self) -> dict[str, float]:
        return self.meter.stats()


class PoolExecutorConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    workers: int = Field(4, ge=1)
    """Fixed number of concurrent slots, provisioned for the whole run (a dedicated reward worker)."""
    retries: int = Field(1, ge=0)
    timeout_s: float = Field(DEFAULT_TIMEOUT_S, gt=0)
    """Limit of one reward call (queueing for a slot not included)."""


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
                return await score_with_retries(
                    self.fn,
                    trajectory,
                    self.config.retries,
                    self.meter,
                    queue_s=time.perf_counter() - t0,
                    timeout_s=self.config.timeout_s,
                )
            finally:
                self.meter.leave()

    def stats(self) -> dict[str, float]:
        return self.meter.stats()
