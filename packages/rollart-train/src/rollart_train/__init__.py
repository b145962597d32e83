"""rollart-train: trainers, RL losses and advantage estimators.

Public API:
- :class:`TorchTrainer` — Hugging Face causal LM, GRPO advantages, PPO-clip loss
- losses: :func:`grpo_advantages`, :func:`ppo_clip_loss`, :func:`token_logprobs`
- :func:`create_tiny_model` — the tiny random Qwen2 + tokenizer, built in code

Importing this package imports torch (it is the training back-end).
"""

from rollart_train.losses import grpo_advantages, ppo_clip_loss, token_logprobs
from rollart_train.tiny import create_tiny_model, is_model_dir
from rollart_train.torch_trainer import TorchTrainer, TorchTrainerConfig

__all__ = ["TorchTrainer", "TorchTrainerConfig", "create_tiny_model", "grpo_advantages", "is_model_dir",
           "ppo_clip_loss", "token_logprobs"]
