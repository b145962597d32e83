"""The trainer as a placed, restartable worker group inside a real async run: 2 torch ranks (gloo)
as Ray actors on the ``H800`` pool, a vLLM CPU engine, FrozenLake, and a reward stage the pipeline
starts itself (``reward_executor: serverless``: ``rollart-reward serve`` in a Ray actor). A rank is
killed with SIGKILL mid-run: the group comes back from the newest checkpoint while rollout goes on,
the run completes its steps, every launched trajectory has one fate, and nothing is left behind."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from rollart_core.config import RunConfig
from rollart_core.metrics import MemorySink

from .conftest import slice_config

pytestmark = [pytest.mark.vllm, pytest.mark.ray]


def group_config(root: Path, model: Path, steps: int) -> RunConfig:
    data = slice_config(root, model_path=model, steps=steps).model_dump(mode="json")
    data["trainer"] = {
        "impl": "torch",
        "ranks": 2,
        "pool": "H800",
        "num_cpus": 0.25,
        "options": {"lr": 0.01, "num_threads": 1},
    }
    data["loop"] = {
        "mode": "async",
        "alpha": 1,
        "steps": steps,
        "save_every": 1,
        "max_trainer_restarts": 1,
        "stall_timeout_s": 300,
    }
    data["tasks"][0]["reward_executor"] = {
        "impl": "serverless",
        "options": {"http": {"fallback": "none"}, "runtime": {"max_workers": 1}},
    }
    data["ray"] = {"num_cpus": 2, "resources": {"H800": 2}}
    return RunConfig.model_validate(data)


def _reward_runtimes() -> list[int]:
    """PIDs of ``rollart-reward serve`` processes on this machine."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                argv = (d / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"serve" in argv and any(b"rollart-reward" in a or b"rollart_reward" in a for a in argv):
                out.append(int(d.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow  # ~70 s; CI keeps the rank kill/restart tests of rollart-train (test_ray_group)
async def test_async_run_survives_a_killed_trainer_rank(tmp_path: Path, tiny_model: Path) -> None:
    import ray

    from rollart_core.control.pipeline import Pipeline
    from rollart_core.control.train import train

    cfg = group_config(tmp_path, tiny_model, steps=5)
    async with Pipeline(cfg) as p:
        group = p.trainer
        rank_nodes = set(group.node_ids)
        h800_nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("H800")}
        assert rank_nodes <= h800_nodes and len(group.pids) == 2
        run = asyncio.create_task(train(cfg, sink=MemorySink(), pipeline=p))

        async def version_at_least(v: int) -> None:
            while p.trainer.version < v and not run.done():
                await asyncio.sleep(0.05)

        await asyncio.wait_for(version_at_least(2), 600)  # checkpoint-1 is written by then
        assert not run.done(), run.exception() if run.done() else None
        victim = group.pids[1]
        os.kill(victim, signal.SIGKILL)
        summary = await asyncio.wait_for(run, 900)
        reward_stats = p.rewards[cfg.tasks[0].name].stats()
        runtime_pids = _reward_runtimes()
        rank_pids = list(group.pids)
    hist = summary["history"]
    assert summary["steps"] == 5 and summary["final_version"] == 5 == summary["served_version"]
    restarted = [h for h in hist if h.get("trainer_restarts")]
    assert len(restarted) == 1 and restarted[0]["trainer_restarts"] == 1, [
        h.get("trainer_restarts") for h in hist
    ]
    assert restarted[0]["lost_steps"] >= 0 and restarted[0]["restored_version"] >= 1
    assert victim not in rank_pids
    assert summary["launched"] == sum(summary["fates"].values())
    assert summary["fates"]["finished"] >= sum(h["batch_size"] for h in hist)
    assert all(h["lag_max"] <= 1 for h in hist)
    # rewards went through the runtime the pipeline started, and the pipeline stopped what it started
    assert reward_stats["runtime_calls"] > 0 and reward_stats["runtime_cold_starts"] >= 1, reward_stats
    assert runtime_pids, "no reward runtime process was running during the run"
    assert not any(_alive(pid) for pid in [*rank_pids, *runtime_pids])
