"""The three training modes on the real pipeline: invariants that must hold in every mode."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollart_core.control.pipeline import Pipeline
from rollart_core.control.train import train

from .conftest import slice_config

pytestmark = [pytest.mark.vllm, pytest.mark.ray]


@pytest.fixture(scope="module", autouse=True)
def ray_session() -> object:
    """One Ray session for the module: each run's pipeline joins it instead of starting and stopping
    its own (RayCluster reuses an initialised Ray), which saves Ray's start-up per run."""
    from rollart_core.resources import RayCluster

    with RayCluster(slice_config(Path("unused")).ray) as cluster:
        yield cluster


class _Collect:
    def __init__(self) -> None:
        self.rows: list[tuple[int, dict]] = []

    def log(self, step: int, metrics: dict) -> None:
        self.rows.append((step, metrics))

    def close(self) -> None:
        pass


# one_off is the batch-level middle of the same code path that sync and async cover, and the update
# after Get Batch (on_arrival False) an ablation of async's default; both run in the slow set (CI time),
# and their step order is checked on the in-process fakes (packages/rollart-core/tests/test_control_plane.py)
@pytest.mark.parametrize(
    ("mode", "alpha", "on_arrival"),
    [
        pytest.param("one_off", 1, True, marks=pytest.mark.slow),
        ("async", 1, True),
        pytest.param("async", 1, False, marks=pytest.mark.slow),
    ],
)
async def test_mode_invariants(
    mode: str, alpha: int, on_arrival: bool, tmp_path: Path, tiny_model: Path
) -> None:
    cfg = slice_config(tmp_path, model_path=tiny_model, steps=3)
    cfg.loop.mode, cfg.loop.alpha = mode, alpha  # type: ignore[assignment]
    cfg.loop.update_on_arrival = on_arrival
    sink = _Collect()
    async with Pipeline(cfg) as p:  # built here to read the proxy's tables once every trajectory ended
        summary = await train(cfg, sink=sink, pipeline=p)
        # the proxy's per-session tables hold nothing once the run stopped (finished, aborted and
        # cancelled trajectories alike ended their sessions): they do not grow with the run's length
        assert p.proxy.session_counts() == {"sessions": 0, "sessions_in_flight": 0, "requests_in_flight": 0}
    hist = summary["history"]
    assert summary["final_version"] == 3 and [h["version"] for h in hist] == [1, 2, 3]
    # async swaps new weights in as soon as they land, so the engines serve the last version when
    # train() returns; at the next Get Batch instead, the last push is never swapped in by the loop
    assert summary["served_version"] == (3 if on_arrival else 2)
    # every launched trajectory is accounted for by exactly one fate; without redundancy none is
    # "cancelled_redundant" (those still in flight at the end are "cancelled_at_stop")
    assert sum(summary["fates"].values()) == summary["launched"] > 0
    assert cfg.tasks[0].redundancy == 0 and "cancelled_redundant" not in summary["fates"]
    # no trajectory is trained with a policy lag above alpha, and training saw off-policy data
    assert all(h["lag_max"] <= alpha for h in hist)
    assert max(h["lag_max"] for h in hist) >= 1
    # rollout overlapped training: trajectories were in flight while the trainer ran
    assert any(h["inflight_at_train"] > 0 for h in hist)
    assert all(h["batch_size"] > 0 for h in hist)


@pytest.mark.slow  # EnvManager redundancy itself is tested in test_env_manager (seconds); this is its wiring
async def test_env_manager_and_redundancy_in_the_loop(tmp_path: Path, tiny_model: Path) -> None:
    """Environments in Ray actors (EnvManager) with redundant rollouts, driven by the loop."""
    from rollart_core.config import EnvManagerSection

    cfg = slice_config(tmp_path, model_path=tiny_model, steps=2)
    cfg.env_manager = EnvManagerSection(num_envs=8, options={"pool": None, "envs_per_actor": 8})
    cfg.tasks[0].redundancy = 2
    summary = await train(cfg, sink=_Collect())
    task = cfg.tasks[0]
    assert summary["final_version"] == 2
    assert sum(summary["fates"].values()) == summary["launched"]
    assert summary["launched"] >= 2 * task.groups_per_step * (task.group_size + 2)
    assert summary["fates"].get("cancelled_redundant", 0) > 0
    assert all(h["batch_size"] <= task.groups_per_step * task.group_size for h in summary["history"])


