"""A real vLLM (CPU) engine receives weights through a real Mooncake store (TCP, 127.0.0.1).

The trainer side pushes modified Hugging Face weights; the engine pulls them in the background,
loads them in a short pause, and its next generation's prompt logprobs match a transformers
forward of the same weights (vLLM's CPU build repacks linear weights, so logprobs are compared,
not parameters). A receiver that fell behind loads the newest committed version directly.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from rollart_core.types import GenerateRequest, SamplingParams

pytestmark = [pytest.mark.vllm, pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]

PROMPT = [1, 20, 31, 45, 52, 67, 80, 99, 120, 140, 170, 200]
TIMEOUT = 120


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rollart_train.tiny import create_tiny_model

    return create_tiny_model(tmp_path_factory.mktemp("ws-vllm") / "tiny", dtype="float32")


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from rollart_weightsync import MooncakeServerConfig, MooncakeStoreServer, MooncakeWeightStore

    with MooncakeStoreServer(MooncakeServerConfig(segment_bytes=128 << 20)) as server:
        st = MooncakeWeightStore(server.store_config(bucket_bytes=1 << 20, keep_last=2))
        yield st
        st.close()


@pytest.fixture(scope="module")
async def engine(model_dir: Path, store: Any) -> AsyncIterator[Any]:
    from rollart_proxy.engines.vllm_engine import VllmEngine, VllmEngineConfig

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    e = VllmEngine(
        VllmEngineConfig(max_model_len=256, dtype="float32"),
        model_path=str(model_dir),
        weight_store=store,
        name="ws",
    )
    try:
        await e.start()
        yield e
    finally:
        await e.shutdown()


def hf_prompt_logprobs(model_dir: Path, state: dict[str, torch.Tensor] | None) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if state is not None:
        _missing, unexpected = model.load_state_dict(state, strict=False)
        assert not unexpected, unexpected
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0, :-1]
    return torch.log_softmax(logits.double(), -1).gather(1, torch.tensor(PROMPT[1:])[:, None])[:, 0]


async def engine_prompt_logprobs(engine: Any, rid: str) -> torch.Tensor:
    out = await engine.generate(
        GenerateRequest(rid, PROMPT, SamplingParams(max_tokens=1, temperature=0.0), prompt_logprobs=True)
    )
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    return torch.tensor(out.prompt_logprobs[1:], dtype=torch.float64)


def modified(model_dir: Path, seed: int) -> dict[str, torch.Tensor]:
    """What a trainer step would produce: every linear, norm and embedding changed a little."""
    from transformers import AutoModelForCausalLM

    sd = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) * v.abs().mean() for k, v in sd.items()}


async def test_engine_loads_pushed_weights_and_logprobs_follow(
    engine: Any, store: Any, model_dir: Path
) -> None:
    before = await engine_prompt_logprobs(engine, "before")
    torch.testing.assert_close(before, hf_prompt_logprobs(model_dir, None), atol=2e-3, rtol=0)

    new = modified(model_dir, seed=1)
    store.push(1, new).result(TIMEOUT)
    engine.prefetch(1)  # background pull while the engine keeps serving
    paused = await engine.update_weights(1)
    assert 0 < paused < 30
    assert await engine.weight_version() == 1

    after = await engine_prompt_logprobs(engine, "after")
    torch.testing.assert_close(after, hf_prompt_logprobs(model_dir, new), atol=2e-3, rtol=0)
    assert (after - before).abs().max() > 0.01, "weights changed but logprobs did not"


async def test_receiver_behind_skips_to_newest(engine: Any, store: Any, model_dir: Path) -> None:
    assert await engine.weight_version() == 1
    states = {v: modified(model_dir, seed=v) for v in (2, 3)}
    for v, sd in states.items():
        store.push(v, sd).result(TIMEOUT)
    newest = store.latest_version()
    assert newest == 3
    await engine.update_weights(newest)  # version 2 is never loaded
    assert await engine.weight_version() == 3
    torch.testing.assert_close(
        await engine_prompt_logprobs(engine, "v3"),
        hf_prompt_logprobs(model_dir, states[3]),
        atol=2e-3,
        rtol=0,
    )


async def test_a_pull_that_hangs_fails_the_update_naming_the_stage(
    engine: Any, store: Any, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store that never answers one pull: the update fails within the engine's stage bound naming the
    engine and the stage, the engine keeps serving what it had, and a later try pulls anew."""
    import threading

    from rollart_core.errors import WeightSyncError

    release = threading.Event()

    class Stuck:
        """The module's store, except that the pull of version 4 waits until released."""

        def __getattr__(self, name: str) -> Any:
            return getattr(store, name)

        def pull(self, version: int, *args: Any, **kw: Any) -> Any:
            if version == 4 and not release.is_set():
                release.wait(60)  # the stuck pull (a thread of the engine's) ends with the test
                raise TimeoutError("the stuck pull was let go")
            return store.pull(version, *args, **kw)

    store.push(4, modified(model_dir, seed=4)).result(TIMEOUT)
    monkeypatch.setattr(engine, "_store", Stuck())
    monkeypatch.setattr(engine.config, "update_stage_timeout_s", 1.0)
    try:
        with pytest.raises(
            WeightSyncError, match=r"ws: pulling version 4 took over update_stage_timeout_s=1"
        ):
            await engine.update_weights(4)
        assert await engine.weight_version() == 3
        out = await engine.generate(GenerateRequest("still", PROMPT, SamplingParams(max_tokens=2)))
        assert out.versions == [3, 3]
        release.set()  # the store answers again: the next update pulls anew and loads
        await engine.update_weights(4)
        assert await engine.weight_version() == 4
    finally:
        release.set()
