"""HF ↔ Megatron-core weight conversion on hand-built tensors and on the tiny model's real weights; and,
where megatron-core is installed (extra ``[megatron]``), a real GPTModel on CPU fed with converted
weights must reproduce the Hugging Face logits."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from rollart_train.megatron_convert import (
    GptShape,
    hf_to_megatron,
    megatron_to_hf,
    merge_qkv,
    merge_tp_shards,
    split_qkv,
    split_tp_shard,
)
from rollart_train.tiny import create_tiny_model

SHAPE = GptShape(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=2, vocab_size=10)


def labelled(prefix: int, rows: int, cols: int = 3) -> torch.Tensor:
    return (prefix + torch.arange(rows, dtype=torch.float64)).unsqueeze(1).expand(rows, cols).clone()


def test_qkv_layout_is_grouped_by_query_group() -> None:
    q, k, v = labelled(100, 8), labelled(200, 4), labelled(300, 4)  # 4 q heads, 2 kv heads, head_dim 2
    fused = merge_qkv(q, k, v, SHAPE)
    # group 0: q heads 0,1 (rows 0-3), k head 0, v head 0; then group 1
    assert fused[:, 0].tolist() == [
        100,
        101,
        102,
        103,
        200,
        201,
        300,
        301,
        104,
        105,
        106,
        107,
        202,
        203,
        302,
        303,
    ]
    for a, b in zip(split_qkv(fused, SHAPE), (q, k, v), strict=True):
        assert torch.equal(a, b)
    bias = merge_qkv(q[:, 0], k[:, 0], v[:, 0], SHAPE)  # 1-D biases use the same layout
    assert torch.equal(bias, fused[:, 0])


def test_tp_shards_round_trip_and_fc1_interleaving() -> None:
    gate, up = labelled(0, 8), labelled(100, 8)
    fc1 = torch.cat([gate, up])
    shards = [split_tp_shard("decoder.layers.0.mlp.linear_fc1.weight", fc1, r, 2) for r in range(2)]
    assert shards[0][:, 0].tolist() == [0, 1, 2, 3, 100, 101, 102, 103]  # [gate_0; up_0]
    assert torch.equal(merge_tp_shards("decoder.layers.0.mlp.linear_fc1.weight", shards), fc1)
    proj = torch.randn(6, 8)
    name = "decoder.layers.0.self_attention.linear_proj.weight"
    parts = [split_tp_shard(name, proj, r, 2) for r in range(2)]
    assert parts[0].shape == (6, 4)  # row-parallel: split along the input axis
    assert torch.equal(merge_tp_shards(name, parts), proj)
    norm = torch.randn(8)
    assert torch.equal(split_tp_shard("decoder.final_layernorm.weight", norm, 1, 2), norm)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = create_tiny_model(tmp_path_factory.mktemp("tiny-mcore") / "m")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return path, model


@pytest.mark.parametrize("te_layernorm", [False, True])
def test_tiny_model_round_trip(tiny, te_layernorm: bool) -> None:
    _, model = tiny
    hf = model.state_dict()
    shape = GptShape.from_hf_config(model.config)
    assert (shape.num_heads, shape.num_kv_heads, shape.head_dim) == (4, 2, 64)
    mc = hf_to_megatron(hf, shape, te_layernorm=te_layernorm, padded_vocab_size=shape.vocab_size + 64)
    assert mc["embedding.word_embeddings.weight"].shape[0] == shape.vocab_size + 64
    assert mc["decoder.layers.1.self_attention.linear_qkv.weight"].shape == ((4 + 2 * 2) * 64, 256)
    assert "decoder.layers.0.self_attention.linear_qkv.bias" in mc  # Qwen2 has q/k/v biases
    mc["decoder.layers.0.self_attention._extra_state"] = torch.empty(0)  # TE-style extras are skipped
    back = dict(megatron_to_hf(mc.items(), shape))
    assert set(back) == set(hf)
    for n, t in hf.items():
        assert torch.equal(back[n], t), n


def test_pipeline_stage_layer_offset_and_unknown_names(tiny) -> None:
    _, model = tiny
    shape = GptShape.from_hf_config(model.config)
    mc = hf_to_megatron(model.state_dict(), shape)
    stage = {k: v for k, v in mc.items() if k.startswith("decoder.layers.0.")}
    names = [n for n, _ in megatron_to_hf(stage.items(), shape, layer_offset=1)]
    assert names and all(n.startswith("model.layers.1.") for n in names)
    with pytest.raises(KeyError, match="unknown Megatron parameter"):
        list(megatron_to_hf([("decoder.layers.0.self_attention.weird", torch.zeros(1))], shape))


HAS_MCORE = (
    importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None
)


@pytest.mark.skipif(
    not HAS_MCORE, reason="megatron-core is not installed (extra [megatron]; not in the cpu stack)"
)
@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning", "ignore::FutureWarning")
def test_megatron_gpt_model_on_cpu_matches_hf_logits(tiny, tmp_path) -> None:
    from rollart_train.megatron_trainer import build_gpt_model_cpu_for_tests

    path, model = tiny
    ids = torch.tensor([[5, 17, 99, 3, 250, 7, 42, 8]])
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    import torch.distributed as dist
    from megatron.core import parallel_state

    try:
        gpt = build_gpt_model_cpu_for_tests(Path(path), model.state_dict())
        with torch.no_grad():
            got = gpt(input_ids=ids, position_ids=torch.arange(8)[None], attention_mask=None)
    finally:
        parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
    torch.testing.assert_close(got[..., : expected.shape[-1]].float(), expected, rtol=1e-4, atol=1e-4)
