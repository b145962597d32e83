"""Delta weight sync on real training updates of the tiny model, through every store, through the
benchmark's own code (integration/bench/delta_sync.py), and through a vLLM engine's pull path."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench" / "delta_sync.py"
TIMEOUT = 120


def _bench() -> Any:
    spec = importlib.util.spec_from_file_location("delta_sync_bench", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def trained(tiny_model: Path) -> list[dict[str, torch.Tensor]]:
    """The tiny model's weights before and after two torch-trainer steps at lr 1e-5."""
    return _bench().train_versions(tiny_model, 1e-5, steps=2)


@pytest.mark.parametrize("kind", ["filesystem", pytest.param("ray", marks=pytest.mark.ray), "mooncake"])
def test_trained_updates_round_trip_as_deltas(kind: str, trained: list[dict[str, torch.Tensor]]) -> None:
    bench = _bench()
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    assert any(not torch.equal(trained[0][k], trained[1][k]) for k in trained[0])
    with bench.store_factory(kind) as make:
        for dtype, at_least in (("bfloat16", 5.0), ("float32", 1.5)):
            full = bench.run_store(make, False, dtype, trained)
            delta = bench.run_store(make, True, dtype, trained)
            assert all(r["exact"] for r in full + delta), (kind, dtype)
            for f, d in zip(full, delta, strict=True):
                assert f["bytes"] > at_least * d["bytes"], (kind, dtype, f, d)


@pytest.mark.vllm
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_engine_holding_v_pulls_next_as_delta(
    tiny_model: Path, trained: list[dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    """A vLLM engine pulls through its own copy of the store: version 2 comes as a delta from the
    version 1 it holds, and the engine then serves exactly the trainer's weights."""
    import pickle

    from rollart_proxy.engines.vllm_engine import VllmEngine, VllmEngineConfig
    from rollart_weightsync import FilesystemWeightStore, FilesystemWeightStoreConfig

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    pusher = FilesystemWeightStore(FilesystemWeightStoreConfig(root=tmp_path / "w", delta=True))
    puller = pickle.loads(pickle.dumps(pusher))  # the engine's own store object, as in another process
    engine = VllmEngine(
        VllmEngineConfig(max_model_len=256, dtype="float32"), model_path=str(tiny_model), weight_store=puller
    )
    try:
        await engine.start()
        for v in (1, 2):
            pusher.push(v, trained[v]).result(TIMEOUT)
            await engine.update_weights(v)
        assert puller.stats["full_pulls"] == 1 and puller.stats["delta_pulls"] == 1
        assert puller.stats["delta_bytes"] < puller.stats["full_bytes"]
        name = "model.embed_tokens.weight"
        shape, _dtype, raw = await engine.read_parameter(name)
        want = trained[2][name].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        assert list(shape) == list(trained[2][name].shape) and raw == want
    finally:
        await engine.shutdown()
        pusher.close()
