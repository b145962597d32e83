"""An engine actor killed with SIGKILL comes back on the served weights, and the proxy never routes to
it before: two real vLLM (CPU) engines in Ray actors created with ``max_restarts=1,
max_task_retries=0`` (the shape ``rollart_core.control.pipeline`` uses), a real filesystem weight store.

Version 1 is pushed and served; requests run on both engines; engine b's process is killed. Its
in-flight requests fail over to engine a (complete, version 1), a request made while b is down is
served by a; Ray restarts b's actor (``__init__`` again, not ``start()``, initial weights); the
proxy's health loop finds it, starts it, updates it to version 1 and only then marks it healthy. b
then generates with tokens of version 1 whose prompt logprobs are those of the version-1 weights.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from rollart_core.types import GenerateRequest, SamplingParams

pytestmark = [
    pytest.mark.ray,
    pytest.mark.vllm,
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]

NO_EOS = tuple(range(10, 300))
PROMPT = [1, 20, 31, 45, 52, 67, 80, 99, 120, 140]
# In-process engine core (no V1 multiprocessing): the engine lives and dies with its actor's process,
# and starts in seconds.
ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}


async def until(cond: Callable[[], Awaitable[bool]], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not await cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.05)


@pytest.fixture(scope="module")
async def engines(
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[tuple[dict[str, Any], Any, Path]]:
    import ray

    from rollart_core.resources import LOOPBACK_ENV
    from rollart_proxy.engines.vllm_engine import VllmEngine, VllmEngineConfig
    from rollart_train.tiny import create_tiny_model
    from rollart_weightsync import FilesystemWeightStore

    root = tmp_path_factory.mktemp("engine-restart")
    model = create_tiny_model(root / "tiny", dtype="float32")
    store = FilesystemWeightStore(root=root / "weights")
    for k, v in LOOPBACK_ENV.items():
        os.environ.setdefault(k, v)
    started = not ray.is_initialized()
    if started:  # a cluster of our own (never one another process started), on loopback
        ray.init(address="local", num_cpus=2, _node_ip_address="127.0.0.1", include_dashboard=False)
    cfg = VllmEngineConfig(max_model_len=512, dtype="float32", max_num_seqs=16, kv_cache_gib=1)
    handles: dict[str, Any] = {}
    try:
        for name in ("a", "b"):
            handles[name] = (
                ray.remote(VllmEngine)
                .options(
                    num_cpus=0.5,
                    max_concurrency=1024,
                    runtime_env={"env_vars": ENGINE_ENV},
                    max_restarts=1,
                    max_task_retries=0,
                )
                .remote(cfg, model_path=str(model), weight_store=store, name=name)
            )
        await asyncio.wait_for(asyncio.gather(*(h.start.remote() for h in handles.values())), 600)
        yield handles, store, model
    finally:
        for h in handles.values():
            try:
                await asyncio.wait_for(h.shutdown.remote(), 60)
            except Exception:  # killed below either way
                pass
            ray.kill(h, no_restart=True)
        if started:
            ray.shutdown()


def req(rid: str, n: int, *, session: str | None = None, prompt_logprobs: bool = False) -> GenerateRequest:
    return GenerateRequest(
        rid,
        list(PROMPT),
        SamplingParams(max_tokens=n, seed=0, allowed_token_ids=NO_EOS),
        session_id=session,
        prompt_logprobs=prompt_logprobs,
    )


def modified(model: Path) -> dict[str, Any]:
    import torch
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(1)
    return {
        k: v + 0.05 * torch.randn(v.shape, generator=g) * v.abs().mean()
        for k, v in load_file(str(model / "model.safetensors")).items()
    }


def close(a: list[float | None], b: list[float | None], atol: float = 2e-3) -> bool:
    return len(a) == len(b) and all(
        (x is None and y is None) or (x is not None and y is not None and abs(x - y) <= atol)
        for x, y in zip(a, b, strict=True)
    )


async def test_killed_engine_comes_back_on_the_served_weights(
    engines: tuple[dict[str, Any], Any, Path],
) -> None:
    from rollart_proxy import LLMProxy

    handles, store, model = engines
    proxy = LLMProxy.from_ray_actors([(n, h, "gen") for n, h in handles.items()], max_retries=1)
    only_b = LLMProxy.from_ray_actors([("b", handles["b"], "gen")], max_retries=0)  # to aim a request at b
    v0 = (await only_b.generate(req("v0", 1, prompt_logprobs=True))).prompt_logprobs
    await asyncio.to_thread(lambda: store.push(1, modified(model)).result(120))
    await proxy.update_weights(1)
    assert await proxy.weight_versions() == {"a": 1, "b": 1}
    v1 = (await only_b.generate(req("v1", 1, prompt_logprobs=True))).prompt_logprobs
    assert v0 is not None and v1 is not None and not close(v0, v1), "version 1 changed nothing"

    proxy.start_health_loop(0.5)
    try:
        n = 300
        tasks = [
            asyncio.create_task(proxy.generate(req(f"long-{i}", n, session=f"traj-{i}"))) for i in range(4)
        ]

        async def b_generating() -> bool:
            prog = await handles["b"].progress.remote()
            return bool(prog) and max(prog.values()) >= 3

        await until(b_generating, 120, "requests generating on b")
        on_b = set(await handles["b"].progress.remote())
        old_pid = await handles["b"].pid.remote()
        os.kill(old_pid, signal.SIGKILL)  # the actor's process, which this test's cluster started

        survivor = await asyncio.wait_for(proxy.generate(req("while-down", 4)), 120)
        assert survivor.worker == "a" and survivor.versions == [1] * 4
        outs = await asyncio.wait_for(asyncio.gather(*tasks), 300)  # never hangs: failed over to a
        for o in outs:
            assert o.finish_reason == "length" and len(o.token_ids) == n and o.versions == [1] * n, o
            if o.request_id in on_b:
                assert o.worker == "a"
        assert on_b and proxy.workers["b"].metrics.failures >= 1

        async def b_recovered() -> bool:
            return proxy.workers["b"].metrics.recovered >= 1 and proxy.workers["b"].healthy

        await until(b_recovered, 300, "the proxy to recover b")
    finally:
        await proxy.stop_health_loop()
    m = (await proxy.metrics(engine_stats=False))["b"]
    assert m["restarts_seen"] == 1 and m["recovered"] == 1 and m["healthy"]
    assert await handles["b"].pid.remote() != old_pid  # a new process: Ray restarted the actor
    assert await proxy.weight_versions() == {"a": 1, "b": 1}
    out = await only_b.generate(req("after", 16, prompt_logprobs=True))
    assert out.worker == "b" and out.versions == [1] * 16
    assert out.prompt_logprobs is not None and close(out.prompt_logprobs, v1), (
        "b serves other weights than v1"
    )
    for i in range(4):
        proxy.end_session(f"traj-{i}")
    assert proxy.session_counts() == {"sessions": 0, "sessions_in_flight": 0, "requests_in_flight": 0}
