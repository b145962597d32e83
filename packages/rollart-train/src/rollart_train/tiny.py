"""Create the tiny Qwen2-architecture policy and its byte-level BPE tokenizer, in code.

Nothing is downloaded: the tokenizer is trained on a small corpus generated here, the model is
randomly initialised from a config (head_dim 64, which vLLM's CPU attention kernel needs), and both
are saved as a normal Hugging Face directory (safetensors + tokenizer.json + chat template), so the
same loading code serves a real checkpoint on a GPU machine.

    python -m rollart_train.tiny /tmp/tiny-qwen2
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

__all__ = ["CHAT_TEMPLATE", "SPECIAL_TOKENS", "create_tiny_model", "is_model_dir"]

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML; with ``tools`` a Qwen2.5-style ``<tools>`` block in the system turn, and an assistant's
# ``tool_calls`` as ``<tool_call>`` blocks (what vLLM's ``hermes`` parser reads). Without tools and
# tool calls it renders exactly as before. The tools block leaves out Qwen2.5's prose around the
# signatures ("You may call one or more functions ..."): a random 2-layer model cannot read it, and in
# this tokenizer (nearly a token per character there) it tripled every tool prompt (~490 tokens for
# one small tool); over such a context the tiny policy did not learn to fill a call's arguments (a
# pure-torch probe of examples/agent_calculator.yaml: no gain in 1k episodes).
CHAT_TEMPLATE = (
    "{% if tools %}"
    "{{ '<|im_start|>system\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{% endif %}"
    "{{ '<tools>' }}"
    "{% for tool in tools %}{{ '\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\n</tools><|im_end|>\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if not (tools and loop.first and message['role'] == 'system') %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') }}"
    "{% for call in message['tool_calls'] or [] %}"
    "{% set args = call['function']['arguments'] %}"
    "{{ '\n<tool_call>\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": '"
    " + (args if args is string else args | tojson) + '}\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>' + '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def is_model_dir(path: str | Path) -> bool:
    p = Path(path)
    return (
        (p / "config.json").is_file() and (p / "tokenizer.json").is_file() and (any(p.glob("*.safetensors")))
    )


def _corpus(rng: random.Random, n: int = 3000) -> list[str]:
    words = (
        "the agent moves left right up down on a frozen lake grid reach goal avoid hole start "
        "you are at position step reward done invalid action reply with one letter answer tool "
        "calculator result number plus minus times equals code test pass fail system user assistant"
    ).split()
    lines = []
    for _ in range(n):
        # no grid rows here: BPE would merge runs of map cells ("FFH", "HF") into one token, and a
        # small policy then cannot tell where a hole is; every cell letter stays a token of its own
        lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(4, 16))))
        lines.append(f"{rng.randint(0, 999)} + {rng.randint(0, 999)} = {rng.randint(0, 1998)}")
    return lines


def _token_id(tokenizer: Any, token: str) -> int:
    found = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(found, int):
        raise TypeError(f"the tiny tokenizer has no single id for {token!r}: {found!r}")
    return found


def create_tiny_model(
    path: str | Path,
    *,
    vocab_size: int = 512,
    hidden_size: int = 256,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 512,
    max_positions: int = 4096,
    dtype: str = "float32",
    seed: int = 0,
) -> Path:
    """Write a tiny random Qwen2 model + tokenizer to ``path`` (overwrites) and return the path."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    if hidden_size // num_heads != 64:
        raise ValueError("head_dim must be 64 (vLLM's CPU attention kernel); adjust hidden/heads")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(random.Random(seed)), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)

    n_vocab = len(fast)
    padded_vocab = ((n_vocab + 63) // 64) * 64
    torch_dtype = getattr(torch, dtype)
    config = Qwen2Config(
        vocab_size=padded_vocab,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        bos_token_id=_token_id(fast, "<|endoftext|>"),
        eos_token_id=_token_id(fast, "<|im_end|>"),
        pad_token_id=_token_id(fast, "<|endoftext|>"),
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    config.dtype = dtype
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch_dtype)
    model.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": config.eos_token_id, "pad_token_id": config.pad_token_id})
    )
    return out


if __name__ == "__main__":
    print(create_tiny_model(sys.argv[1] if len(sys.argv) > 1 else "tiny-qwen2"))