@pytest.mark.slow  # ~95 s; CI keeps the fake-based resume tests (packages/rollart-core/tests/test_checkpoint.py)
async def test_resume_continues_steps_and_buffer_without_duplicates(tmp_path: Path, tiny_model: Path) -> None:
    """An async run saves at step 2 with groups still pending; a new run resumes from that
    checkpoint: versions and steps continue, the saved groups are trained, nothing twice."""
    import json

    cfg = slice_config(tmp_path, model_path=tiny_model, steps=2)
    cfg.loop.mode, cfg.loop.alpha, cfg.loop.save_every = "async", 2, 2  # type: ignore[assignment]
    cfg.loop.max_pending_steps = 3
    first = await train(cfg, sink=_Collect())
    ckpt = cfg.output_dir / "checkpoint-2"
    state = json.loads((ckpt / "rollart_state.json").read_text())
    assert first["final_version"] == 2 and state["step"] == 2 and state["version"] == 2
    saved_groups = {g["group_id"] for g in state["buffer"]["groups"]}

    cfg2 = cfg.model_copy(deep=True)
    cfg2.loop.steps, cfg2.loop.resume_from = 4, ckpt
    second = await train(cfg2, sink=_Collect())  # a fresh pipeline, as a restarted job would build
    assert [h["version"] for h in second["history"]] == [3, 4]  # steps and versions continue
    trained_1 = [g for h in first["history"] for g in h["batch_groups"]]
    trained_2 = [g for h in second["history"] for g in h["batch_groups"]]
    assert len(set(trained_1 + trained_2)) == len(trained_1) + len(trained_2)  # no group trained twice
    assert saved_groups <= set(trained_2) | set(second["dropped_groups"])  # restored content was used
    assert set(trained_1).isdisjoint(saved_groups)


@pytest.mark.slow  # ~55 s; the spawned trainer's own tests run in CI (rollart-train test_torch_fsdp)
async def test_async_loop_with_a_spawned_trainer_cancels_cleanly(tmp_path: Path, tiny_model: Path) -> None:
    """Async mode with the trainer in its own process on one thread (the CPU split), cancelled right
    after a step (its weight push just started), as a time-boxed job is: the cancellation propagates,
    the push and the producer running beside the loop are stopped before the engines go (no "exception
    was never retrieved"), and the trainer's process exits with the pipeline."""
    import asyncio
    import gc
    import multiprocessing
    import os

    cfg = slice_config(tmp_path, model_path=tiny_model, steps=1000)
    cfg.loop.mode, cfg.loop.alpha = "async", 1  # type: ignore[assignment]
    cfg.trainer.options.update(spawn=True, num_threads=1)
    loop = asyncio.get_running_loop()
    unhandled: list[dict] = []
    old_handler = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, ctx: unhandled.append(ctx))
    rank_pids: list[int] = []
    task: asyncio.Task | None = None

    class _CancelAtStep2(_Collect):
        def log(self, step: int, metrics: dict) -> None:
            super().log(step, metrics)
            if step == 2 and task is not None:
                rank_pids.extend(
                    c.pid
                    for c in multiprocessing.active_children()
                    if c.name.startswith("rollart-train-rank")
                )
                task.cancel()

    sink = _CancelAtStep2()
    try:
        task = asyncio.create_task(train(cfg, sink=sink))
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 300)
        gc.collect()
        await asyncio.sleep(0.5)  # let any orphaned callback run and report
    finally:
        loop.set_exception_handler(old_handler)
    assert [m["version"] for _, m in sink.rows] == [1, 2]
    assert not unhandled, unhandled
    assert len(rank_pids) == 1 and rank_pids[0] != os.getpid()
    with pytest.raises(ProcessLookupError):
        os.kill(rank_pids[0], 0)
