"""rollart-reward: reward functions and the executors that run them.

Public API:
- rewards: :class:`SuccessReward`, :class:`EnvReturnReward`
- executors: :class:`InlineExecutor`
"""

from rollart_reward.builtin import EnvReturnReward, SuccessReward
from rollart_reward.executor import InlineExecutor

__all__ = ["EnvReturnReward", "InlineExecutor", "SuccessReward"]
