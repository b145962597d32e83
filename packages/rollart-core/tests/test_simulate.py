"""The simulator's model of the loop, behaviour by behaviour, on small deterministic workloads:
one-off overlap, staleness-aware admission, admission ahead of an update, redundancy, env timeouts
and failures. Expected figures are worked out by hand in the comments."""

from __future__ import annotations

import pytest

from rollart_core.errors import ConfigError
from rollart_core.plan.simulate import simulate
from rollart_core.plan.workload import LatencyDist, TaskProfile, TrainProfile, WorkloadProfile


def _profile(
    env: LatencyDist, *, train_s: float = 5.0, sync_s: float = 0.2, push_s: float = 0.0, **task: object
) -> WorkloadProfile:
    t = TaskProfile(
        name="t",
        trajectories_per_step=64,
        group_size=8,
        turns=4,
        env_latency_s=env,
        generate_s=LatencyDist(mean=0.5),
        **task,  # type: ignore[arg-type]
    )
    return WorkloadProfile(tasks=[t], train=TrainProfile(train_s=train_s, sync_s=sync_s, push_s=push_s))


CONSTANT = LatencyDist(mean=1.0)  # a trajectory: reset 1 s + 4 × (turn 0.5 s + step 1 s) = 7 s


def test_one_off_overlaps_one_step_and_sits_between_sync_and_async() -> None:
    prof = _profile(CONSTANT, push_s=0.3)
    sync = simulate(prof, mode="sync", steps=6)
    one_off = simulate(prof, mode="one_off", alpha=1, steps=6)
    asyn = simulate(prof, mode="async", alpha=1, steps=6)
    # Sync+: rollout 7 s, then train 5 s, push 0.3 s and update 0.2 s, nothing overlapped
    assert sync.step_times == pytest.approx([12.5] * 6) and sync.traj_per_s == pytest.approx(64 / 12.5)
    # One-off: the next step's rollout (7 s) runs beside train + push + update (5.5 s); the update's
    # suspension falls while every trajectory waits on its env (5.0-5.2 s into the rollout): 7 s a step
    assert one_off.warmup_steps == 1 and one_off.step_times[1:] == pytest.approx([7.0] * 5)
    assert one_off.traj_per_s == pytest.approx(64 / 7.0) and one_off.lag_max == 1
    assert sync.traj_per_s < one_off.traj_per_s < asyn.traj_per_s
    with pytest.raises(ConfigError, match="one_off needs"):
        simulate(prof, mode="one_off", alpha=0)


def test_on_time_admission_never_launches_a_group_that_cannot_be_trained_within_alpha() -> None:
    prof = _profile(CONSTANT)
    for alpha in (1, 2):
        ruled = simulate(prof, mode="async", alpha=alpha, steps=10)
        # every group admitted is trained within alpha: nothing aborted or dropped stale
        assert ruled.aborted == 0 and ruled.stale_groups == 0, ruled
        assert "aborted_stale" not in ruled.fates and ruled.lag_max <= alpha
        assert ruled.trained == 10 * 64
        # the same depth without the rule launches groups on a version that is too old by the time
        # they can be trained: they run, go stale and are thrown away
        naive = simulate(prof, mode="async", alpha=alpha, steps=10, staleness_admission=False)
        assert naive.stale_groups > 0 and naive.fates["aborted_stale"] > 0, naive
        assert naive.traj_per_s <= ruled.traj_per_s


def test_admission_ahead_of_the_update_overlaps_env_work_with_training_even_at_alpha_0() -> None:
    """At alpha 0 a group is on time only on the coming version: with update_on_arrival it is
    launched as soon as the batch is taken, resets its environments while the trainer runs (1 s of
    the 12.2 s Sync+ step), and generates only once the new weights are served."""
    prof = _profile(CONSTANT)
    sync = simulate(prof, mode="sync", steps=6)
    ahead = simulate(prof, mode="async", alpha=0, steps=6)
    assert ahead.lag_max == 0 and ahead.aborted == 0 and ahead.stale_groups == 0
    assert ahead.step_times[1:] == pytest.approx([11.2] * 5)  # 12.2 s − the 1 s reset overlapped
    assert ahead.traj_per_s > sync.traj_per_s
    with pytest.raises(ConfigError, match="update_on_arrival"):
        simulate(prof, mode="async", alpha=0, update_on_arrival=False)
    # alpha 1: without admission ahead the groups of a step wait for the update at the step's start
    on, off = (simulate(prof, mode="async", alpha=1, steps=10, update_on_arrival=u) for u in (True, False))
    assert on.traj_per_s > off.traj_per_s and on.lag_max <= 1 and off.lag_max <= 1


