"""Checks of a Hugging Face model directory before anything starts on it.

A tokenizer whose vocabulary does not fit the model's embedding would index past the embedding on
the first out-of-range token id (an engine crash or, on some kernels, silent garbage); a config that
names no architecture cannot be served. Both are user mistakes, found here with the file named.
"""

from __future__ import annotations

import json
from pathlib import Path

from rollart_core.errors import ConfigError

__all__ = ["check_model_dir"]


def check_model_dir(path: str | Path) -> dict[str, int]:
    """ConfigError naming the file when ``path``'s ``config.json`` or ``tokenizer.json`` is missing or
    unreadable, or when the tokenizer has more token ids than the model's ``vocab_size``. Returns the
    two sizes."""
    from tokenizers import Tokenizer

    root = Path(path)
    cfg_path, tok_path = root / "config.json", root / "tokenizer.json"
    for f in (cfg_path, tok_path):
        if not f.is_file():
            raise ConfigError(f"model {root}: no {f.name} (need a Hugging Face model directory)")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model {cfg_path}: not a readable JSON file ({exc})") from None
    cfg = cfg.get("text_config", cfg)  # multimodal configs keep the language model's fields there
    vocab = cfg.get("vocab_size")
    if not isinstance(vocab, int) or vocab <= 0:
        raise ConfigError(f"model {cfg_path}: no positive integer vocab_size")
    try:
        tok = Tokenizer.from_file(str(tok_path))
    except Exception as exc:  # tokenizers raises its own Exception type for a malformed file
        raise ConfigError(f"model {tok_path}: not a readable fast tokenizer ({exc})") from None
    n = tok.get_vocab_size(with_added_tokens=True)
    ids = [tok.token_to_id(t) for t in tok.get_vocab(with_added_tokens=True)]
    top = max((i for i in ids if i is not None), default=-1) + 1
    if max(n, top) > vocab:
        raise ConfigError(
            f"model {tok_path}: the tokenizer has {max(n, top)} token ids but the model "
            f"({cfg_path}) has an embedding of vocab_size {vocab}: they do not belong together"
        )
    return {"tokenizer_size": max(n, top), "vocab_size": vocab}
