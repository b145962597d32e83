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
from rollart_core.errors import ConfigError, RollartError
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
    summary, _, _ = await _train(fakes, tmp_path, script, mode="async", alpha=1, steps=6, abort_stale=False)
    assert "g0-t" in summary["dropped_groups"]
    assert summary["fates"]["aborted_stale"] > 0
    assert summary["stale_tokens"] > 0
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


async def test_a_push_that_hangs_stops_the_run_naming_the_version_and_the_store(
    fakes: ModuleType, tmp_path: Path
) -> None:
    with pytest.raises(
        RollartError,
        match=r"weight push of version 2: writing it to the weight store .*weight_push_timeout_s=0.3",
    ):
        await _train(
            fakes, tmp_path, fakes.Script(hang_push_at=2), mode="async", steps=5, weight_push_timeout_s=0.3
        )


@pytest.mark.parametrize("mode", ["sync", "async"])
async def test_waiting_for_a_batch_looks_again_only_when_the_run_state_changed(
    fakes: ModuleType, tmp_path: Path, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wait for a batch is woken by changes of the run's state, never by a timer or by something
    that already finished (a finished push once turned it into a busy loop that took a core from the
    engines and the trainer for the whole rollout)."""
    from rollart_core.control import steps
    from rollart_core.control.state import RunState

    turns = wakes = 0
    check, wake = steps._check_progress, RunState._wake

    def counting_check(run: object) -> None:
        nonlocal turns
        turns += 1
        check(run)  # type: ignore[arg-type]

    def counting_wake(state: RunState) -> None:
        nonlocal wakes
        wakes += 1
        wake(state)

    monkeypatch.setattr(steps, "_check_progress", counting_check)
    monkeypatch.setattr(RunState, "_wake", counting_wake)
    summary, _, _ = await _train(fakes, tmp_path, fakes.Script(step_delay_s=0.05), mode=mode, steps=4)
    assert summary["steps"] == 4
    # one look per change at most, plus the first look of each step's wait
    assert 0 < turns <= wakes + 4, (turns, wakes)


async def test_async_alpha_zero_is_on_policy(fakes: ModuleType, tmp_path: Path) -> None:
    summary, s, _ = await _train(fakes, tmp_path, mode="async", alpha=0, steps=3)
    assert [e[2] for e in s.log if e[0] == "train_step"] == [[0], [1], [2]]
    assert summary["fates"].get("aborted_stale", 0) == 0


async def test_step_metrics_count_agent_calls_segments_and_rewrites(
    fakes: ModuleType, tmp_path: Path
) -> None:
    # every other agent episode rewrites its history: each step's row sums its own trajectories'
    summary, s, _ = await _train(fakes, tmp_path, fakes.Script(agent=True), mode="sync", steps=3)
    episodes = {e[1]: e[2:] for e in s.log if e[0] == "agent"}
    assert sum(r for _, r in episodes.values()) >= 3  # the run did rewrite
    for h in summary["history"]:
        mine = [episodes[tid] for tid in h["batch_traj_ids"]]
        assert h["agent_episodes"] == len(mine) == h["batch_size"]
        assert h["agent_calls"] == sum(c for c, _ in mine)
        assert h["agent_rewrites"] == sum(r for _, r in mine)
        assert h["agent_segments"] == len(mine) + h["agent_rewrites"]
    # a run without agent tasks has no agent keys
    plain, _, _ = await _train(fakes, tmp_path / "plain", mode="sync", steps=1)
    assert not any(k.startswith("agent_") for k in plain["history"][0])


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize(
    "script,words",
    [
        ({"config_error_after": 5}, r"building the environment: dataset data.jsonl, line 3: no key 'answer'"),
        ({"config_error_in_reset": True}, r"running an episode: fake endpoint: model dir has no tokenizer"),
    ],
)
async def test_a_config_error_mid_run_stops_the_run_naming_the_stage(
    fakes: ModuleType, tmp_path: Path, mode: str, script: dict, words: str
) -> None:
    # not counted as env_failed episode after episode until a relaunch budget or a stall says so
    with pytest.raises(ConfigError, match=rf"^env: task 't', {words}"):
        await _train(fakes, tmp_path, fakes.Script(**script), mode=mode, alpha=1, steps=3)


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


async def test_two_tasks_report_train_and_held_out_success_per_task(
    fakes: ModuleType, tmp_path: Path
) -> None:
    task = {"env": {"impl": "fake"}, "reward": {"impl": "fake"}, "group_size": 2, "groups_per_step": 1}
    tasks = [{"name": "a", **task}, {"name": "b", **task}]
    sink = MemorySink()
    cfg = fakes.fake_config(tmp_path, tasks=tasks, mode="sync", eval_every=1, eval_episodes=2, steps=2)
    script = fakes.Script()
    await asyncio.wait_for(train(cfg, sink=sink, pipeline=fakes.FakePipeline(cfg, script)), 30)
    rows = sink.rows
    assert all(set(m["eval_success_by_task"]) == {"a", "b"} for m in rows)  # eval at 0, 1 and 2
    assert all(set(m["success_by_task"]) == {"a", "b"} for m in rows if "success_by_task" in m)
    assert sum("success_by_task" in m for m in rows) == 2
    # a countdown episode always succeeds; held-out episodes were built as such, 2 per task per eval
    assert rows[-1]["eval_success_by_task"] == {"a": 1.0, "b": 1.0}
    assert sorted(script.envs_made).count(("a", True)) == 3 * 2


async def test_held_out_success_leaves_out_episodes_the_infrastructure_ended(
    fakes: ModuleType, tmp_path: Path
) -> None:
    # the first env reset is the step-0 evaluation's first episode: it fails, its sibling succeeds
    sink = MemorySink()
    cfg = fakes.fake_config(tmp_path, mode="sync", eval_every=1, eval_episodes=2, steps=1)
    await asyncio.wait_for(
        train(cfg, sink=sink, pipeline=fakes.FakePipeline(cfg, fakes.Script(fail_resets=1))), 30
    )
    first = sink.rows[0]
    assert first["eval_failed"] == 1 and first["eval_success"] == 1.0
    assert sink.rows[-1]["eval_failed"] == 0


async def test_an_evaluation_with_no_finished_episode_stops_the_run(
    fakes: ModuleType, tmp_path: Path
) -> None:
    # with every engine down, a held-out success of 0 would be a lie about the policy
    with pytest.raises(RollartError, match=r"held-out evaluation \(eval\): none of its 2 episodes finished"):
        await _train(
            fakes, tmp_path, fakes.Script(engine_down=True), mode="sync", eval_every=1, eval_episodes=2
        )
