"""Configuration of :class:`~rollart_train.megatron_trainer.MegatronTrainer` and of its ranks in a
:class:`~rollart_train.RayTrainerGroup` (``worker: megatron``). No torch or megatron import here: the
driver validates a plan with it before any rank starts."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["MegatronTrainerConfig"]


class MegatronTrainerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    # parallelism ------------------------------------------------------------------------------
    tensor_parallel: int = Field(1, ge=1)
    """Tensor-parallel size (TP): each layer's weights split over this many ranks."""
    pipeline_parallel: int = Field(1, ge=1)
    """Pipeline-parallel size (PP): the layers split into this many stages. Data parallelism is
    ``world_size / (tensor_parallel * pipeline_parallel)``."""
    world_size: int | None = Field(None, ge=1)
    """Ranks in all (set by a worker group from its ``ranks``). None: whatever the process group holds
    (torchrun's, or a world of one). Checked against TP x PP here and against the process group at start."""

    # optimiser and objective ------------------------------------------------------------------
    lr: float = Field(1e-5, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float = Field(1.0, gt=0)
    loss: Literal["ppo_clip", "decoupled_ppo"] = "ppo_clip"
    """As TorchTrainer: decoupled_ppo recomputes proximal logprobs for tokens of older versions."""
    clip_eps: float = Field(0.2, gt=0)
    clip_eps_high: float | None = None
    tis_cap: float | None = Field(None, gt=0)
    tis_mode: Literal["truncate", "mask"] = "truncate"
    kl_coef: float = Field(0.0, ge=0)
    """KL to the behaviour policy (no reference model in this trainer yet)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    entropy_coef: float = Field(0.0, ge=0)
    scale_adv_by_std: bool = True
    advantage: Literal["grpo", "gigpo"] = "grpo"
    """As TorchTrainer: ``grpo`` one group-relative advantage per trajectory; ``gigpo`` (multi-turn)
    adds a step-level advantage per turn (:func:`~rollart_train.losses.step_advantages`)."""
    gamma: float = Field(1.0, gt=0, le=1)
    """gigpo: per-turn discount of the episode reward for the step-level returns."""
    step_adv_weight: float = Field(1.0, ge=0)
    """gigpo: weight of the step-level advantage added to the episode-level one."""
    loss_agg: Literal["token_mean", "trajectory_mean"] = "token_mean"
    """As TorchTrainer: ``token_mean`` weighs every generated token the same; ``trajectory_mean``
    every trajectory (its tokens share the weight), so each task of a multi-task batch gets its
    share of the batch's trajectories however many tokens its episodes generate."""
    match_sampling: bool = False
    """As TorchTrainer: the policy's logprobs (and entropy) under the restriction
    (``allowed_token_ids``) and temperature each token was sampled with. Requires behaviour logprobs
    of the processed distribution (vLLM ``logprobs_mode: processed_logprobs``)."""
    micro_batch_size: int = Field(4, ge=1)
    """Sequences per micro-batch (right-padded to the batch's longest, a multiple of 8)."""

    # hardware ---------------------------------------------------------------------------------
    device: Literal["cuda", "cpu"] = "cuda"
    """``cuda``: Megatron DDP, its (distributed) optimizer and ``get_forward_backward_func`` schedules
    over NCCL. ``cpu`` (tests and debugging, float32, ``pipeline_parallel: 1``): the same GPTModel and
    tensor-parallel layers over gloo, but torch AdamW with a tensor-parallel-aware gradient clip and a
    plain micro-batch loop in place of Megatron's DDP, optimizer and schedules, which allocate on CUDA."""
    dist_backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Collective back-end of a process group the trainer (or its worker group) creates. ``auto``: NCCL
    with ``device: cuda``, gloo on CPU. ``gloo`` with CUDA lets several ranks share one GPU (NCCL refuses
    two ranks on one device): for checks on a one-GPU machine, not for speed."""
    bf16: bool = True
    use_distributed_optimizer: bool = True
    """Shard the optimizer state over data-parallel ranks (``device: cuda`` only)."""
    num_threads: int | None = Field(None, ge=1)
    """torch intra-op threads per rank (default: the rank's CPUs in a worker group)."""
    rank_timeout_s: float = Field(900.0, gt=0)
    """Timeout of the process group's collectives."""
    seed: int = 0

    # state ------------------------------------------------------------------------------------
    resume_from: str | None = None
    """Checkpoint written by ``save`` (or a directory of ``checkpoint-<step>`` directories: the newest)
    to continue from: weights and version; the optimizer state too when it was saved with the same
    TP / PP / DP layout and device."""

    @model_validator(mode="after")
    def _check(self) -> MegatronTrainerConfig:
        tp, pp = self.tensor_parallel, self.pipeline_parallel
        if self.world_size is not None and self.world_size % (tp * pp):
            raise ValueError(
                f"tensor_parallel ({tp}) x pipeline_parallel ({pp}) = {tp * pp} must divide the number "
                f"of ranks ({self.world_size}): data parallelism is ranks / (tensor_parallel x "
                "pipeline_parallel)"
            )
        if self.device == "cpu":
            if pp > 1:
                raise ValueError(
                    f"device: cpu runs pipeline_parallel 1 only (got {pp}): Megatron's pipeline "
                    "schedules allocate on CUDA"
                )
            if self.bf16:
                raise ValueError("device: cpu trains in float32: set bf16: false")
        if self.dist_backend == "nccl" and self.device == "cpu":
            raise ValueError("dist_backend: nccl needs device: cuda")
        if self.tis_cap is not None and self.loss != "decoupled_ppo":
            raise ValueError("tis_cap needs loss: decoupled_ppo")
        return self
