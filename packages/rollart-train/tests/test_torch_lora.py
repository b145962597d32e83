"""LoRA in TorchTrainer on the tiny Qwen2 model: only adapters train, step 0 is the base model, the
pushed tensors are a PEFT adapter, bad targets fail early, checkpoints carry the adapters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rollart_core.errors import ConfigError
from rollart_core.types import Trajectory, Turn
from rollart_train import TorchTrainer, TorchTrainerConfig
from rollart_train.lora import PEFT_PREFIX
from rollart_train.tiny import create_tiny_model
from rollart_train.torch_config import LoraConfig

LORA = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"])
IDS = [5, 17, 99, 3, 250, 7, 41, 12, 300, 9]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_tiny_model(tmp_path_factory.mktemp("tiny-lora") / "m", dtype="float32")


def make_batch(trainer: TorchTrainer) -> list[Trajectory]:
    """Four trajectories of one group with different rewards; behaviour logprobs are the trainer's own."""
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


def lora_trainer(model: Path, **kw: object) -> TorchTrainer:
    return TorchTrainer(TorchTrainerConfig(lr=1e-2, lora=LORA, **kw), model_path=model)  # type: ignore[arg-type]


def test_step_zero_equals_base_model(tiny_model: Path) -> None:
    base = TorchTrainer(TorchTrainerConfig(), model_path=tiny_model)
    lora = lora_trainer(tiny_model)
    assert lora.logprobs(IDS) == base.logprobs(IDS)  # B = 0: the adapter adds exact zeros


def test_train_step_changes_only_adapters(tiny_model: Path) -> None:
    trainer = lora_trainer(tiny_model)
    model = trainer.model
    base_before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    lora_before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    assert len(lora_before) == 2 * 2 * 3  # 2 layers x (A, B) x 3 targets
    assert all(not p.requires_grad for n, p in model.named_parameters() if n in base_before)
    lp0 = trainer.logprobs(IDS)

    metrics = trainer.train_step(make_batch(trainer))

    assert metrics["version"] == 1.0 and metrics["optimizer_steps"] == 1.0
    for n, p in model.named_parameters():
        if n in base_before:
            assert torch.equal(p, base_before[n]), f"base parameter {n} moved"
    # B starts at 0, so A's first gradient is 0 (B·dA): the first step moves every B, A only later
    moved = {
        n for n, p in model.named_parameters() if n in lora_before and not torch.equal(p, lora_before[n])
    }
    assert moved == {n for n in lora_before if ".lora_B." in n}
    # AdamW holds state for the adapters alone
    opt = trainer._local.optimizer  # type: ignore[union-attr]
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {
        id(p) for n, p in model.named_parameters() if n in lora_before
    }
    assert len(opt.state) == len(lora_before)
    assert trainer.logprobs(IDS) != lp0


def test_named_weights_are_a_peft_adapter(tiny_model: Path) -> None:
    trainer = lora_trainer(tiny_model)
    trainer.train_step(make_batch(trainer))
    pushed = dict(trainer.named_weights())
    cfg = trainer.model.config
    expected = {
        f"{PEFT_PREFIX}model.layers.{i}.{mod}.lora_{ab}.weight"
        for i in range(cfg.num_hidden_layers)
        for mod in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")
        for ab in "AB"
    }
    assert set(pushed) == expected
    params = dict(trainer.model.named_parameters())
    for name, t in pushed.items():
        own = params[name.removeprefix(PEFT_PREFIX)]
        if ".lora_A." in name:
            assert t.shape == (LORA.rank, own.shape[1]) and torch.equal(t, own)
        else:  # alpha / r folded in: the served adapter has lora_alpha = r
            assert t.shape[1] == LORA.rank
            torch.testing.assert_close(t, own * (LORA.alpha / LORA.rank), rtol=0, atol=0)
            assert t.abs().max() > 0


