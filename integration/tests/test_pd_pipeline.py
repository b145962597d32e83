"""Prefill/decode disaggregation wired by the pipeline from a run config: a task with ``pd: on``
and a ``prefill_engine_group`` gets KV-producer engines in its prefill group and KV-consumer engines in its
decode group (vLLM CPU engines in Ray actors), the PD router in front of the proxy, weight updates
that reach both pools, and a killed prefill worker that comes back on the served version before it
prefills again."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from rollart_core.config import RunConfig
from rollart_core.control.state import RunState
from rollart_core.types import Fate, GenerateRequest, SamplingParams

from .conftest import rollout_step

# two vLLM engines in Ray actors (~2 min to start on 2 cores): in the slow set
pytestmark = [pytest.mark.vllm, pytest.mark.ray, pytest.mark.slow]


def pd_config(root: Path) -> RunConfig:
    engine = {
        "impl": "vllm",
        "count": 1,
        "num_cpus": 0.25,
        "max_restarts": 1,
        "options": {"max_model_len": 512, "dtype": "float32", "max_num_seqs": 16},
    }
    return RunConfig.model_validate(
        {
            "name": "it-pd",
            "output_dir": str(root / "run"),
            "seed": 3,
            "model": {"path": str(root / "model"), "create_tiny": True, "dtype": "float32"},
            "engines": [{"name": "pre", **engine}, {"name": "dec", **engine}],
            "tasks": [
                {
                    "name": "lake",
                    "engine_group": "dec",
                    "prefill_engine_group": "pre",
                    "pd": "on",
                    "env": {"impl": "frozenlake", "options": {"size": 4, "hole_prob": 0.2, "max_steps": 4}},
                    "reward": {"impl": "success"},
                    "sampling": {"max_tokens": 1, "temperature": 1.0},
                    "group_size": 2,
                    "groups_per_step": 2,
                    "max_turns": 4,
                }
            ],
            "trainer": {"impl": "torch", "options": {"lr": 0.01}},
            "weight_store": {"impl": "filesystem", "options": {"root": str(root / "weights")}},
            "loop": {"mode": "sync", "alpha": 0, "steps": 1},
            "ray": {"num_cpus": 2},
        }
    )


async def test_pipeline_runs_pd_tasks_through_both_pools(tmp_path: Path) -> None:
    from rollart_core.control.pipeline import Pipeline

    long_prompt = [10 + (i * 7) % 280 for i in range(300)]  # long enough for the PD path (>= 256 uncached)

    def req(rid: str) -> GenerateRequest:
        return GenerateRequest(
            rid, long_prompt, SamplingParams(max_tokens=8, temperature=0.0), session_id=rid, task="lake"
        )

    async with Pipeline(pd_config(tmp_path)) as p:
        assert type(p.proxy).__name__ == "PDRouter"
        out = await p.proxy.generate(req("pd-0"))
        assert out.pd_path == "pd" and out.prefill_worker == "pre-0" and out.worker == "dec-0"
        assert len(out.token_ids) == 8 and out.versions == [0] * 8
        # FrozenLake turns generate one token: not worth a second hop, served by the decode pool
        workers = p.proxy.proxy.workers
        prefilled = workers["pre-0"].served
        state = RunState(p.config.loop.alpha, p.trainer.version)
        trajs = await rollout_step(p, step=1, state=state)
        assert {t.fate for t in trajs} == {Fate.FINISHED}
        assert workers["pre-0"].served == prefilled and workers["dec-0"].served > len(trajs)
        # a weight update reaches both pools before either resumes
        batch = await state.get_batch(2, version=0)
        if len({t.reward for t in batch}) == 1:
            batch[0].reward = 1.0 - batch[0].reward
        p.trainer.train_step(batch)
        await asyncio.wrap_future(p.store.push(1, dict(p.trainer.named_weights())))
        await p.proxy.update_weights(1)
        assert await p.proxy.weight_versions() == {"pre-0": 1, "dec-0": 1}
        again = await p.proxy.generate(req("pd-1"))
        assert again.pd_path == "pd" and again.versions == [1] * 8 and again.prefill_version == 1
        paths = (await p.proxy.metrics())["pd"]["paths"]
        assert paths["pd"] == 2 and paths["decode_only"] >= len(trajs)

        # the prefill worker's actor is SIGKILLed: PD requests fall back to a local prefill meanwhile;
        # Ray restarts the actor (engines[].max_restarts), the proxy's health loop starts it and brings
        # it to version 1, and only then does it prefill again: no request ever sees version 0
        pre = workers["pre-0"]
        old_pid = await pre.engine.pid()
        os.kill(old_pid, signal.SIGKILL)  # a process of the Ray cluster this pipeline started
        during: list[str] = []
        deadline = time.monotonic() + 600
        while not (pre.healthy and pre.metrics.recovered >= 1):
            assert time.monotonic() < deadline, "the prefill worker did not come back within 600 s"
            out = await p.proxy.generate(req(f"during-{len(during)}"))
            assert out.versions == [1] * 8 and out.prefill_version in (None, 1), out
            during.append(out.pd_path)
            await asyncio.sleep(0.5)  # a request every half second while it is away
        assert "local_fallback" in during and set(during) <= {"local_fallback", "pd"}
        assert pre.metrics.restarts_seen == 1 and await pre.engine.pid() != old_pid
        assert await p.proxy.weight_versions() == {"pre-0": 1, "dec-0": 1}
        back = await p.proxy.generate(req("pd-back"))
        assert back.pd_path == "pd" and back.prefill_worker == "pre-0" and back.prefill_version == 1
        assert back.versions == [1] * 8
