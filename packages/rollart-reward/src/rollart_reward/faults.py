"""Fault injection for tests and benchmarks on the reward side: a reward whose cost bursts.

:class:`BurstyReward` (entry point ``bursty``) scores with any other reward after a seeded log-normal
wait per trajectory, like a sandbox or a remote judge under load; ``rollart bench`` uses it.
"""

from __future__ import annotations

import asyncio
import math
import random

from pydantic import BaseModel, ConfigDict, Field

from rollart_core.config import ComponentConfig
from rollart_core.registry import build
from rollart_core.types import RewardResult, Trajectory

__all__ = ["BurstyReward", "BurstyRewardConfig"]


class BurstyRewardConfig(BaseModel):
    """Options of the ``bursty`` entry point."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    inner: ComponentConfig
    """The reward that gives the score."""
    work_s: float = Field(0.1, ge=0)
    """Median cost of one call (waited, like a sandbox or a remote judge)."""
    sigma: float = Field(1.0, ge=0)
    """Log-normal spread of the cost."""
    seed: int = 0


class BurstyReward:
    """Scores with ``inner`` after a log-normal cost drawn per trajectory (seeded by its id)."""

    Config = BurstyRewardConfig
    stateless = True

    def __init__(self, config: BurstyRewardConfig) -> None:
        self.config = config
        self.inner = build("reward", config.inner.impl, config.inner.options, "bursty.inner.options")

    def cost(self, traj_id: str) -> float:
        c = self.config
        if c.work_s <= 0:
            return 0.0
        return c.work_s * math.exp(c.sigma * random.Random(f"{c.seed}:{traj_id}").gauss(0.0, 1.0))

    async def score(self, trajectory: Trajectory) -> RewardResult:
        await asyncio.sleep(self.cost(trajectory.traj_id))
        return await self.inner.score(trajectory)
