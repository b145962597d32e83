"""Prefill/decode disaggregation over two real vLLM (CPU) engines behind the proxy: a producer
(``kv_producer``) and a consumer (``kv_consumer``) sharing vLLM's ExampleConnector KV store.

- PD output equals the output of one engine without PD, greedy, token for token, and the decode
  engine really loaded the prompt's KV instead of computing it;
- a multi-turn trajectory: long first turn → pd, short new suffix on the cached history →
  decode_only, long new suffix → pd;
- a weight update across both pools: every worker at the new version before resuming, the KV
  store cleared, a request prefilled under one version and decoded under the next reports it;
- a prefill-worker crash: PD requests fall back to a local prefill on the decode worker.

Both engines live for the whole module; the crash test runs last because it shuts the producer down.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from rollart_core.types import GenerateRequest, SamplingParams
from rollart_proxy import LLMProxy, WorkerHandle
from rollart_proxy.pd import PDConfig, PDRouter, shared_storage_kv_args

pytestmark = [pytest.mark.vllm, pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]

NO_EOS = tuple(range(10, 300))  # no special token: generation never stops early
BLOCK = 128  # vLLM CPU's KV block: the connector moves whole blocks of the prompt


async def until(cond: Callable[[], Awaitable[bool]], timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not await cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 300) for _ in range(n)]


def greedy(rid: str, prompt: list[int], n: int = 16, *, session: str | None = None) -> GenerateRequest:
    sp = SamplingParams(max_tokens=n, temperature=0.0, allowed_token_ids=NO_EOS)
    return GenerateRequest(rid, prompt, sp, session_id=session, task="agent")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rollart_train.tiny import create_tiny_model

    return create_tiny_model(tmp_path_factory.mktemp("pd") / "tiny", dtype="float32")


@pytest.fixture(scope="module")
async def pd(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[dict[str, Any]]:
    from rollart_proxy.engines.vllm_engine import VllmEngine, VllmEngineConfig
    from rollart_weightsync import MemoryWeightStore

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    kv_dir = tmp_path_factory.mktemp("pd-kv")
    store = MemoryWeightStore()

    def engine(name: str, role: Any) -> VllmEngine:
        cfg = VllmEngineConfig(
            max_model_len=1024,
            dtype="float32",
            max_num_seqs=16,
            kv_cache_gib=1,
            engine_args=shared_storage_kv_args(role, kv_dir),
        )
        return VllmEngine(cfg, model_path=str(model_dir), weight_store=store, name=name)

    pre, dec = engine("pre", "kv_producer"), engine("dec", "kv_consumer")
    try:
        await asyncio.gather(pre.start(), dec.start())
        proxy = LLMProxy(
            [WorkerHandle("pre", pre, pool="prefill"), WorkerHandle("dec", dec, pool="decode")],
            task_pools={"agent": "decode"},
        )
        router = PDRouter(
            proxy,
            PDConfig(
                pools={"decode": "prefill"},
                task_policy={"agent": "on"},
                min_pd_suffix_tokens=BLOCK,
                kv_store_dir=kv_dir,
            ),
        )
        yield {"pre": pre, "dec": dec, "router": router, "store": store, "kv_dir": kv_dir}
    finally:
        await pre.shutdown()
        await dec.shutdown()


def cached(engine: Any) -> int:
    return int(engine.stats["cached_prompt_tokens"])


async def test_pd_equals_single_engine_greedy(pd: dict[str, Any]) -> None:
    pre, dec, router = pd["pre"], pd["dec"], pd["router"]
    prompt = tokens(300, seed=1)
    c_pre, c_dec = cached(pre), cached(dec)
    out = await router.generate(greedy("eq", prompt, 24))
    assert out.pd_path == "pd" and out.prefill_worker == "pre" and out.worker == "dec"
    assert cached(pre) == c_pre  # the producer computed the prompt itself ...
    assert cached(dec) - c_dec >= 2 * BLOCK  # ... the consumer loaded its KV instead of computing it
    assert any(pd["kv_dir"].iterdir())
    ref = await pre.generate(greedy("eq-ref", prompt, 24))  # one engine, no PD
    assert out.token_ids == ref.token_ids and out.finish_reason == ref.finish_reason == "length"
    assert len(out.logprobs) == len(out.versions) == 24 and out.logprobs[0] == pytest.approx(ref.logprobs[0])
    assert out.prefill_version == 0 and set(out.versions) == {0} and not out.mixed_versions
    assert (await router.metrics())["pd"]["paths"]["pd"] >= 1
    # concurrent long prompts (more tokens than one scheduler step) and a prompt of whole blocks
    # (vLLM's ExampleConnector would look it up and load it under different keys and die)
    prompts = [tokens(700, seed=20 + i) for i in range(4)] + [tokens(2 * BLOCK, seed=30)]
    outs = await asyncio.gather(*(router.generate(greedy(f"c{i}", p, 12)) for i, p in enumerate(prompts)))
    refs = await asyncio.gather(*(pre.generate(greedy(f"c{i}-ref", p, 12)) for i, p in enumerate(prompts)))
    assert [o.token_ids for o in outs] == [r.token_ids for r in refs]
    assert {o.pd_path for o in outs} == {"pd"} and {o.worker for o in outs} == {"dec"}
    # streamed: the first delta is the prefill worker's token, then the decode worker's deltas
    parts = [p async for p in router.generate_stream(greedy("eq-stream", tokens(300, seed=7), 24))]
    assert parts[0].worker == "pre" and len(parts[0].token_ids) == 1 and parts[0].finish_reason == ""
    final = parts[-1]
    streamed = [t for p in parts[:-1] for t in p.token_ids]
    assert final.pd_path == "pd" and len(parts) >= 3 and final.token_ids[: len(streamed)] == streamed
    assert final.token_ids == (await pre.generate(greedy("eq-stream-ref", tokens(300, seed=7), 24))).token_ids


async def test_multi_turn_paths_and_prefix_reuse(pd: dict[str, Any]) -> None:
    pre, dec, router = pd["pre"], pd["dec"], pd["router"]
    before = dict(router.paths)
    history: list[int] = []
    paths, reuse = [], []
    for turn, new in enumerate((tokens(300, 2), tokens(12, 3), tokens(260, 4))):
        prompt = history + new
        c_dec = cached(dec)
        out = await router.generate(greedy(f"mt-{turn}", prompt, 10, session="traj"))
        ref = await pre.generate(greedy(f"mt-{turn}-ref", prompt, 10))
        assert out.token_ids == ref.token_ids, f"turn {turn}"
        paths.append(out.pd_path)
        reuse.append(cached(dec) - c_dec)
        history = prompt + out.token_ids
    assert paths == ["pd", "decode_only", "pd"]
    assert reuse[1] >= 2 * BLOCK  # the short turn reused the history cached on the decode worker
    assert router.session_worker("traj") == "dec"
    assert {k: router.paths[k] - before[k] for k in before} == {
        "pd": 2,
        "decode_only": 1,
        "local_fallback": 0,
    }
    router.end_session("traj")


async def test_weight_update_across_pools_keeps_versions_consistent(
    pd: dict[str, Any], model_dir: Path
) -> None:
    import torch
    from safetensors.torch import load_file

    pre, dec, router, store = pd["pre"], pd["dec"], pd["router"], pd["store"]
    base = load_file(str(model_dir / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)

    def perturbed(scale: float) -> dict[str, torch.Tensor]:
        return {
            k: v + scale * torch.randn(v.shape, generator=gen) if v.is_floating_point() else v
            for k, v in base.items()
        }

    prompt = tokens(300, seed=1)  # prefilled under version 0 by the first test: its KV is in the store
    old = await router.generate(greedy("v0", prompt, 24))
    store.push(1, perturbed(0.05)).result(timeout=60)
    pauses = await router.update_weights(1)
    assert set(pauses) == {"pre", "dec"} and await router.weight_versions() == {"pre": 1, "dec": 1}
    assert not router.suspended and not any(pd["kv_dir"].iterdir())  # no KV of version 0 can be loaded
    new = await router.generate(greedy("v1", prompt, 24))
    assert new.pd_path == "pd" and new.prefill_version == 1 and set(new.versions) == {1}
    assert new.token_ids == (await pre.generate(greedy("v1-ref", prompt, 24))).token_ids
    assert new.token_ids != old.token_ids  # the weights really changed

    # A request prefilled under version 1 whose decode waits (decode worker paused) until the
    # update to version 2 has happened: it is decoded under 2 and says so.
    store.push(2, perturbed(0.05)).result(timeout=60)
    mixed_before = router.mixed_version_requests
    await dec.pause("keep")
    n_pre = pre.stats["requests"]
    task = asyncio.create_task(router.generate(greedy("mix", tokens(280, seed=9), 12)))

    async def prefilled() -> bool:
        return pre.stats["requests"] > n_pre

    await until(prefilled, what="the prefill to finish")
    await router.update_weights(2)
    out = await asyncio.wait_for(task, 60)
    assert out.pd_path == "pd" and out.prefill_version == 1 and out.versions == [1] + [2] * 11
    assert out.mixed_versions and router.mixed_version_requests == mixed_before + 1
    assert (await router.metrics())["pd"]["mixed_version_requests"] == router.mixed_version_requests


async def test_prefill_crash_falls_back_to_local_prefill(pd: dict[str, Any]) -> None:
    pre, dec, router = pd["pre"], pd["dec"], pd["router"]
    prompt = tokens(300, seed=5)
    ref = await pre.generate(greedy("crash-ref", prompt, 16))
    router.clear_kv_store()  # nothing in flight: forget the reference's KV so the fallback must compute it
    await pre.shutdown()  # the prefill worker dies
    c_dec = cached(dec)
    out = await router.generate(greedy("crash", prompt, 16, session="c"))
    assert out.pd_path == "local_fallback" and out.worker == "dec" and out.prefill_worker is None
    assert out.token_ids == ref.token_ids
    assert cached(dec) == c_dec  # prefilled on the decode worker itself
    assert not router.proxy.workers["pre"].healthy
    again = await router.generate(greedy("crash-2", tokens(200, seed=6), 8))
    m = await router.metrics()
    assert again.pd_path == "local_fallback" and m["pd"]["paths"]["local_fallback"] == 2
    assert m["pre"]["pd_role"] == "prefill" and not m["pre"]["healthy"] and m["dec"]["pd_role"] == "decode"
