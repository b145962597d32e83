"""LoRA versions in VllmEngine: a real vLLM CPU engine serves the adapters a real TorchTrainer pushes
through a filesystem weight store, on the tiny Qwen2 model.

Version 0 is the base model; after an update to an adapter version the engine's logprobs follow the
trainer's forward with that adapter, a request that was running keeps its adapter (and version) to the
end, and older adapters are dropped once no request uses them.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch

from rollart_core.errors import WeightSyncError
from rollart_core.types import GenerateRequest, SamplingParams

PROMPT = [1, 20, 31, 45, 52, 67, 80, 99, 120, 140, 170, 200]
ATOL = 2e-3
"""Logprob tolerance engine vs trainer (float32 both; vLLM's CPU kernels sum in another order)."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rollart_train.tiny import create_tiny_model

    return create_tiny_model(tmp_path_factory.mktemp("vllm-lora") / "tiny", dtype="float32")


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from rollart_weightsync.filesystem import FilesystemWeightStore, FilesystemWeightStoreConfig

    return FilesystemWeightStore(FilesystemWeightStoreConfig(root=tmp_path_factory.mktemp("lora-store")))


@pytest.fixture(scope="module")
def trainer(model_dir: Path) -> Any:
    from rollart_train import TorchTrainer, TorchTrainerConfig
    from rollart_train.torch_config import LoraConfig

    lora = LoraConfig(rank=8, alpha=16.0, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"])
    return TorchTrainer(TorchTrainerConfig(lora=lora), model_path=model_dir)


def engine_config(**lora: Any) -> Any:
    from rollart_proxy.engines.vllm_engine import VllmEngineConfig
    from rollart_proxy.engines.vllm_lora import VllmLoraConfig

    return VllmEngineConfig(
        max_model_len=256, dtype="float32", max_num_seqs=8, lora=VllmLoraConfig(max_lora_rank=8, **lora)
    )


@pytest.fixture(scope="module")
async def engine(model_dir: Path, store: Any, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Any]:
    from rollart_proxy.engines.vllm_engine import VllmEngine

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    adapters = tmp_path_factory.mktemp("adapters")
    e = VllmEngine(
        engine_config(max_loras=2, adapter_dir=str(adapters)),
        model_path=str(model_dir),
        weight_store=store,
        name="lora",
    )
    try:
        await e.start()
        yield e
    finally:
        await e.shutdown()


def set_random_b(trainer: Any, seed: int) -> None:
    """A clearly non-zero adapter (a train step from B = 0 moves it only a little)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if ".lora_B." in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


async def prompt_logprobs(engine: Any, rid: str, prompt: list[int] = PROMPT) -> torch.Tensor:
    out = await engine.generate(
        GenerateRequest(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0), prompt_logprobs=True)
    )
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    return torch.tensor(out.prompt_logprobs[1:], dtype=torch.float64)


def trainer_logprobs(trainer: Any, ids: list[int]) -> torch.Tensor:
    return torch.tensor(trainer.logprobs(ids), dtype=torch.float64)


@pytest.mark.vllm
async def test_adapter_versions_are_served_and_swapped(engine: Any, store: Any, trainer: Any) -> None:
    # version 0: the base model, which the trainer's zero-B adapter equals
    assert await engine.weight_version() == 0
    base = await prompt_logprobs(engine, "base")
    torch.testing.assert_close(base, trainer_logprobs(trainer, PROMPT), atol=ATOL, rtol=0)

    set_random_b(trainer, seed=1)
    store.push(1, dict(trainer.named_weights())).result(60)
    await engine.prefetch_weights(1)  # written and loaded into vLLM while generation goes on

    # a long request in flight across the update keeps the base model to its end
    running = asyncio.create_task(
        engine.generate(GenerateRequest("running", PROMPT, SamplingParams(max_tokens=96, temperature=0.0)))
    )
    while not (await engine.progress()).get("running"):
        await asyncio.sleep(0.01)
    await engine.pause()
    await engine.update_weights(1)
    await engine.resume()
    assert await engine.weight_version() == 1

    v1 = await prompt_logprobs(engine, "v1")
    torch.testing.assert_close(v1, trainer_logprobs(trainer, PROMPT), atol=ATOL, rtol=0)
    assert (v1 - base).abs().max() > 50 * ATOL, "adapter pushed but logprobs did not change"

    old = await asyncio.wait_for(running, 60)
    assert old.finish_reason in ("length", "stop") and old.token_ids
    assert set(old.versions) == {0}
    base_trainer = torch.tensor(
        _base_logprobs(trainer, PROMPT + old.token_ids)[-len(old.token_ids) :], dtype=torch.float64
    )
    torch.testing.assert_close(
        torch.tensor(old.logprobs, dtype=torch.float64), base_trainer, atol=ATOL, rtol=0
    )

    # a new request after the update: greedy under the adapter, stamped with version 1
    new = await engine.generate(GenerateRequest("new", PROMPT, SamplingParams(max_tokens=8, temperature=0.0)))
    assert set(new.versions) == {1}
    ids = PROMPT + new.token_ids
    torch.testing.assert_close(
        torch.tensor(new.logprobs, dtype=torch.float64),
        trainer_logprobs(trainer, ids)[-len(new.token_ids) :],
        atol=ATOL,
        rtol=0,
    )


def _base_logprobs(trainer: Any, ids: list[int]) -> list[float]:
    """The trainer's logprobs with its adapters switched off (B = 0), then switched back on."""
    saved = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if ".lora_B." in n}
    try:
        with torch.no_grad():
            for n, p in trainer.model.named_parameters():
                if n in saved:
                    p.zero_()
        return list(trainer.logprobs(ids))
    finally:
        with torch.no_grad():
            for n, p in trainer.model.named_parameters():
                if n in saved:
                    p.copy_(saved[n])


@pytest.mark.vllm
async def test_old_adapters_are_dropped_and_full_weights_refused(
    engine: Any, store: Any, trainer: Any
) -> None:
    assert await engine.weight_version() == 1  # after the test above
    root = engine._adapters.root
    for v in (2, 3):
        set_random_b(trainer, seed=v)
        store.push(v, dict(trainer.named_weights())).result(60)
        await engine.update_weights(v)
    assert await engine.weight_version() == 3
    # only the served adapter is left: no request uses the older ones
    assert engine._adapters.versions() == [3]
    assert sorted(p.name for p in root.iterdir()) == ["v3"]
    torch.testing.assert_close(
        await prompt_logprobs(engine, "v3"), trainer_logprobs(trainer, PROMPT), atol=ATOL, rtol=0
    )

    from transformers import AutoModelForCausalLM

    full = AutoModelForCausalLM.from_pretrained(trainer.model_path, dtype=torch.float32).state_dict()
    store.push(4, full).result(60)
    with pytest.raises(WeightSyncError, match="full weights"):
        await engine.update_weights(4)
    assert await engine.weight_version() == 3


async def test_full_weight_engine_refuses_an_adapter(store: Any, trainer: Any, model_dir: Path) -> None:
    """No vLLM needed: the check comes before anything reaches the engine."""
    from rollart_proxy.engines.vllm_engine import VllmEngine, VllmEngineConfig

    store.push(10, dict(trainer.named_weights())).result(60)
    e = VllmEngine(VllmEngineConfig(), model_path=str(model_dir), weight_store=store)
    with pytest.raises(WeightSyncError, match="lora option"):
        await e._prepare(10)


def test_adapter_layout_reads_rank_and_targets() -> None:
    from rollart_proxy.engines.vllm_lora import adapter_layout, is_adapter

    p = "base_model.model.model.layers.0."
    tensors = {
        p + "self_attn.q_proj.lora_A.weight": torch.zeros(4, 16),
        p + "self_attn.q_proj.lora_B.weight": torch.zeros(16, 4),
        p + "mlp.down_proj.lora_A.weight": torch.zeros(4, 32),
        p + "mlp.down_proj.lora_B.weight": torch.zeros(16, 4),
    }
    assert is_adapter(tensors) and adapter_layout(tensors) == (4, ["down_proj", "q_proj"])
    assert not is_adapter({"model.embed_tokens.weight": torch.zeros(1)})
    tensors.pop(p + "mlp.down_proj.lora_B.weight")
    with pytest.raises(WeightSyncError, match="unpaired"):
        adapter_layout(tensors)


def test_pipeline_checks_trainer_and_engine_lora_agree() -> None:
    from rollart_core.config import RunConfig
    from rollart_core.control.pipeline import check_lora
    from rollart_core.errors import ConfigError
    from rollart_core.registry import resolve, validate_options

    def check(trainer_lora: dict[str, Any] | None, engine_lora: dict[str, Any] | None) -> None:
        raw: dict[str, Any] = {
            "name": "lora",
            "model": {"path": "unused"},
            "engines": [{"name": "gen", "options": {} if engine_lora is None else {"lora": engine_lora}}],
            "tasks": [
                {
                    "name": "t",
                    "env": {"impl": "frozenlake"},
                    "reward": {"impl": "success"},
                    "group_size": 2,
                    "groups_per_step": 1,
                }
            ],
            "trainer": {"impl": "torch", "options": {} if trainer_lora is None else {"lora": trainer_lora}},
        }
        cfg = RunConfig.model_validate(raw)
        engines = [validate_options(resolve("engine", g.impl), g.options, "e") for g in cfg.engines]
        check_lora(cfg, engines)

    check(None, None)
    check({"rank": 8}, {"max_lora_rank": 8})
    check({"rank": 8, "serve": "merged"}, None)  # merged adapters reach the engine as full weights
    with pytest.raises(ConfigError, match=r"engines.0.options.lora is set .* serve: merged .* LoRA merged"):
        check({"rank": 8, "serve": "merged"}, {"max_lora_rank": 8})
    with pytest.raises(ConfigError, match=r"trainer.options.lora is set .* engines.0.options.lora is not"):
        check({"rank": 8}, None)
    with pytest.raises(ConfigError, match=r"engines.0.options.lora is set .* trainer.options.lora is not"):
        check(None, {"max_lora_rank": 8})
    with pytest.raises(
        ConfigError,
        match=r"trainer.options.lora.rank \(16\) exceeds engines.0.options.lora.max_lora_rank \(8\)",
    ):
        check({"rank": 16}, {"max_lora_rank": 8})
