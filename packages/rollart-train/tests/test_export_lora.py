"""``rollart export --hf`` of a checkpoint of LoRA training: the adapters merged into the base weights
give a plain Hugging Face model (no PEFT) that computes what the trained LoRA model computes;
``--adapter-only`` gives the PEFT adapter directory; a missing base model is a ConfigError naming it."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from rollart_core.cli import main
from rollart_core.errors import ConfigError
from rollart_core.types import Trajectory, Turn
from rollart_train import TorchTrainer, TorchTrainerConfig
from rollart_train.export import export_hf
from rollart_train.tiny import create_tiny_model
from rollart_train.torch_config import LoraConfig

LORA = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"])
PROMPTS = [[5, 17, 99, 3, 250, 7, 41, 12, 300, 9], [44, 45, 46, 200, 201, 7, 8]]


def _batch(trainer: TorchTrainer) -> list[Trajectory]:
    g = torch.Generator().manual_seed(5)
    out = []
    for i in range(4):
        ctx = torch.randint(3, 400, (6 + i,), generator=g).tolist()
        gen = torch.randint(3, 400, (3 + i,), generator=g).tolist()
        lps = trainer.logprobs(ctx + gen)[-len(gen) :]
        turn = Turn(context_ids=ctx, output_ids=gen, output_logprobs=lps, output_versions=[0] * len(gen))
        out.append(
            Trajectory(
                traj_id=f"t{i}",
                task="t",
                env_id="e",
                group_id="g",
                seed=i,
                start_version=0,
                turns=[turn],
                reward=float(i),
            )
        )
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[torch.Tensor]]:
    """(base model, checkpoint after one LoRA step, the LoRA model's logits on PROMPTS)."""
    root = tmp_path_factory.mktemp("export-lora")
    base = create_tiny_model(root / "base", dtype="float32")
    trainer = TorchTrainer(TorchTrainerConfig(lr=1e-2, lora=LORA), model_path=base)
    trainer.train_step(_batch(trainer))
    trainer.save(root / "checkpoint-1")
    model = trainer.model.eval()
    with torch.no_grad():
        logits = [model(input_ids=torch.tensor([ids])).logits[0] for ids in PROMPTS]
    return base, root / "checkpoint-1", logits


def _logits(path: Path) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(input_ids=torch.tensor([ids])).logits[0] for ids in PROMPTS]


def test_merged_export_computes_the_lora_model(
    trained: tuple[Path, Path, list[torch.Tensor]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base, ckpt, lora_logits = trained
    out = tmp_path / "hf"
    assert main(["export", str(ckpt), "--hf", str(out)]) == 0
    assert "a Hugging Face model directory" in capsys.readouterr().out
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= names
    assert not any(n.startswith(("adapter", "rollart")) or n.endswith(".pt") for n in names), names

    from safetensors.torch import load_file

    merged, plain = load_file(str(out / "model.safetensors")), load_file(str(base / "model.safetensors"))
    assert set(merged) == set(plain)  # no adapter tensors: a plain model, loadable without PEFT
    moved = {n for n in merged if not torch.equal(merged[n], plain[n])}
    assert moved == {
        f"model.layers.{i}.{m}.weight"
        for i in range(2)
        for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")
    }

    got, before = _logits(out), _logits(base)
    for g, want, b in zip(got, lora_logits, before, strict=True):
        # the merge W + s·B@A reorders float32 sums: equal to the LoRA forward up to rounding
        torch.testing.assert_close(g, want, rtol=0, atol=1e-4)
        assert (g - b).abs().max() > 1e-3  # and the export is not the base model


def test_base_from_adapter_config_when_the_root_has_none(
    trained: tuple[Path, Path, list[torch.Tensor]], tmp_path: Path
) -> None:
    base, ckpt, lora_logits = trained
    slim = tmp_path / "slim"
    shutil.copytree(ckpt, slim)
    for f in slim.glob("*.safetensors"):
        f.unlink()
    cfg = json.loads((slim / "adapter" / "adapter_config.json").read_text())
    assert Path(cfg["base_model_name_or_path"]) == base  # the trainer names its base model
    out = export_hf(slim, tmp_path / "hf")
    for g, want in zip(_logits(out), lora_logits, strict=True):
        torch.testing.assert_close(g, want, rtol=0, atol=1e-4)

    missing = tmp_path / "moved-away"
    cfg["base_model_name_or_path"] = str(missing)
    (slim / "adapter" / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=re.escape(str(missing))):
        export_hf(slim, tmp_path / "hf2")
    assert not (tmp_path / "hf2").exists()


def test_adapter_only_is_a_peft_adapter(
    trained: tuple[Path, Path, list[torch.Tensor]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base, ckpt, _ = trained
    out = tmp_path / "adapter"
    assert main(["export", str(ckpt), "--hf", str(out), "--adapter-only"]) == 0
    assert "PEFT" in capsys.readouterr().out
    assert {p.name for p in out.iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == LORA.rank and cfg["lora_alpha"] == LORA.alpha

    from safetensors.torch import load_file

    tensors = load_file(str(out / "adapter_model.safetensors"))
    assert len(tensors) == 2 * 2 * 3 and all(n.startswith("base_model.model.model.layers.") for n in tensors)

    with pytest.raises(ConfigError, match="LoRA"):  # a full fine-tuned model has no adapter to export
        export_hf(base, tmp_path / "nope", adapter_only=True)


def test_incomplete_lora_checkpoint(trained: tuple[Path, Path, list[torch.Tensor]], tmp_path: Path) -> None:
    _, ckpt, _ = trained
    broken = tmp_path / "broken"
    shutil.copytree(ckpt, broken)
    (broken / "adapter" / "adapter_model.safetensors").unlink()
    with pytest.raises(ConfigError, match=r"adapter_model\.safetensors"):
        export_hf(broken, tmp_path / "hf")


@pytest.mark.vllm
def test_vllm_serves_the_merged_export(
    trained: tuple[Path, Path, list[torch.Tensor]], tmp_path: Path
) -> None:
    """vLLM (no LoRA support asked for) loads the export and computes the LoRA model's greedy tokens.

    The engine core runs in its own process and the environment vLLM writes is put back: an
    in-process vLLM CPU engine pins this process's torch threads for good (``torch.set_num_threads``
    becomes a no-op), which changed a later test's in-process training step."""
    _, ckpt, lora_logits = trained
    out = export_hf(ckpt, tmp_path / "hf")
    expected = [int(lg[-1].argmax()) for lg in lora_logits]
    saved_env = dict(os.environ)
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="1", VLLM_CPU_KVCACHE_SPACE="1")
    try:
        from vllm import LLM, SamplingParams

        llm = LLM(model=str(out), dtype="float32", max_model_len=128, enforce_eager=True, seed=0)
        try:
            outs = llm.generate(
                [{"prompt_token_ids": ids} for ids in PROMPTS],
                SamplingParams(temperature=0.0, max_tokens=1, logprobs=1),
                use_tqdm=False,
            )
        finally:
            llm.llm_engine.engine_core.shutdown()
            del llm
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
    got = [o.outputs[0].token_ids[0] for o in outs]
    assert got == expected
    for o, lg in zip(outs, lora_logits, strict=True):
        tok = o.outputs[0].token_ids[0]
        want = float(torch.log_softmax(lg[-1], -1)[tok])
        assert o.outputs[0].logprobs[0][tok].logprob == pytest.approx(want, abs=1e-3)
