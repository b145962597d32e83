"""Task → pool routing over two real vLLM (CPU) engines in Ray actors placed by custom resources
(``H800`` for the prefill-heavy task, ``H20`` for the decode-heavy one), then a worker killed with
``ray.kill``: its pool has no other worker, so its requests fail after the retries with a clear
error while the other pool keeps serving."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rollart_core.types import GenerateRequest, SamplingParams

# Two vLLM engines in Ray actors on H800/H20 resources (~1 min to start): in the slow set; pool routing
# is also covered by the default run (integration/tests/test_multinode.py).
pytestmark = [pytest.mark.vllm, pytest.mark.ray, pytest.mark.slow]

NO_EOS = tuple(range(10, 300))
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    from rollart_core.config import RayConfig
    from rollart_core.resources import RayCluster

    with RayCluster(RayConfig(num_cpus=2, resources={"H800": 1, "H20": 1})) as c:
        import ray

        have = ray.cluster_resources()
        if have.get("H800", 0) < 1 or have.get("H20", 0) < 1:
            pytest.fail(f"joined a Ray cluster without the H800/H20 pools: {have}")
        yield c


@pytest.fixture(scope="module")
def actors(cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    import ray

    from rollart_core.resources import get_affinity, ray_actor_options
    from rollart_proxy.engines.vllm_engine import VllmEngine, VllmEngineConfig
    from rollart_train.tiny import create_tiny_model

    model: Path = create_tiny_model(tmp_path_factory.mktemp("proxy-pools") / "tiny", dtype="float32")
    cfg = VllmEngineConfig(max_model_len=512, dtype="float32", max_num_seqs=16, kv_cache_gib=1)
    handles = {}
    for name, pool in (("prefill-0", "H800"), ("decode-0", "H20")):
        opts = ray_actor_options(get_affinity(VllmEngine, pool=pool, num_cpus=1))
        handles[name] = (
            ray.remote(VllmEngine)
            .options(**opts, max_concurrency=64, runtime_env={"env_vars": ENGINE_ENV})
            .remote(cfg, model_path=str(model), name=name)
        )
    try:
        ray.get([h.start.remote() for h in handles.values()], timeout=600)
        yield handles
    finally:
        for h in handles.values():
            try:
                ray.get(h.shutdown.remote(), timeout=30)
            except Exception:  # already killed by the crash test
                pass
            ray.kill(h)


def req(rid: str, task: str, n: int = 6, session: str | None = None) -> GenerateRequest:
    return GenerateRequest(
        rid,
        [1, 20, 30, 40],
        SamplingParams(max_tokens=n, allowed_token_ids=NO_EOS, seed=0),
        session_id=session,
        task=task,
    )


async def test_tasks_only_reach_workers_of_their_pool(actors: dict[str, Any]) -> None:
    from rollart_proxy import LLMProxy

    proxy = LLMProxy.from_ray_actors(
        [(n, h, "H800" if n.startswith("prefill") else "H20") for n, h in actors.items()],
        task_pools={"math": "H800", "agent": "H20"},
        max_retries=1,
    )
    outs = await asyncio.gather(
        *(proxy.generate(req(f"{t}-{i}", t, session=f"{t}-{i}")) for i in range(4) for t in ("math", "agent"))
    )
    for o in outs:
        assert o.worker == ("prefill-0" if o.request_id.startswith("math") else "decode-0")
        assert len(o.token_ids) == 6 and o.versions == [0] * 6
    # the actors hold their pool's unit: neither pool has capacity left
    import ray

    free = ray.available_resources()
    assert free.get("H800", 0) == 0 and free.get("H20", 0) == 0, free
    with pytest.raises(Exception, match="pools without workers"):
        LLMProxy.from_ray_actors([("x", actors["decode-0"], "H20")], task_pools={"math": "H800"})
    m = await proxy.metrics()
    assert (
        m["prefill-0"]["pool"] == "H800"
        and m["prefill-0"]["requests"] == 4
        and m["decode-0"]["requests"] == 4
    )


async def test_killed_worker_fails_its_pool_and_the_other_pool_keeps_serving(actors: dict[str, Any]) -> None:
    import ray

    from rollart_proxy import LLMProxy
    from rollart_proxy.errors import WorkerUnavailableError

    proxy = LLMProxy.from_ray_actors(
        [(n, h, "H800" if n.startswith("prefill") else "H20") for n, h in actors.items()],
        task_pools={"math": "H800", "agent": "H20"},
        max_retries=2,
    )
    doomed = asyncio.create_task(proxy.generate(req("agent-long", "agent", n=400)))

    async def running() -> bool:
        return (await actors["decode-0"].progress.remote()).get("agent-long", 0) >= 3

    deadline = asyncio.get_running_loop().time() + 120
    while not await running():
        assert asyncio.get_running_loop().time() < deadline, "request never started"
        await asyncio.sleep(0.05)
    ray.kill(actors["decode-0"])
    with pytest.raises(WorkerUnavailableError):
        await asyncio.wait_for(doomed, 120)
    assert not proxy.workers["decode-0"].healthy
    assert (await proxy.generate(req("math-after", "math"))).worker == "prefill-0"
