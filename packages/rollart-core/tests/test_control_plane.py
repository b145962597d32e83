"""The control plane's logic on in-process fakes (tests/control_fakes.py): the order of the
protocol's steps per mode, admission within alpha, the stale abort, the version clock, fates counted
once, and runs that stop with an error instead of waiting. Real engines: integration/tests."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import ModuleType

import pytest

from rollart_core.control.clock import ClockError, VersionClock
from rollart_core.control.steps import RunStalled
from rollart_core.control.train import train
from rollart_core.errors import RollartError
from rollart_core.metrics import MemorySink


async def _train(
    fakes: ModuleType, tmp: Path, script: object = None, **kw: object
) -> tuple[dict, object, object]:
    script = script or fakes.Script()
    cfg = fakes.fake_config(tmp, **kw)
    p = fakes.FakePipeline(cfg, script)
    summary = await asyncio.wait_for(train(cfg, sink=MemorySink(), pipeline=p), 30)  # type: ignore[arg-type]
    return summary, script, p


def _steps(log: list[tuple]) -> list[tuple]:
    return [e for e in log if e[0] in ("train_step", "push", "prefetch_weights", "update_weights")]


async def test_sync_trains_pushes_and_updates_in_order_on_policy(fakes: ModuleType, tmp_path: Path) -> None:
    summary, s, _ = await _train(fakes, tmp_path, mode="sync")
    names = [e[:2] for e in _steps(s.log)]
    assert names == [
        (n, v) for v in (1, 2, 3) for n in ("train_step", "push", "prefetch_weights", "update_weights")
    ]
    # each batch was generated entirely by the version trained just before: on-policy
    assert [e[2] for e in s.log if e[0] == "train_step"] == [[0], [1], [2]]
    assert summary["final_version"] == summary["served_version"] == 3


async def test_one_off_trains_on_the_batch_launched_a_step_earlier(fakes: ModuleType, tmp_path: Path) -> None:
    summary, _s, p = await _train(fakes, tmp_path, mode="one_off", alpha=1)
    launched = [sorted({t.start_version for t in p.trainer.batches[k]}) for k in range(3)]
    assert launched == [[0], [0], [1]]  # each batch after the first was launched before the previous update
    assert summary["steps"] == 3


@pytest.mark.parametrize("on_arrival", [True, False])
async def test_async_updates_before_the_next_train_and_stays_within_alpha(
    fakes: ModuleType, tmp_path: Path, on_arrival: bool
) -> None:
    summary, s, _p = await _train(
        fakes, tmp_path, mode="async", alpha=1, steps=4, update_on_arrival=on_arrival
    )
    log = _steps(s.log)
    for v in (1, 2, 3):  # version v is pushed, staged and swapped in before the step that trains v+1
        i_push, i_update = log.index(("push", v)), log.index(("update_weights", v))
        i_next = next(i for i, e in enumerate(log) if e[0] == "train_step" and e[1] == v + 1)
        assert i_push < log.index(("prefetch_weights", v)) < i_update < i_next
    for e in (e for e in s.log if e[0] == "train_step"):
        assert all(e[1] - 1 - v <= 1 for v in e[2])  # trained at version e[1]-1 within alpha
    assert summary["steps"] == 4 and summary["final_version"] == 4


async def test_async_synchronous_ablation_updates_right_after_each_push(
    fakes: ModuleType, tmp_path: Path
) -> None:
    _, s, _ = await _train(fakes, tmp_path, mode="async", alpha=1, async_weight_sync=False)
    log = _steps(s.log)
    for v in (1, 2, 3):
        i = log.index(("push", v))
        assert log[i + 1 : i + 3] == [("prefetch_weights", v), ("update_weights", v)]


async def test_stale_abort_fires_on_a_hung_trajectory(fakes: ModuleType, tmp_path: Path) -> None:
    # the first group's seed hangs in its env: its members can only end by the stale abort
    script = fakes.Script()
    cfg = fakes.fake_config(tmp_path, mode="async", alpha=1, steps=4)
    from rollart_core.control.rollout import derive_seed

    script.hang_seeds = {derive_seed(cfg.seed, "g", 0, 0)}
    p = fakes.FakePipeline(cfg, script)
    summary = await asyncio.wait_for(train(cfg, sink=MemorySink(), pipeline=p), 30)  # type: ignore[arg-type]
    assert summary["fates"].get("aborted_stale", 0) >= 2
    assert sum(h["aborted"] for h in summary["history"]) >= 2
    assert not any(tid.startswith("g0-") for tid in p.trainer.trained_ids)
    assert p.proxy.sessions == set()  # the aborted ones ended their proxy sessions too


@pytest.mark.parametrize("mode,alpha", [("sync", 0), ("one_off", 1), ("async", 1), ("async", 2)])
async def test_every_launched_trajectory_has_one_fate(
    fakes: ModuleType, tmp_path: Path, mode: str, alpha: int
) -> None:
    summary, _, p = await _train(fakes, tmp_path, mode=mode, alpha=alpha, steps=4, abort_stale=False)
    assert summary["launched"] == sum(summary["fates"].values())
    assert len(p.trainer.trained_ids) == len(set(p.trainer.trained_ids))  # nothing trained twice
    trained = sum(h["batch_size"] for h in summary["history"])
    assert trained == len(p.trainer.trained_ids)
    assert summary["fates"]["finished"] >= trained
    assert p.proxy.sessions == set()  # every trajectory ended its proxy session, cancelled ones too


async def test_stale_relabel_at_the_buffer_is_counted_once(fakes: ModuleType, tmp_path: Path) -> None:
    # without the stale abort, the first group's episodes finish only once the trainer is at version 3
    from rollart_core.control.rollout import derive_seed

    script = fakes.Script(gate_seeds={derive_seed(0, "g", 0, 0): 3})
    summary, _, p = await _train(fakes, tmp_path, script, mode="async", alpha=1, steps=6, abort_stale=False)
    assert "g0-t" in p.buffer.dropped_groups
    assert p.buffer.fates["aborted_stale"] > 0
    assert summary["fates"]["aborted_stale"] == p.buffer.fates["aborted_stale"]
    assert summary["launched"] == sum(summary["fates"].values())


async def test_sync_relaunches_a_group_whose_members_all_failed(fakes: ModuleType, tmp_path: Path) -> None:
    script = fakes.Script(fail_resets=2)  # the whole first group (group_size 2) fails
    summary, _, _ = await _train(fakes, tmp_path, script, mode="sync", steps=2)
    assert summary["steps"] == 2 and summary["relaunched_groups"] == 1
    assert summary["fates"]["env_failed"] == 2


async def test_sync_stops_naming_the_stage_when_the_relaunch_budget_is_spent(
    fakes: ModuleType, tmp_path: Path
) -> None:
    with pytest.raises(RunStalled, match=r"env: group .* relaunch budget"):
        await _train(
            fakes, tmp_path, fakes.Script(fail_resets=10**6), mode="sync", steps=2, max_group_relaunches=3
        )


async def test_async_stops_when_every_engine_is_down(fakes: ModuleType, tmp_path: Path) -> None:
    with pytest.raises(RunStalled, match=r"engine: 100% of the last 64 trajectories failed"):
        await _train(fakes, tmp_path, fakes.Script(engine_down=True), mode="async", alpha=1)


async def test_stall_timeout_stops_a_run_whose_envs_hang(fakes: ModuleType, tmp_path: Path) -> None:
    with pytest.raises(RunStalled, match=r"no trajectory finished for .*stall_timeout_s = 0.5"):
        await _train(fakes, tmp_path, fakes.Script(hang_all=True), mode="sync", stall_timeout_s=0.5)


async def test_failed_push_stops_the_loop_while_it_waits(fakes: ModuleType, tmp_path: Path) -> None:
    # alpha 0, update on arrival: groups admitted on version 2 wait for it forever unless the failure raises
    with pytest.raises(RollartError, match=r"weight push of version 2 failed .*refused version 2"):
        await _train(fakes, tmp_path, fakes.Script(fail_push_at=2), mode="async", alpha=0, steps=5)


async def test_async_alpha_zero_is_on_policy(fakes: ModuleType, tmp_path: Path) -> None:
    summary, s, _ = await _train(fakes, tmp_path, mode="async", alpha=0, steps=3)
    assert [e[2] for e in s.log if e[0] == "train_step"] == [[0], [1], [2]]
    assert summary["fates"].get("aborted_stale", 0) == 0


def test_version_clock_invariants() -> None:
    c = VersionClock()
    with pytest.raises(ClockError):
        c.serve(1)  # not trained yet
    c.trained_to(1)
    c.expect(2)  # the version the current batch will train
    assert c.start_versions() == [0, 2]
    with pytest.raises(ClockError):
        c.expect(3)
    c.serve(1)
    assert c.coming == 2 and c.start_versions() == [1, 2]
    c.batch_taken()
    assert c.next_batch_version() == 2
    with pytest.raises(ClockError):
        c.trained_to(1)  # backwards
    c.trained_to(2)
    c.serve(2)
    assert c.coming is None
    with pytest.raises(ClockError):
        c.serve(1)
