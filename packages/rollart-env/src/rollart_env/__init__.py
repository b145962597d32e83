"""rollart-env: environments (text in, text out) for agentic RL, and the EnvManager.

Public API:

- built-in environments (entry points in ``rollart.env``): :class:`FrozenLakeEnv` (``frozenlake``),
  :class:`SokobanEnv` (``sokoban``), :class:`CalculatorEnv` (``calculator``, tool use),
  :class:`CodeTaskEnv` (``code``, tests run in rollart-reward's sandbox)
- adapters: :class:`GymnasiumEnv` (``gymnasium``), :class:`GemEnv` (``gem``), and environments over
  HTTP: :class:`EnvServer` / :class:`RemoteEnv` (``remote``)
- :class:`EnvManager` — environments in Ray actors, timeouts, failure masking and replacement
- :func:`run_group` — redundant rollouts (launch G + k, keep the first G finished); :func:`run_batch` —
  the same per batch (launch B + m groups, keep the first B complete)
- :class:`ReplicatedEnv` — hedged calls across replicas of a deterministic env (the EnvManager's
  ``replicas``): first answer wins, a straggling, crashing or hanging replica is masked
- :class:`FaultyEnv` (``faulty``) — seeded fault injection for tests and benchmarks;
  :class:`StragglerEnv` (``straggler``) — the same with a fresh instance per object (``rollart bench``)

Nothing heavy is imported here: gymnasium, aiohttp and Ray load only when used.
"""

from rollart_env.adapters import GemConfig, GemEnv, GymnasiumConfig, GymnasiumEnv, TextWrapper
from rollart_env.calculator import CalculatorConfig, CalculatorEnv
from rollart_env.code_task import CodeTaskConfig, CodeTaskEnv
from rollart_env.faults import (
    FaultSpec,
    FaultyEnv,
    FaultyEnvConfig,
    InjectedCrash,
    StragglerEnv,
    StragglerEnvConfig,
    plan_episode,
)
from rollart_env.frozenlake import (
    ACTIONS,
    FrozenLakeConfig,
    FrozenLakeEnv,
    generate_map,
    shortest_path_length,
)
from rollart_env.manager import EnvGroupConfig, EnvManager, EnvManagerConfig, EnvWorker, ManagedEnv
from rollart_env.redundancy import BatchOutcome, GroupOutcome, RedundancyConfig, run_batch, run_group
from rollart_env.remote import EnvServer, RemoteEnv, RemoteEnvConfig
from rollart_env.replicas import ReplicatedEnv, ReplicatedEnvConfig
from rollart_env.sokoban import SokobanConfig, SokobanEnv

__all__ = [
    "BatchOutcome",
    # built-in environments
    "ACTIONS",
    "CalculatorConfig",
    "CalculatorEnv",
    "CodeTaskConfig",
    "CodeTaskEnv",
    # manager, redundancy, faults
    "EnvGroupConfig",
    "EnvManager",
    "EnvManagerConfig",
    # adapters and remote environments
    "EnvServer",
    "EnvWorker",
    "FaultSpec",
    "FaultyEnv",
    "FaultyEnvConfig",
    "FrozenLakeConfig",
    "FrozenLakeEnv",
    "GemConfig",
    "GemEnv",
    "GroupOutcome",
    "GymnasiumConfig",
    "GymnasiumEnv",
    "InjectedCrash",
    "ManagedEnv",
    "RedundancyConfig",
    "RemoteEnv",
    "ReplicatedEnv",
    "ReplicatedEnvConfig",
    "RemoteEnvConfig",
    "SokobanConfig",
    "SokobanEnv",
    "StragglerEnv",
    "StragglerEnvConfig",
    "TextWrapper",
    "generate_map",
    "plan_episode",
    "run_batch",
    "run_group",
    "shortest_path_length",
]
