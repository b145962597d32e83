"""TorchTrainer: a Hugging Face causal LM trained with GRPO advantages and a PPO-clip loss.

Single process in this release (CPU or one GPU); FSDP2 over several ranks comes with the
control-plane work. Sequences are right-padded per micro-batch.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from rollart_core.errors import TrainerError
from rollart_core.types import Trajectory
from rollart_train.losses import grpo_advantages, ppo_clip_loss, token_logprobs

__all__ = ["TorchTrainer", "TorchTrainerConfig"]

log = logging.getLogger(__name__)


class TorchTrainerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    lr: float = Field(1e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    max_grad_norm: float = Field(1.0, gt=0)
    clip_eps: float = Field(0.2, gt=0)
    clip_eps_high: float | None = None
    ppo_epochs: int = Field(1, ge=1)
    micro_batch_size: int = Field(16, ge=1)
    scale_adv_by_std: bool = True
    match_sampling: bool = False
    """Compute the policy's logprobs under the same restriction (``allowed_token_ids``) and
    temperature the tokens were sampled with. Requires behaviour logprobs of the processed
    distribution (vLLM ``logprobs_mode: processed_logprobs``)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    device: str = "cpu"
    num_threads: int | None = Field(None, ge=1)
    seed: int = 0


class TorchTrainer:
    Config = TorchTrainerConfig

    def __init__(self, config: TorchTrainerConfig | None = None, *, model_path: str | Path) -> None:
        from transformers import AutoModelForCausalLM

        self.config = c = config or TorchTrainerConfig()
        if c.num_threads:
            torch.set_num_threads(c.num_threads)
        torch.manual_seed(c.seed)
        self.model_path = Path(model_path)
        self.device = torch.device(c.device)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=getattr(torch, c.dtype))
        self.model.to(self.device)
        self.model.train()
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=c.lr, betas=c.betas, weight_decay=c.weight_decay
        )
        self.version = 0
        self.pad_id = int(self.model.config.pad_token_id or 0)

    # data ------------------------------------------------------------------------------------

    def _pad(self, seqs: Sequence[Sequence[float]], value: float, dtype: torch.dtype) -> torch.Tensor:
        width = max(len(s) for s in seqs)
        out = torch.full((len(seqs), width), value, dtype=dtype)
        for i, s in enumerate(seqs):
            out[i, : len(s)] = torch.tensor(list(s), dtype=dtype)
        return out.to(self.device)

    def _forward_logprobs(
        self, token_seqs: Sequence[Sequence[int]], specs: Sequence[list[tuple[int, tuple[int, ...] | None, float]]] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = self._pad(token_seqs, self.pad_id, torch.long)
        attn = self._pad([[1] * len(s) for s in token_seqs], 0, torch.long)
        logits = self.model(input_ids=tokens, attention_mask=attn).logits
        if specs is not None:
            logits = self._as_sampled(logits, specs)
        return token_logprobs(logits, tokens), attn

    def _as_sampled(self, logits: torch.Tensor, specs: Sequence[list[tuple[int, tuple[int, ...] | None, float]]]) -> torch.Tensor:
        """Apply each generated token's temperature and allowed-token restriction to the logits
        that predicted it (position p is predicted by logits at p-1)."""
        logits = logits.float()
        scale = torch.ones(logits.shape[:2], device=logits.device)
        allow: torch.Tensor | None = None
        for b, spec in enumerate(specs):
            for pos, allowed, temp in spec:
                if temp > 0:
                    scale[b, pos - 1] = 1.0 / temp
                if allowed is not None:
                    if allow is None:
                        allow = torch.ones(logits.shape, dtype=torch.bool, device=logits.device)
                    row = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
                    row[list(allowed)] = True
                    allow[b, pos - 1] = row
        logits = logits * scale.unsqueeze(-1)
        if allow is not None:
            logits = logits.masked_fill(~allow, float("-inf"))
        return logits

    @torch.no_grad()
    def logprobs(self, token_ids: Sequence[int]) -> list[float]:
        """Logprob of each token given the previous ones under the current weights (first: none)."""
        was_training = self.model.training
        self.model.eval()
        try:
            lp, _ = self._forward_logprobs([token_ids])
        finally:
            self.model.train(was_training)
        return lp[0].tolist()

    # training --------------------------------------------------------------------------------

    def train_step(self, batch: Sequence[Trajectory]) -> dict[str, float]:
        if not batch:
            raise TrainerError("train_step called with an empty batch")
        c = self.config
        t0 = time.perf_counter()
        adv = grpo_advantages(batch, scale_by_std=c.scale_adv_by_std)
        seqs = [t.token_ids() for t in batch]
        masks = [t.loss_mask() for t in batch]
        blps = [t.behaviour_logprobs() for t in batch]
        specs = [t.sampling_spec() for t in batch] if c.match_sampling else None
        n_tokens = sum(sum(m) for m in masks)
        if n_tokens == 0:
            raise TrainerError("batch has no generated tokens to train on")
        stats: dict[str, float] = {"loss": 0.0, "clip_frac": 0.0, "approx_kl": 0.0}
        n_micro = 0
        grad_norm = 0.0
        for _ in range(c.ppo_epochs):
            self.optimizer.zero_grad(set_to_none=True)
            for start in range(0, len(batch), c.micro_batch_size):
                sl = slice(start, start + c.micro_batch_size)
                logp, _ = self._forward_logprobs(seqs[sl], specs[sl] if specs is not None else None)
                mask = self._pad([m[1:] for m in masks[sl]], 0, torch.float32)
                blp = self._pad([b[1:] for b in blps[sl]], 0.0, torch.float32)
                a = torch.tensor(adv[sl], dtype=torch.float32, device=self.device).unsqueeze(1)
                loss, info = ppo_clip_loss(logp, blp, a.expand_as(mask), mask,
                                           clip_eps=c.clip_eps, clip_eps_high=c.clip_eps_high)
                # Token-mean over the whole batch: weight each micro-batch by its share of tokens.
                (loss * mask.sum() / n_tokens).backward()
                stats["loss"] += float(loss.detach())
                stats["clip_frac"] += info["clip_frac"]
                stats["approx_kl"] += info["approx_kl"]
                n_micro += 1
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), c.max_grad_norm))
            self.optimizer.step()
        self.version += 1
        rewards = [t.reward for t in batch]
        return {
            **{k: v / max(n_micro, 1) for k, v in stats.items()},
            "grad_norm": grad_norm,
            "reward_mean": sum(rewards) / len(rewards),
            "train_tokens": float(n_tokens),
            "train_s": time.perf_counter() - t0,
            "version": float(self.version),
        }

    # weights and checkpoints -----------------------------------------------------------------

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        return ((n, p.detach()) for n, p in self.model.state_dict().items())

    def save(self, path: str | Path) -> None:
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(out, safe_serialization=True)
        for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
            if (self.model_path / f).is_file():
                shutil.copy(self.model_path / f, out / f)
        torch.save({"optimizer": self.optimizer.state_dict()}, out / "trainer_state.pt")
        (out / "rollart_trainer.json").write_text(json.dumps({"version": self.version}))
