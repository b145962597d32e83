"""Token-level ChatML formatting for multi-turn trajectories (Qwen2-style templates).

Turns are appended as token ids, never re-tokenised from text, so the ids the trainer sees are
exactly the ids the engine saw.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rollart_core.errors import ConfigError

__all__ = ["ChatMLFormat"]


class ChatMLFormat:
    """``<|im_start|>role\\ncontent<|im_end|>\\n`` turns over a Hugging Face ``tokenizer.json``."""

    def __init__(self, model_path: str | Path) -> None:
        from tokenizers import Tokenizer

        path = Path(model_path) / "tokenizer.json"
        if not path.is_file():
            raise ConfigError(f"{model_path}: no tokenizer.json (need a Hugging Face fast tokenizer)")
        self._tok = Tokenizer.from_file(str(path))
        self.im_start = self._special("<|im_start|>")
        self.im_end = self._special("<|im_end|>")

    def _special(self, token: str) -> int:
        tid = self._tok.token_to_id(token)
        if tid is None:
            raise ConfigError(f"tokenizer has no {token!r} token: not a ChatML tokenizer")
        return tid

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def first_turn(self, system: str | None, user: str) -> list[int]:
        text = ""
        if system:
            text += f"<|im_start|>system\n{system}<|im_end|>\n"
        text += f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
        return self.encode(text)

    def next_turn(self, user: str, previous_output: Sequence[int]) -> list[int]:
        closed = bool(previous_output) and previous_output[-1] == self.im_end
        prefix = "" if closed else "<|im_end|>"
        return self.encode(f"{prefix}\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")

    def action_token_ids(self, actions: Sequence[str]) -> list[int]:
        ids = []
        for a in actions:
            enc = self.encode(a)
            if len(enc) != 1:
                raise ConfigError(f"action {a!r} is {len(enc)} tokens; a discrete action must be one token")
            ids.append(enc[0])
        return ids

    def stop_token_ids(self) -> list[int]:
        return [self.im_end]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)
