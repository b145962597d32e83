"""The trainer group's config (:class:`RayTrainerGroupConfig`), the rank kinds it can run, and the
message for a group the cluster cannot place."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from rollart_core.errors import validation_details
from rollart_train._rendezvous import load

if TYPE_CHECKING:
    from rollart_core.errors import ConfigError
    from rollart_core.resources import ClusterView

__all__ = ["RayTrainerGroupConfig"]

_WORKERS: dict[str, tuple[str, str]] = {
    "torch": ("rollart_train.torch_config:TorchTrainerConfig", "rollart_train.torch_rank:TorchRankWorker"),
    "megatron": (
        "rollart_train.megatron_config:MegatronTrainerConfig",
        "rollart_train.megatron_rank:MegatronRankWorker",
    ),
}
"""Rank kinds: name → (per-rank config model, rank class), both as ``module:attr`` (imported on use).
A rank class is built and driven as :mod:`rollart_train._rendezvous` describes."""


class RayTrainerGroupConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    worker: Literal["torch", "megatron"] = "torch"
    """Rank class: ``torch`` (:class:`~rollart_train.torch_rank.TorchRankWorker`, FSDP2) or ``megatron``
    (:class:`~rollart_train.megatron_rank.MegatronRankWorker`: megatron-core with tensor / pipeline /
    data parallelism from ``options``; extra ``[megatron]`` on the ranks' nodes)."""
    ranks: int = Field(1, ge=1)
    """Number of ranks (one Ray actor each); the per-rank ``world_size``."""
    pool: str | None = None
    """Pool the ranks are placed on (a Ray custom resource such as ``H800``, a GPU model or a labelled
    CPU pool; :mod:`rollart_core.resources`). None: any node."""
    num_cpus_per_rank: float = Field(1.0, ge=0)
    """Ray CPUs reserved per rank (also the rank's torch threads unless ``options.num_threads``)."""
    num_gpus_per_rank: float = Field(0.0, ge=0)
    """Ray GPUs reserved per rank (use with ``options.device: cuda``)."""
    options: dict[str, Any] = Field(default_factory=dict)
    """The per-rank trainer config (:class:`~rollart_train.TorchTrainerConfig` for ``torch``,
    :class:`~rollart_train.megatron_config.MegatronTrainerConfig` for ``megatron``: ``tensor_parallel``
    x ``pipeline_parallel`` must divide ``ranks``); ``world_size`` comes from ``ranks``, and ``spawn``
    does not apply."""
    max_restarts: int = Field(0, ge=0)
    """How many times the group may rebuild its ranks after a rank died or a call timed out."""
    checkpoint_dir: str | None = None
    """Where restarts restore from: the newest ``checkpoint-<n>`` in it (the initial model if none).
    Must be readable from every rank's node."""
    call_timeout_s: float = Field(900.0, gt=0)
    """Longest wait for one collective call (a train step, a push, a save) before the group counts as
    failed."""
    placement_timeout_s: float = Field(120.0, gt=0)
    """Longest wait for the placement group and for the ranks to start and join the process group."""

    @model_validator(mode="after")
    def _check(self) -> RayTrainerGroupConfig:
        self.rank_config()
        return self

    def rank_config(self) -> Any:
        """The validated per-rank config (``world_size = ranks``); ValueError on a conflict."""
        config_cls = load(_WORKERS[self.worker][0])
        ws = self.options.get("world_size")
        if ws is not None and ws != self.ranks:
            raise ValueError(
                f"options.world_size ({ws}) conflicts with ranks ({self.ranks}): leave it out, "
                "the group derives it from ranks"
            )
        if self.options.get("spawn"):
            raise ValueError(
                "options.spawn does not apply to a Ray trainer group (every rank is already "
                "its own actor process): leave it out"
            )
        try:
            config = config_cls.model_validate({**self.options, "world_size": self.ranks})
        except ValidationError as exc:
            details = "; ".join(validation_details(exc))
            raise ValueError(f"options ({config_cls.__name__}): {details}") from None
        if (self.num_gpus_per_rank > 0) != (config.device == "cuda"):
            default = config_cls.model_fields["device"].default
            raise ValueError(
                f"options.device is {config.device!r} ({config_cls.__name__}'s default: {default!r}) "
                f"but num_gpus_per_rank is {self.num_gpus_per_rank:g}: device cuda and "
                "num_gpus_per_rank > 0 go together (Ray hides the GPUs from an actor that reserved none)"
            )
        return config


def _placement_message(config: RayTrainerGroupConfig, cluster: ClusterView, exc: ConfigError) -> str:
    pools = "; ".join(p.describe() for p in cluster.pools.values() if p.kind != "serverless")
    return (
        f"trainer group of {config.ranks} rank(s) on pool {config.pool or 'cpu'!r} "
        f"({config.num_cpus_per_rank:g} CPU, {config.num_gpus_per_rank:g} GPU each) cannot be placed: {exc} "
        f"[cluster pools: {pools}]"
    )
