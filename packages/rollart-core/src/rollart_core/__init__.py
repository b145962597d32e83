"""rollart-core: contracts, shared types, configs, registry and the control plane.

Public API, grouped:

- protocols: :class:`InferenceEngine`, :class:`SupportsPause`, :class:`SupportsWeightUpdate`,
  :class:`Proxy`, :class:`Environment`, :class:`RewardFunction`, :class:`Trainer`,
  :class:`SupportsWeightPush`, :class:`WeightStore`, :class:`ChatFormat`
- types: :class:`Trajectory`, :class:`Turn`, :class:`Fate`, :class:`SamplingParams`,
  :class:`GenerateRequest`, :class:`GenerateOutput`, :class:`StepResult`, :class:`RewardResult`
- config: :class:`RunConfig` (and its sections), :func:`load_config`
- errors: :class:`RollartError`, :class:`ConfigError`, ...
- registry: :func:`resolve`, :func:`build`, :func:`available`
- resource plane: :func:`affinity`, :class:`AffinitySpec`
- control plane: :class:`RunState`, :class:`SampleBuffer`, :func:`run_trajectory`, :class:`VersionClock`
  (``rollart_core.control.train.train`` runs a job: one recipe per mode over named primitives)

Importing rollart_core never imports torch, vLLM, Ray or any member package.
"""

from rollart_core.config import (
    ComponentConfig,
    EngineGroupConfig,
    LoopConfig,
    ModelConfig,
    RayConfig,
    RunConfig,
    TaskConfig,
    TrainerSection,
    load_config,
)
from rollart_core.control.buffer import SampleBuffer
from rollart_core.control.clock import VersionClock
from rollart_core.control.runner import run_trajectory
from rollart_core.control.state import RunState
from rollart_core.errors import (
    ConfigError,
    EngineError,
    EnvError,
    EnvTimeoutError,
    MissingExtraError,
    RegistryError,
    RewardError,
    RollartError,
    TrainerError,
    WeightSyncError,
)
from rollart_core.protocols import (
    ChatFormat,
    Environment,
    InferenceEngine,
    Proxy,
    RewardFunction,
    SupportsPause,
    SupportsWeightPrefetch,
    SupportsWeightPush,
    SupportsWeightUpdate,
    Trainer,
    WeightStore,
)
from rollart_core.registry import available, build, resolve
from rollart_core.resources import AffinitySpec, affinity, get_affinity
from rollart_core.types import (
    Fate,
    GenerateOutput,
    GenerateRequest,
    RewardResult,
    SamplingParams,
    StepResult,
    Trajectory,
    Turn,
)

__all__ = [
    # protocols
    "ChatFormat",
    "Environment",
    "InferenceEngine",
    "Proxy",
    "RewardFunction",
    "SupportsPause",
    "SupportsWeightPrefetch",
    "SupportsWeightPush",
    "SupportsWeightUpdate",
    "Trainer",
    "WeightStore",
    # types
    "Fate",
    "GenerateOutput",
    "GenerateRequest",
    "RewardResult",
    "SamplingParams",
    "StepResult",
    "Trajectory",
    "Turn",
    # config
    "ComponentConfig",
    "EngineGroupConfig",
    "ModelConfig",
    "RayConfig",
    "RunConfig",
    "TaskConfig",
    "LoopConfig",
    "TrainerSection",
    "load_config",
    # errors
    "ConfigError",
    "EngineError",
    "EnvError",
    "EnvTimeoutError",
    "MissingExtraError",
    "RegistryError",
    "RewardError",
    "RollartError",
    "TrainerError",
    "WeightSyncError",
    # registry, resource and control planes
    "AffinitySpec",
    "RunState",
    "SampleBuffer",
    "affinity",
    "available",
    "build",
    "get_affinity",
    "resolve",
    "VersionClock",
    "run_trajectory",
]
