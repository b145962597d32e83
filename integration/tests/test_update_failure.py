"""A weight update that fails on one engine inside a running pipeline (tiny model, two vLLM CPU engines in
Ray actors, a torch trainer, the filesystem store wrapped by the ``faulty`` store, both behind the
``node_cache`` store): the first engine to pull version 2 gets an error. The proxy takes that engine out
and has Ray restart it, the other pulls version 2 itself and serves it, and the run goes on; the
restarted engine comes back on the served version, and every launched trajectory's fate is counted,
none failed. The engines shared each version through the node cache, which is gone after the run."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from rollart_core.config import ComponentConfig
from rollart_core.control.pipeline import Pipeline
from rollart_core.control.train import train
from rollart_core.metrics import MemorySink

from .conftest import slice_config

pytestmark = [pytest.mark.vllm, pytest.mark.ray]


async def test_one_engine_failing_an_update_is_restarted_and_the_run_goes_on(
    tmp_path: Path, tiny_model: Path
) -> None:
    cfg = slice_config(tmp_path, model_path=tiny_model, steps=4)
    cfg.engines[0].count = 2
    cfg.ray.num_cpus = 4
    claims = tmp_path / "claims"
    faulty = {
        "impl": "faulty",
        "options": {"store": cfg.weight_store.model_dump(), "claim_dir": str(claims), "fail_pull": [2]},
    }
    cfg.weight_store = ComponentConfig(
        impl="node_cache", options={"store": faulty, "cache_dir": str(tmp_path / "shm")}
    )
    sink, summary = MemorySink(), {}
    async with Pipeline(cfg) as p:
        proxy: Any = p.proxy
        await train(cfg, sink=sink, pipeline=p, summary=summary)
        assert p.trainer.version == 4 and len(sink.rows) == 4
        (fault,) = claims.iterdir()  # exactly one reader took it
        assert fault.name == "fail-v2-0"
        failed = [w for w in proxy.workers.values() if w.metrics.update_failures]
        assert len(failed) == 1 and failed[0].metrics.update_failures == 1, proxy.metrics()
        other = next(w for w in proxy.workers.values() if w is not failed[0])
        assert other.healthy and other.metrics.update_failures == 0

        deadline = time.monotonic() + 240  # Ray restarts the actor; recovery starts and updates it
        while not failed[0].healthy:
            assert time.monotonic() < deadline, "the restarted engine did not come back within 240 s"
            await proxy.check_health()
            await asyncio.sleep(0.5)
        assert failed[0].metrics.recovered >= 1
        assert await proxy.weight_versions() == {name: 4 for name in proxy.workers}
        cache = p.store.dir  # type: ignore[attr-defined]
        assert [f.name for f in cache.glob("v*.json")] == ["v0000000004.json"]  # the newest, shared
    assert not cache.exists()  # nothing left in node memory after the run
    fates = summary["fates"]
    assert sum(fates.values()) == summary["launched"] > 0
    assert set(fates) <= {"finished", "cancelled_at_stop"}, fates