def test_merged_serving_pushes_full_weights_that_compute_the_adapted_model(tiny_model: Path) -> None:
    merged_cfg = LORA.model_copy(update={"serve": "merged"})
    trainer = TorchTrainer(TorchTrainerConfig(lr=1e-2, lora=merged_cfg), model_path=tiny_model)
    trainer.train_step(make_batch(trainer))
    pushed = dict(trainer.named_weights())
    plain = TorchTrainer(TorchTrainerConfig(), model_path=tiny_model)
    base = plain.model.state_dict()
    assert set(pushed) == set(base)  # HF naming, no adapter tensors: any engine loads it as weights
    changed = {n for n, t in pushed.items() if not torch.equal(t, base[n])}
    assert changed == {
        f"model.layers.{i}.{mod}.weight"
        for i in range(trainer.model.config.num_hidden_layers)
        for mod in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")
    }  # lora_B moved off zero in every adapter; nothing else moved
    plain.model.load_state_dict(pushed)
    torch.testing.assert_close(
        torch.tensor(plain.logprobs(IDS)), torch.tensor(trainer.logprobs(IDS)), rtol=0, atol=1e-5
    )
    assert plain.logprobs(IDS) != lora_trainer(tiny_model).logprobs(IDS)  # the step changed the model


def test_unknown_target_modules_fail_before_training(tiny_model: Path) -> None:
    bad = LoraConfig(target_modules=["q_proj", "query_key_value"])
    with pytest.raises(ConfigError, match="query_key_value") as err:
        TorchTrainer(TorchTrainerConfig(lora=bad), model_path=tiny_model)
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        assert name in str(err.value)
    with pytest.raises(ValueError, match="extra"):
        LoraConfig.model_validate({"rank": 4, "target": ["q_proj"]})


def test_save_and_resume_round_trip_adapters(tiny_model: Path, tmp_path: Path) -> None:
    trainer = lora_trainer(tiny_model)
    batch = make_batch(trainer)
    trainer.train_step(batch)
    trainer.save(tmp_path / "ckpt")

    ckpt = tmp_path / "ckpt"
    adapter_cfg = json.loads((ckpt / "adapter" / "adapter_config.json").read_text())
    assert adapter_cfg["r"] == LORA.rank and adapter_cfg["lora_alpha"] == LORA.alpha
    assert adapter_cfg["target_modules"] == sorted(LORA.target_modules)
    from safetensors.torch import load_file

    root = {}
    for f in ckpt.glob("*.safetensors"):
        root.update(load_file(str(f)))
    assert root and not any("lora_" in n for n in root)  # the root is the plain base model

    resumed = TorchTrainer.resume(ckpt, TorchTrainerConfig(lr=1e-2, lora=LORA))
    assert resumed.version == 1
    before = dict(trainer.named_weights())
    for n, t in resumed.named_weights():
        assert torch.equal(t, before[n]), n
    # the optimiser state came back too: the next step is the same on both
    trainer.train_step(batch)
    resumed.train_step(batch)
    after = dict(trainer.named_weights())
    for n, t in resumed.named_weights():
        assert torch.equal(t, after[n]), n

    with pytest.raises(ConfigError, match="LoRA"):
        TorchTrainer.resume(ckpt, TorchTrainerConfig())


def test_spawned_rank_bf16_mixed_precision(tiny_model: Path) -> None:
    """LoRA on the spawned rank with bf16 compute over float32 master weights."""
    trainer = lora_trainer(tiny_model, spawn=True, dtype="bfloat16", mixed_precision=True, num_threads=1)
    try:
        batch = make_batch(trainer)
        before = dict(trainer.named_weights())
        assert all(t.dtype == torch.float32 for t in before.values())
        assert all(not t.any() for n, t in before.items() if ".lora_B." in n)
        metrics = trainer.train_step(batch)
        assert metrics["version"] == 1.0
        after = dict(trainer.named_weights())
        assert set(after) == set(before)
        assert all(t.abs().max() > 0 for n, t in after.items() if ".lora_B." in n)
    finally:
        trainer.close()


def test_two_fsdp_ranks_match_one_rank(tiny_model: Path) -> None:
    """FSDP2 shards the frozen base and the adapters alike: one step on two gloo ranks gives the
    adapters one in-process rank gives."""
    one = lora_trainer(tiny_model, num_threads=1)
    two = lora_trainer(tiny_model, num_threads=1, world_size=2)
    try:
        batch = make_batch(one)
        m1, m2 = one.train_step(batch), two.train_step(batch)
        assert m2["loss"] == pytest.approx(m1["loss"], abs=1e-6)
        w1 = dict(one.named_weights())
        w2 = dict(two.named_weights())
        assert set(w1) == set(w2)
        for n, t in w2.items():
            torch.testing.assert_close(t, w1[n], rtol=0, atol=1e-6)
    finally:
        two.close()
