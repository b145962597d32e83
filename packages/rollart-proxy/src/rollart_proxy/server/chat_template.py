"""The model's own chat template (Jinja, from the model directory) over its fast tokenizer.

Used by the OpenAI-compatible endpoint to turn ``messages`` into the exact prompt token ids the
engine sees (and the trainer records). Reads ``tokenizer.json`` plus ``chat_template.jinja`` or
``tokenizer_config.json["chat_template"]``; needs no transformers.

A template that does not render ``tools`` (plain ChatML such as SmolLM2's) gets tools, tool calls and
tool results as ordinary messages in the Hermes / Qwen2.5 form (:func:`.tools.hermes_messages`),
so the model sees instructions it can follow and every turn stays ChatML. A template that renders
tools itself is used as it is.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rollart_core.errors import ConfigError
from rollart_proxy.server.tools import hermes_messages

__all__ = ["ChatTemplate"]


class ChatTemplate:
    def __init__(self, model_path: str | Path) -> None:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        from tokenizers import Tokenizer

        root = Path(model_path)
        tok = root / "tokenizer.json"
        if not tok.is_file():
            raise ConfigError(f"{model_path}: no tokenizer.json (need a Hugging Face fast tokenizer)")
        self._tok = Tokenizer.from_file(str(tok))
        cfg_path = root / "tokenizer_config.json"
        cfg: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        template = cfg.get("chat_template")
        if (root / "chat_template.jinja").is_file():
            template = (root / "chat_template.jinja").read_text()
        if isinstance(template, list):  # named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if not template:
            raise ConfigError(
                f"{model_path}: no chat template (chat_template.jinja or tokenizer_config.json)"
            )
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        self._template = env.from_string(template)
        self._special = {k: _token_str(cfg.get(k)) for k in ("bos_token", "eos_token", "pad_token")}
        eos = self._special.get("eos_token")
        self.eos_token_id = self._tok.token_to_id(eos) if eos else None
        self.renders_tools = self._renders_tools(template)
        """Whether the template writes ``tools`` itself; if not, :meth:`render` writes them (Hermes form)."""

    def _renders_tools(self, source: str) -> bool:
        name = f"rollart_probe_{secrets.token_hex(4)}"
        probe = [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}]
        try:
            text = self._render([{"role": "user", "content": "hi"}], True, tools=probe)
        except Exception:  # a template that refuses the probe: trust its source
            return "tools" in source
        return name in text

    def render(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        if not self.renders_tools:
            messages = hermes_messages(list(messages), kwargs.pop("tools", None))
        return self._render(messages, add_generation_prompt, **kwargs)

    def _render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool, **kwargs: Any) -> str:
        return self._template.render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            **{k: v or "" for k, v in self._special.items()},
            **kwargs,
        )

    def encode_messages(self, messages: Sequence[dict[str, Any]], **kwargs: Any) -> list[int]:
        return self.encode(self.render(messages, **kwargs))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_str(self, tid: int) -> str:
        return self._tok.id_to_token(tid) or ""

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)


def _token_str(v: Any) -> str | None:
    if isinstance(v, dict):
        return v.get("content")
    return v


def _raise(msg: str) -> None:
    raise ConfigError(f"chat template: {msg}")
