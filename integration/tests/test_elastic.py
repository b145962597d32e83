"""The elastic rollout pool on the real stack: an async run (tiny model, vLLM CPU engines in Ray actors,
a torch trainer, a filesystem weight store) gets an engine added through its admin endpoint, then its
first engine removed while a long request runs there. The added engine serves the served version before
its first request; the long request continues on it from the tokens it had; the run goes on, and every
launched trajectory's fate is counted, none failed."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rollart_core.control.admin import admin_call
from rollart_core.control.elastic import ElasticError
from rollart_core.control.pipeline import Pipeline
from rollart_core.control.train import train
from rollart_core.metrics import MemorySink
from rollart_core.types import GenerateRequest, SamplingParams

from .conftest import slice_config, until

pytestmark = [pytest.mark.vllm, pytest.mark.ray]


async def call(run_dir: Path, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    return await asyncio.to_thread(admin_call, run_dir, method, path, body, 600)


async def test_an_engine_added_and_one_removed_mid_run_lose_nothing(tmp_path: Path, tiny_model: Path) -> None:
    cfg = slice_config(tmp_path, model_path=tiny_model, steps=1000)  # stopped below, once checked
    cfg.loop.mode, cfg.loop.alpha = "async", 1  # type: ignore[assignment]
    cfg.ray.num_cpus = 4
    run_dir = cfg.output_dir
    sink, summary = MemorySink(), {}
    async with Pipeline(cfg) as p:
        proxy: Any = p.proxy
        run = asyncio.create_task(train(cfg, sink=sink, pipeline=p, summary=summary))
        try:
            await until(lambda: p.trainer.version >= 1 or run.done(), 300, "the first step")
            assert not run.done()
            added = await call(run_dir, "POST", "/engines", {"group": "gen"})
            assert added["name"] == "gen-1" and added["version"] >= 1
            await until(lambda: proxy.workers["gen-1"].served >= 4 or run.done(), 120, "gen-1 serving")
            listing = await asyncio.to_thread(  # the CLI, as a user runs it (the endpoint is in this loop)
                subprocess.run,
                [str(Path(sys.executable).parent / "rollart"), "engines", str(run_dir), "list"],
                capture_output=True,
                text=True,
                timeout=60,
                check=True,
            )
            assert {e["name"] for e in json.loads(listing.stdout)["engines"]} == {"gen-0", "gen-1"}

            # a long request on gen-0 (sticky session), then gen-0 removed with no time to drain
            session = await _session_on(proxy, "gen-0")
            long = asyncio.create_task(
                proxy.generate(
                    GenerateRequest(
                        "long",
                        [1, 20, 31, 45, 52],
                        SamplingParams(
                            max_tokens=300, temperature=1.0, allowed_token_ids=tuple(range(10, 300))
                        ),
                        session_id=session,
                    )
                )
            )
            await until(lambda: proxy._request_worker.get("long") == "gen-0", 30, "the long request on gen-0")
            removed = await call(run_dir, "DELETE", "/engines/gen-0?drain_timeout_s=0")
            assert removed["handed_back"] >= 1
            out = await asyncio.wait_for(long, 300)
            assert out.worker == "gen-1" and out.finish_reason == "length"
            assert len(out.token_ids) == len(out.logprobs) == len(out.versions) == 300
            assert set(out.token_ids) <= set(range(10, 300))
            assert list(proxy.workers) == ["gen-1"]
            with pytest.raises(ElasticError, match=r"409: .*last healthy worker of pool 'gen'"):
                await call(run_dir, "DELETE", "/engines/gen-1")
            steps_at_removal = len(sink.rows)
            await until(lambda: len(sink.rows) >= steps_at_removal + 2 or run.done(), 300, "two more steps")
            assert not run.done(), run.exception() if run.done() else None
        finally:
            run.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await run
        assert proxy.elastic == {"added": 1, "removed": 1, "handed_back": removed["handed_back"]}
        changes = p.elastic.changes if p.elastic is not None else []
        assert [(c["op"], c["name"]) for c in changes] == [("add", "gen-1"), ("remove", "gen-0")]
    fates = summary["fates"]
    assert sum(fates.values()) == summary["launched"] > 0
    assert not {
        f for f in fates if f not in ("finished", "cancelled_at_stop", "aborted_stale", "cancelled_redundant")
    }, fates


async def _session_on(proxy: Any, worker: str) -> str:
    """A session id whose last turn was served by ``worker`` (its next turn sticks there)."""
    for i in range(200):
        sid = f"probe-{i}"
        await proxy.generate(
            GenerateRequest(f"probe-{i}", [1, 2, 3], SamplingParams(max_tokens=1), session_id=sid)
        )
        if proxy.session_worker(sid) == worker:
            return sid
    raise AssertionError(f"no probe landed on {worker}")