def test_redundancy_shortens_a_heavy_tailed_step_and_cancels_exactly_the_surplus() -> None:
    tail = LatencyDist(mean=1.0, dist="lognormal", sigma=1.5)
    plain = simulate(_profile(tail), mode="sync", steps=8, seed=3)
    hedged = simulate(_profile(tail, redundancy=2), mode="sync", steps=8, seed=3)
    # a Sync+ step waits for the slowest of 64 trajectories; with 2 spares per group of 8 it waits
    # for the 8th of 10 in every group instead
    assert hedged.step_s < 0.8 * plain.step_s, (hedged.step_s, plain.step_s)
    assert hedged.trained == plain.trained == 8 * 64
    # every group launches 10 and cancels the 2 still running once 8 finished
    assert hedged.fates == {"finished": 8 * 64, "cancelled_redundant": 8 * 8 * 2}
    assert hedged.launched == 8 * 8 * 10


def test_env_timeouts_and_failures_end_trajectories_with_their_fates() -> None:
    tail = LatencyDist(mean=1.0, dist="lognormal", sigma=1.5)
    capped = simulate(_profile(tail, env_timeout_s=2.0), mode="sync", steps=6, seed=1)
    # no trajectory outlives 5 env calls at the 2 s timeout + 4 turns of 0.5 s; a Sync+ step is that
    # plus train 5 s and update 0.2 s at most
    assert max(capped.step_times) <= 5 * 2.0 + 4 * 0.5 + 5.2 + 1e-9
    assert capped.fates["timed_out"] > 0
    assert capped.fates["timed_out"] + capped.fates["finished"] == capped.launched
    # half the trajectories fail at their reset; Sync+ trains the rest and relaunches a group only
    # when none of its 8 finished
    failing = simulate(_profile(CONSTANT, fail_prob=0.5, fail_within_calls=1), mode="sync", steps=10)
    assert failing.fates["env_failed"] + failing.fates["finished"] == failing.launched
    assert 0.4 < failing.fates["env_failed"] / failing.launched < 0.6
    assert failing.trained == failing.fates["finished"]


def test_a_workload_where_nothing_can_be_trained_stops_with_an_error() -> None:
    every_call_times_out = _profile(LatencyDist(mean=2.0), env_timeout_s=1.5)
    for mode, alpha in (("sync", 0), ("async", 1)):
        with pytest.raises(RuntimeError, match="stalled"):
            simulate(every_call_times_out, mode=mode, alpha=alpha, steps=3)  # type: ignore[arg-type]


def test_window_fill_is_the_share_of_the_admission_window_kept_full() -> None:
    """alpha 2, train 5 s, push 1 s: a step takes 6 s (training, then the wait for the last push to
    land). The window holds 3 steps of groups (24); when a batch is taken, 8 places free, and the
    groups that may fill them are on time only on the version this batch trains, which admission
    may use once the pushed version has landed: a third of the window stays empty 1 s in every 6."""
    prof = _profile(CONSTANT, train_s=5.0, sync_s=0.0, push_s=1.0)
    r = simulate(prof, mode="async", alpha=2, steps=12)
    assert r.step_times[1:] == pytest.approx([6.0] * 11)
    assert r.window_fill == pytest.approx(1 - (1 / 3) * (1 / 6))
    # nothing to wait for: the window stays full
    full = simulate(_profile(CONSTANT, train_s=5.0, sync_s=0.0), mode="async", alpha=2, steps=12)
    assert full.window_fill == pytest.approx(1.0)
    assert simulate(prof, mode="sync", steps=3).window_fill is None  # no window in Sync+
