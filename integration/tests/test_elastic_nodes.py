"""An elastic engine group follows the Ray cluster's nodes: a real cluster on this machine (``ray start``
head + worker nodes, as in ``test_multinode.py``), a pipeline joined to it whose engine group ``gen``
(pool ``H20``, ``elastic: {min_count: 1, max_count: 2}``) starts with one vLLM engine on the one ``H20``
node. A second ``H20`` node joins: the pipeline's node watch adds ``gen-1`` there, brought to the served
version, and it serves. That node is stopped: the watch removes ``gen-1``; ``gen-0`` goes on serving.
Slow (two vLLM engine starts and three Ray nodes on two cores)."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rollart_core.config import ElasticConfig
from rollart_core.control.pipeline import Pipeline
from rollart_core.resources import LOOPBACK_ENV
from rollart_core.types import GenerateRequest, SamplingParams

from .conftest import slice_config, until
from .test_multinode import LocalCluster

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.ray]


@pytest.fixture
def nodes() -> Iterator[LocalCluster]:
    c = LocalCluster()
    try:
        with pytest.MonkeyPatch.context() as mp:
            for k, v in LOOPBACK_ENV.items():
                mp.setenv(k, v)
            import ray
            import ray._private.ray_constants as ray_constants
            import ray._private.services as services

            if ray.is_initialized():
                pytest.fail("a Ray session is already open in this process; this test needs its own cluster")
            mp.setattr(ray_constants, "RAY_ENABLE_UV_RUN_RUNTIME_ENV", False)
            mp.setattr(services, "resolve_ip_for_localhost", lambda host: host)
            c._start("--num-cpus=2", head=True)
            c._start("--num-cpus=1", '--resources={"H20": 1}')
            yield c
    finally:
        import ray

        ray.shutdown()
        left = c.stop()
    assert not left, f"processes of our Ray nodes still alive: {left}"


async def test_an_elastic_group_grows_on_a_joined_node_and_shrinks_when_it_leaves(
    nodes: LocalCluster, tmp_path: Path, tiny_model: Path
) -> None:
    cfg = slice_config(tmp_path, model_path=tiny_model)
    cfg.ray.address, cfg.ray.num_cpus = nodes.address, None
    cfg.weight_store.options["shared"] = True  # every node is this machine
    group = cfg.engines[0]
    group.pool = "H20"
    group.elastic = ElasticConfig(
        min_count=1, max_count=2, check_period_s=1.0, place_timeout_s=5.0, drain_timeout_s=0.0
    )
    async with Pipeline(cfg) as p:
        proxy: Any = p.proxy
        elastic: Any = p.elastic
        assert elastic.count("gen") == 1
        nodes._start("--num-cpus=1", '--resources={"H20": 1}')  # a second H20 node joins
        await until(lambda: elastic.count("gen") == 2, 300, "the watch to add gen-1")
        joined = elastic.engines["gen-1"]
        assert joined.node and joined.node != elastic.engines["gen-0"].node
        outs = await asyncio.gather(
            *(
                proxy.generate(
                    GenerateRequest(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=2), session_id=f"s{i}")
                )
                for i in range(16)
            )
        )
        assert {o.worker for o in outs} == {"gen-0", "gen-1"}
        nodes.nodes[-1].send_signal(signal.SIGTERM)  # that node leaves
        await until(lambda: [c["op"] for c in elastic.changes] == ["add", "remove"], 120, "gen-1 removed")
        assert list(proxy.workers) == ["gen-0"]
        out = await proxy.generate(GenerateRequest("after", [1, 2, 3], SamplingParams(max_tokens=2)))
        assert out.worker == "gen-0"
        ops = [(c["op"], c["name"], c["why"].split()[0]) for c in elastic.changes]
        assert ops == [("add", "gen-1", "node"), ("remove", "gen-1", "node")], elastic.changes
