"""rollart-reward: reward functions and the executors that run them.

Public API:
- rewards: :class:`SuccessReward`, :class:`EnvReturnReward`, :class:`ExactMatchReward`,
  :class:`NumberMatchReward`, :class:`MathVerifyReward`, :class:`CodeTestsReward`, :class:`FormatReward`,
  :class:`SyntheticReward`; ``rollart_reward.judge.LLMJudgeReward``
- fault injection: :class:`BurstyReward` (``bursty``) — another reward behind a seeded log-normal cost
- executors: :class:`InlineExecutor`, :class:`PoolExecutor`, :class:`HttpExecutor`;
  ``rollart_reward.ray_executor.RayExecutor`` (needs the ``ray`` extra)
- function runtime: :class:`FunctionRuntime` (``rollart-reward serve``)
- sandbox: :func:`run_python`, :func:`run_python_async`
- wire format: :func:`trajectory_to_dict`, :func:`trajectory_from_dict`
"""

from rollart_reward.builtin import EnvReturnReward, SuccessReward
from rollart_reward.executor import InlineExecutor, PoolExecutor
from rollart_reward.faults import BurstyReward, BurstyRewardConfig
from rollart_reward.http_executor import HttpExecutor, HttpExecutorConfig
from rollart_reward.rewards import (
    CodeTestsReward,
    ExactMatchReward,
    FormatReward,
    MathVerifyReward,
    NumberMatchReward,
    SyntheticReward,
)
from rollart_reward.runtime import FunctionRuntime, RuntimeConfig
from rollart_reward.sandbox import SandboxResult, run_python, run_python_async
from rollart_reward.wire import trajectory_from_dict, trajectory_to_dict

__all__ = [
    # fault injection
    "BurstyReward",
    "BurstyRewardConfig",
    # rewards
    "CodeTestsReward",
    "EnvReturnReward",
    "ExactMatchReward",
    "FormatReward",
    # runtime
    "FunctionRuntime",
    # executors
    "HttpExecutor",
    "HttpExecutorConfig",
    "InlineExecutor",
    "MathVerifyReward",
    "NumberMatchReward",
    "PoolExecutor",
    "RuntimeConfig",
    # sandbox
    "SandboxResult",
    "SuccessReward",
    "SyntheticReward",
    "run_python",
    "run_python_async",
    # wire
    "trajectory_from_dict",
    "trajectory_to_dict",
]
