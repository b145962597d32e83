"""Built-in reward functions for environments that already know whether the agent succeeded."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from rollart_core.types import RewardResult, Trajectory

__all__ = ["EnvReturnReward", "SuccessReward"]


class EnvReturnReward:
    """The sum of the environment's per-step rewards."""

    stateless = True

    async def score(self, trajectory: Trajectory) -> RewardResult:
        return RewardResult(trajectory.env_return, {"env_return": trajectory.env_return})


class SuccessConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    success: float = 1.0
    failure: float = 0.0


class SuccessReward:
    """``success`` if the episode terminated with the environment reporting success, else ``failure``."""

    Config = SuccessConfig
    stateless = True

    def __init__(self, config: SuccessConfig | None = None) -> None:
        self.config = config or SuccessConfig()

    async def score(self, trajectory: Trajectory) -> RewardResult:
        ok = bool(trajectory.info.get("success")) and trajectory.terminated
        return RewardResult(self.config.success if ok else self.config.failure, {"success": ok})
