"""A GGUF checkpoint in, a Hugging Face model directory out: converted once, checked once, cached.

    python -m rollart_train.gguf FILE.gguf OUT_DIR [--dtype bfloat16]

transformers' GGUF loader dequantises the file into a normal ``*ForCausalLM``; this module writes that
model as a plain HF directory (``config.json``, ``model.safetensors``, ``tokenizer.json``,
``tokenizer_config.json`` with the file's chat template) that vLLM, the trainers and ``rollart export``
read like any other checkpoint. Before anything is dequantised the file's header is read: an
architecture or a tensor quantisation this converter does not handle is a :class:`ConfigError` naming
the file and what it supports. After writing, the directory is loaded again and its logits on a fixed
prompt are compared with the GGUF loader's (``conversion.json`` records the result and the source's
content hash); a mismatch beyond the dtype's rounding is an error and leaves no directory behind.

The directory is written beside its final place and renamed into it, so a crash or a second process
converting the same file never leaves a half-written model where a run would load it.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rollart_core.config import file_sha256
from rollart_core.errors import ConfigError
from rollart_core.extras import require

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_QUANT_TYPES",
    "convert_gguf",
    "inspect_gguf",
    "logits_check",
]

GGUF_INSTALL = "pip install 'rollart-train[gguf]'"
# Dense decoder-only families that transformers' GGUF loader maps to an HF class and that vLLM and
# rollart's trainers serve and train.
SUPPORTED_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# Tensor types gguf-py dequantises exactly (the legacy block formats, the k-quants, and the floats).
SUPPORTED_QUANT_TYPES = frozenset(
    {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}
)
CHECK_TEXT = "<|im_start|>user\nWhat is 17 + 25?<|im_end|>\n<|im_start|>assistant\nThe capital of France is"
# Largest |logit difference| between the converted model (loaded in its saved dtype, computed in
# float32) and the GGUF loader's float32 model, relative to the logits' spread. float32 keeps the
# dequantised weights exactly; bfloat16 rounds every weight to 8 mantissa bits.
TOLERANCE = {"float32": 1e-4, "bfloat16": 0.02}
_METADATA = "conversion.json"


def _field_str(reader: Any, key: str) -> str | None:
    f = reader.fields.get(key)
    if f is None or not f.data:
        return None
    return bytes(f.parts[f.data[0]]).decode("utf-8", "replace")


def inspect_gguf(path: str | Path) -> dict[str, Any]:
    """The file's architecture, tensor types and chat template, from its header only (no tensor is
    read). ConfigError naming the file when it is not a GGUF file, or holds an architecture or a
    quantisation type that :func:`convert_gguf` does not handle."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"model GGUF {p}: no such file")
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ConfigError(f"model GGUF {p}: not a GGUF file (it starts with {magic!r}, expected b'GGUF')")
    gguf = require("gguf", GGUF_INSTALL)
    try:
        reader = gguf.GGUFReader(str(p))
    except (ValueError, OSError, IndexError) as exc:
        raise ConfigError(f"model GGUF {p}: cannot read its header: {exc}") from None
    arch = _field_str(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(
            f"model GGUF {p}: architecture {arch!r} is not supported; expected one of "
            f"{sorted(SUPPORTED_ARCHITECTURES)}"
        )
    types: dict[str, int] = {}
    for t in reader.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    unsupported = sorted(set(types) - SUPPORTED_QUANT_TYPES)
    if unsupported:
        raise ConfigError(
            f"model GGUF {p}: tensor types {unsupported} are not supported; expected only "
            f"{sorted(SUPPORTED_QUANT_TYPES)}"
        )
    template = _field_str(reader, "tokenizer.chat_template")
    return {
        "architecture": arch,
        "hf_class": SUPPORTED_ARCHITECTURES[arch],
        "tensor_types": types,
        "chat_template": template,
        "name": _field_str(reader, "general.name"),
    }


def _load_gguf_model(path: Path) -> tuple[Any, Any]:
    require("gguf", GGUF_INSTALL)
    require("accelerate", GGUF_INSTALL)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval(), tok


def _write_hf(model: Any, tok: Any, out: Path, dtype: str, info: dict[str, Any]) -> None:
    import torch
    from safetensors.torch import save_file

    cfg = model.config
    if hasattr(cfg, "quantization_config"):  # a GGUF-quantised mark: the weights written are dense
        del cfg.quantization_config
    cfg.architectures = [info["hf_class"]]
    cfg.dtype = dtype
    cfg.save_pretrained(str(out))
    target = getattr(torch, dtype)
    state = model.state_dict()
    if getattr(cfg, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    tensors = {k: v.detach().to(target).contiguous() for k, v in state.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    tok.save_pretrained(str(out))
    if info.get("chat_template") and not (out / "chat_template.jinja").is_file():
        tcfg_path = out / "tokenizer_config.json"
        tcfg = json.loads(tcfg_path.read_text()) if tcfg_path.is_file() else {}
        if not tcfg.get("chat_template"):
            (out / "chat_template.jinja").write_text(info["chat_template"])
    if hasattr(model, "generation_config") and model.generation_config is not None:
        model.generation_config.save_pretrained(str(out))


def logits_check(reference: Any, model_dir: Path, tok: Any, dtype: str) -> dict[str, float]:
    """Compare the converted directory's logits on :data:`CHECK_TEXT` with ``reference`` (the GGUF
    loader's float32 model). Returns the figures; ConfigError when they differ beyond the dtype's
    rounding or the greedy next tokens disagree."""
    import torch
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([tok(CHECK_TEXT, add_special_tokens=False)["input_ids"]])
    converted = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).float()
    with torch.no_grad():
        ref = reference(ids).logits[0].float()
        got = converted.eval()(ids).logits[0].float()
    spread = (ref.max() - ref.min()).item()
    max_diff = (ref - got).abs().max().item()
    top1 = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    figures = {"max_abs_diff": max_diff, "relative": max_diff / max(spread, 1e-9), "top1_agreement": top1}
    if figures["relative"] > TOLERANCE[dtype] or top1 < (1.0 if dtype == "float32" else 0.9):
        raise ConfigError(
            f"converted model {model_dir}: its logits differ from the GGUF loader's beyond {dtype} "
            f"rounding (max |diff| {max_diff:.4g}, {figures['relative']:.3g} of the logits' spread, "
            f"allowed {TOLERANCE[dtype]}; greedy agreement {top1:.2f})"
        )
    return figures


def converted_ok(out: Path, digest: str) -> bool:
    """True when ``out`` holds a finished, checked conversion of the file with this content hash."""
    meta = out / _METADATA
    if not meta.is_file():
        return False
    try:
        return json.loads(meta.read_text()).get("source_sha256") == digest
    except (OSError, ValueError):
        return False


def convert_gguf(
    gguf_path: str | Path, out: str | Path, *, dtype: str = "bfloat16", digest: str | None = None
) -> Path:
    """Convert ``gguf_path`` to an HF directory at ``out`` unless ``out`` already holds a checked
    conversion of the same content (``digest``: its sha256, computed when not given). Returns ``out``."""
    src, dest = Path(gguf_path), Path(out)
    if dtype not in TOLERANCE:
        raise ConfigError(f"model.dtype {dtype!r}: a GGUF converts to one of {sorted(TOLERANCE)}")
    digest = digest or file_sha256(src)
    if converted_ok(dest, digest):
        return dest
    info = inspect_gguf(src)
    t0 = time.perf_counter()
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        model, tok = _load_gguf_model(src)
        _write_hf(model, tok, tmp, dtype, info)
        figures = logits_check(model, tmp, tok, dtype)
        meta = {
            "source": str(src),
            "source_sha256": digest,
            "architecture": info["architecture"],
            "tensor_types": info["tensor_types"],
            "dtype": dtype,
            "logits_check": {"text": CHECK_TEXT, **figures},
            "convert_s": round(time.perf_counter() - t0, 1),
        }
        (tmp / _METADATA).write_text(json.dumps(meta, indent=2) + "\n")
        for f in [tmp, *tmp.iterdir()]:  # mkdtemp's and safetensors' private modes: others read it
            f.chmod(0o755 if f.is_dir() else 0o644)
        if dest.exists():  # an older conversion (another source hash), or a leftover
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m rollart_train.gguf", description=__doc__.split("\n")[0])
    ap.add_argument("gguf")
    ap.add_argument("out")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(TOLERANCE))
    args = ap.parse_args(argv)
    try:
        out = convert_gguf(args.gguf, args.out, dtype=args.dtype)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(json.loads((out / _METADATA).read_text()), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
