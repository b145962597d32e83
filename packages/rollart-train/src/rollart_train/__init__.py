"""rollart-train: trainers, RL losses and advantage estimators.

Public API:
- :class:`TorchTrainer` / :class:`TorchTrainerConfig` — Hugging Face causal LM, FSDP2 over N ranks,
  token-level packing, PPO-clip / decoupled PPO with truncated IS, KL and entropy terms, checkpoints
  with resume; :class:`TorchRankWorker` — one rank of it (usable under torchrun)
- :class:`RayTrainerGroup` / :class:`RayTrainerGroupConfig` — the same ranks as placed, restartable
  Ray actors (``rollart_train.ray_group``)
- losses: :func:`grpo_advantages`, :func:`ppo_clip_loss`, :func:`decoupled_ppo_loss`,
  :func:`behaviour_weights`, :func:`kl_penalty`, :func:`entropy_from_logits`, :func:`token_logprobs`
- :class:`MegatronTrainer` (extra ``[megatron]``, imported lazily from ``rollart_train.megatron_trainer``;
  its config in ``rollart_train.megatron_config``), its ranks in a :class:`RayTrainerGroup`
  (``worker: megatron``, ``rollart_train.megatron_rank.MegatronRankWorker``) and the HF↔Megatron weight
  conversion in ``rollart_train.megatron_convert``
- :func:`create_tiny_model` — the tiny random Qwen2 + tokenizer, built in code

The names are exported lazily: importing the package (or ``rollart_train.ray_group``) imports neither
torch nor ray; using a trainer, a loss or the tiny model does.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollart_train.losses import (
        behaviour_weights,
        decoupled_ppo_loss,
        entropy_from_logits,
        grpo_advantages,
        kl_penalty,
        ppo_clip_loss,
        token_logprobs,
    )
    from rollart_train.ray_group import RayTrainerGroup, RayTrainerGroupConfig
    from rollart_train.tiny import create_tiny_model, is_model_dir
    from rollart_train.torch_config import TorchTrainerConfig
    from rollart_train.torch_rank import TorchRankWorker
    from rollart_train.torch_trainer import TorchTrainer

_EXPORTS = {
    "behaviour_weights": "losses",
    "decoupled_ppo_loss": "losses",
    "entropy_from_logits": "losses",
    "grpo_advantages": "losses",
    "kl_penalty": "losses",
    "ppo_clip_loss": "losses",
    "token_logprobs": "losses",
    "RayTrainerGroup": "ray_group",
    "RayTrainerGroupConfig": "ray_group",
    "create_tiny_model": "tiny",
    "is_model_dir": "tiny",
    "TorchTrainerConfig": "torch_config",
    "TorchRankWorker": "torch_rank",
    "TorchTrainer": "torch_trainer",
}

__all__ = [
    "RayTrainerGroup",
    "RayTrainerGroupConfig",
    "TorchRankWorker",
    "TorchTrainer",
    "TorchTrainerConfig",
    "behaviour_weights",
    "create_tiny_model",
    "decoupled_ppo_loss",
    "entropy_from_logits",
    "grpo_advantages",
    "is_model_dir",
    "kl_penalty",
    "ppo_clip_loss",
    "token_logprobs",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rollart_train' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"rollart_train.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
