"""Token-level ChatML formatting for multi-turn trajectories (Qwen2- and SmolLM2-style templates).

The first turn is rendered by the model's own chat template (so a template's default system prompt
is there, as the model was tuned with it); later turns are appended as token ids, never re-tokenised
from text, so the ids the trainer sees are exactly the ids the engine saw. A model directory whose
template is not ChatML, or that has none, is refused when the format is built: appending ChatML turns
to it would train the model on a format it has never seen.
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

        from rollart_proxy.server.chat_template import (
            ChatTemplate,
        )  # the server's FastAPI stays unimported until used

        path = Path(model_path) / "tokenizer.json"
        if not path.is_file():
            raise ConfigError(f"{model_path}: no tokenizer.json (need a Hugging Face fast tokenizer)")
        self._tok = Tokenizer.from_file(str(path))
        self.im_start = self._special("<|im_start|>")
        self.im_end = self._special("<|im_end|>")
        self._template = ChatTemplate(model_path)
        self._check_template(model_path)

    def _check_template(self, model_path: str | Path) -> None:
        """The template must render a second turn exactly as :meth:`next_turn` appends it."""
        for system in ("S", None):
            head = [{"role": "system", "content": system}] if system else []
            first = self._template.render([*head, {"role": "user", "content": "U1"}])
            full = self._template.render(
                [
                    *head,
                    {"role": "user", "content": "U1"},
                    {"role": "assistant", "content": "A1"},
                    {"role": "user", "content": "U2"},
                ]
            )
            appended = first + "A1<|im_end|>\n<|im_start|>user\nU2<|im_end|>\n<|im_start|>assistant\n"
            if full != appended:
                raise ConfigError(
                    f"{model_path}: the model's chat template is not ChatML (a second turn renders as "
                    f"{full[len(first) :]!r}); set model.chat_format to a format for this template"
                )

    def _special(self, token: str) -> int:
        tid = self._tok.token_to_id(token)
        if tid is None:
            raise ConfigError(f"tokenizer has no {token!r} token: not a ChatML tokenizer")
        return tid

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def first_turn(self, system: str | None, user: str) -> list[int]:
        head = [{"role": "system", "content": system}] if system else []
        return self.encode(self._template.render([*head, {"role": "user", "content": user}]))

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
