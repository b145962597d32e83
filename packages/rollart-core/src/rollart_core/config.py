"""Configuration models. YAML in, typed objects inward; unknown fields are errors.

Implementations are chosen by name (``impl``) and validate their own ``options`` with their own
pydantic model (``Impl.Config``), so this module never needs to know every back-end.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from rollart_core.errors import ConfigError
from rollart_core.registry import _format_validation
from rollart_core.types import SamplingParams

__all__ = [
    "ComponentConfig",
    "EngineGroupConfig",
    "ModelConfig",
    "RayConfig",
    "RunConfig",
    "TaskConfig",
    "TrainConfig",
    "load_config",
]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class ComponentConfig(_Model):
    impl: str
    """Registered name (e.g. ``vllm``, ``frozenlake``) or ``package.module:Class``."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Validated by the implementation's own ``Config`` model."""


class ModelConfig(_Model):
    path: Path
    """Local Hugging Face directory (weights + tokenizer). Nothing is ever downloaded."""
    create_tiny: bool = False
    """Create the tiny random Qwen2 model and tokenizer at ``path`` if it does not exist."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    chat_format: str = "rollart_proxy.chat:ChatMLFormat"
    """Token-level chat formatting (``package.module:Class`` taking the model path)."""


class EngineGroupConfig(_Model):
    name: str
    impl: str = "vllm"
    count: int = Field(1, ge=1)
    """How many engine replicas (Ray actors)."""
    pool: str | None = None
    """Pool (Ray custom resource) the engines must run on; overrides the class's affinity."""
    num_cpus: float | None = Field(None, ge=0)
    options: dict[str, Any] = Field(default_factory=dict)


class TaskConfig(_Model):
    name: str
    env: ComponentConfig
    reward: ComponentConfig
    sampling: SamplingParams = SamplingParams()
    group_size: int = Field(8, ge=1)
    """Trajectories per group (same seed) for group-relative advantages."""
    groups_per_step: int = Field(4, ge=1)
    max_turns: int = Field(8, ge=1)
    pool: str | None = None
    """Engine group (by name) that serves this task; None = any."""


class TrainConfig(_Model):
    mode: Literal["sync"] = "sync"
    """Only ``sync`` in this release; ``one_off`` and ``async`` come with the control plane."""
    alpha: int = Field(0, ge=0)
    """Staleness bound: a trajectory started at version v is trained at version t only if t-v <= alpha."""
    steps: int = Field(10, ge=1)
    eval_every: int = Field(0, ge=0)
    eval_episodes: int = Field(32, ge=1)
    save_every: int = Field(0, ge=0)


class RayConfig(_Model):
    address: str | None = None
    """Existing cluster to join; None starts a local one on 127.0.0.1."""
    num_cpus: float | None = None
    resources: dict[str, float] = Field(default_factory=dict)
    """Custom resources standing in for pools on a local cluster, e.g. ``{H800: 1, H20: 1}``."""


class RunConfig(_Model):
    name: str = "rollart"
    output_dir: Path = Path("runs/rollart")
    seed: int = 0
    model: ModelConfig
    engines: list[EngineGroupConfig] = Field(min_length=1)
    tasks: list[TaskConfig] = Field(min_length=1)
    trainer: ComponentConfig = ComponentConfig(impl="torch")
    weight_store: ComponentConfig = ComponentConfig(impl="filesystem")
    train: TrainConfig = TrainConfig()
    ray: RayConfig = RayConfig()

    @model_validator(mode="after")
    def _cross_check(self) -> RunConfig:
        names = [e.name for e in self.engines]
        if len(set(names)) != len(names):
            raise ValueError(f"engine group names must be unique, got {names}")
        tasks = [t.name for t in self.tasks]
        if len(set(tasks)) != len(tasks):
            raise ValueError(f"task names must be unique, got {tasks}")
        for t in self.tasks:
            if t.pool is not None and t.pool not in names:
                raise ValueError(f"task {t.name!r}: pool {t.pool!r} is not an engine group ({names})")
        return self

    def resolve_paths(self, base: Path) -> RunConfig:
        """Make relative paths absolute against ``base`` (the working directory)."""
        data = self.model_copy(deep=True)
        if not data.model.path.is_absolute():
            data.model.path = (base / data.model.path).resolve()
        if not data.output_dir.is_absolute():
            data.output_dir = (base / data.output_dir).resolve()
        return data


def load_config(path: str | Path) -> RunConfig:
    """Read and validate a YAML run config. Errors name the file and the field."""
    p = Path(path)
    try:
        raw = yaml.safe_load(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{p}: no such config file") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: expected a mapping at the top level, got {type(raw).__name__}")
    try:
        cfg = RunConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(f"{p}: {_format_validation(exc)}") from None
    return cfg.resolve_paths(Path.cwd())
