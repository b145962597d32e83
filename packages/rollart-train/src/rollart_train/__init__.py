"""rollart-train: trainers, RL losses and advantage estimators.

Public API:
- :class:`TorchTrainer` / :class:`TorchTrainerConfig` — Hugging Face causal LM, FSDP2 over N ranks,
  token-level packing, PPO-clip / decoupled PPO with truncated IS, KL and entropy terms, checkpoints
  with resume; :class:`TorchRankWorker` — one rank of it (usable under torchrun)
- losses: :func:`grpo_advantages`, :func:`ppo_clip_loss`, :func:`decoupled_ppo_loss`,
  :func:`behaviour_weights`, :func:`kl_penalty`, :func:`entropy_from_logits`, :func:`token_logprobs`
- :class:`MegatronTrainer` (extra ``[megatron]``, imported lazily from ``rollart_train.megatron_trainer``)
  and the HF↔Megatron weight conversion in ``rollart_train.megatron_convert``
- :func:`create_tiny_model` — the tiny random Qwen2 + tokenizer, built in code

Importing this package imports torch (it is the training back-end).
"""

from rollart_train.losses import (
    behaviour_weights,
    decoupled_ppo_loss,
    entropy_from_logits,
    grpo_advantages,
    kl_penalty,
    ppo_clip_loss,
    token_logprobs,
)
from rollart_train.tiny import create_tiny_model, is_model_dir
from rollart_train.torch_config import TorchTrainerConfig
from rollart_train.torch_rank import TorchRankWorker
from rollart_train.torch_trainer import TorchTrainer

__all__ = ["TorchRankWorker", "TorchTrainer", "TorchTrainerConfig", "behaviour_weights", "create_tiny_model",
           "decoupled_ppo_loss", "entropy_from_logits", "grpo_advantages", "is_model_dir", "kl_penalty",
           "ppo_clip_loss", "token_logprobs"]
