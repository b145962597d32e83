"""The bench's bounds and spreads, on hand-made segments: the staleness window's bound (Little's law
over the groups in flight), achieved over min(compute, window), every ratio per round with its
median [min–max], the reward runtime's counters per mode, and the timeline records they come from."""

from __future__ import annotations

import asyncio

import pytest

from rollart_core.bench.figures import aggregate, goals, group_sums, reward_delta, spread, window_bound
from rollart_core.bench.report import fmt_spread, markdown, print_table, reward_lines
from rollart_core.bench.samples import latency_samples, task_of
from rollart_core.control.state import RunState
from rollart_core.timeline import STAGES, Timeline
from rollart_core.types import Fate, Trajectory


def test_window_bound_by_hand() -> None:
    # 2 steps of groups in flight, a batch of 2 calc + 2 lake groups of 4: 8 groups at most, 16
    # trajectories per batch. Groups live 4 s (calc) and 8 s (lake): a batch costs 2·4 + 2·8 = 24
    # group-seconds, so at most 2·4/24 = 1/3 batch per second = 16/3 trajectories/s
    mix, size = {"calc": 2, "lake": 2}, {"calc": 4, "lake": 4}
    assert window_bound(2, mix, size, {"calc": 4.0, "lake": 8.0}) == pytest.approx(16 / 3)
    # one step deeper: a third more in flight, a third more throughput
    assert window_bound(3, mix, size, {"calc": 4.0, "lake": 8.0}) == pytest.approx(8.0)
    # the mix weighs the lifetimes: 3 fast groups per batch and 1 slow one
    assert window_bound(2, {"a": 3, "b": 1}, {"a": 2, "b": 2}, {"a": 1.0, "b": 5.0}) == pytest.approx(
        2 * 4 * 8 / (3 * 1.0 + 1 * 5.0)
    )
    assert window_bound(2, mix, size, {"calc": 4.0}) is None  # lake's lifetime was not measured
    # measured yield: 3 trajectories trained per group taken (a member crashed) scales the bound
    assert window_bound(2, mix, size, {"calc": 4.0, "lake": 8.0}, 3.0) == pytest.approx(16 / 3 * 3 / 4)


def test_spread_and_its_format() -> None:
    sp = spread([2.4, None, 2.0, 2.9])
    assert sp == {"median": 2.4, "min": 2.0, "max": 2.9, "rounds": [2.4, 2.0, 2.9]}
    assert (
        fmt_spread(sp) == "2.40x [2.00–2.90]" and fmt_spread(spread([0.36, 0.4]), pct=True) == "38% [36–40%]"
    )
    assert fmt_spread(spread([1.5])) == "1.50x" and spread([None]) is None and fmt_spread(None) == "-"


def _stages() -> dict:
    return {st: {"utilisation": 0.5, "mean_concurrency": 0.5, "count": 1.0} for st in STAGES}


def _seg(
    rnd: int, wall: float, trained: int, lifetimes: dict[str, float], reward: dict | None = None
) -> dict:
    """A segment with a steady state of ``wall`` s and ``trained`` trajectories; one group per task
    per lifetime given (``groups``: [total s, count])."""
    steady = {
        "wall_s": wall,
        "trained": trained,
        "gen_tokens": 10.0 * trained,
        "episodes": {"calc": [2.0, 1]},
        "step_s": [wall / 2, wall / 2],
        "stages": _stages(),
        "cpu_busy": 0.5,
        "groups": {t: [v * 2, 2] for t, v in lifetimes.items()},
        "groups_rollout": {t: [v, 2] for t, v in lifetimes.items()},
    }
    seg = {
        **steady,
        "round": rnd,
        "steps": 3,
        "wall_s": wall + 1.0,
        "trained_by_task": {"calc": trained // 2, "lake": trained - trained // 2},
        "trained_gen_tokens": 6.0 * trained,
        "wasted_gen_tokens": 4.0 * trained,
        "launched": trained,
        "fates": {"finished": trained},
        "lag_max": 1,
        "steady": steady,
    }
    if reward is not None:
        seg["reward"] = reward
    return seg


WINDOW = {"depth": 2, "mix": {"calc": 2, "lake": 2}, "group_size": {"calc": 4, "lake": 4}}


def _results() -> dict:
    life = {"calc": 4.0, "lake": 8.0}  # window bound 16/3 ≈ 5.33 traj/s (test above)
    rt = {
        "runtime_busy_s": 3.0,
        "runtime_provisioned_s": 12.0,
        "runtime_cold_starts": 2.0,
        "runtime_calls": 30.0,
    }
    segments = {
        "sync": [_seg(0, 10.0, 16, {}), _seg(1, 8.0, 16, {})],  # 1.6 and 2.0 traj/s
        "one_off": [_seg(0, 8.0, 16, {}), _seg(1, 8.0, 16, {})],  # 2.0 and 2.0
        "async_a1": [_seg(0, 4.0, 16, life, rt), _seg(1, 3.2, 16, life, rt)],  # 4.0 and 5.0
        "abl_inline_standin": [_seg(0, 3.2, 16, life), _seg(1, 3.2, 16, life)],  # 5.0 and 5.0
    }
    compute = {"bound": 10.0, "bottleneck": "generate+train"}
    idle = {"lifetime_s": life, "trained_per_group": {"calc": 4.0, "lake": 4.0}}
    bounds = {
        "sync": compute,
        "one_off": compute,
        "async_a1": {**compute, "window": WINDOW, "idle": idle},
        "abl_inline_standin": {**compute, "window": WINDOW, "idle": idle},
    }
    return {"segments": segments, "bounds": bounds, "results": aggregate(segments, bounds)}


def test_window_bounds_count_what_the_groups_trained() -> None:
    # 4 groups of 4 taken in the window, 12 trajectories trained: a member of each crashed, its place
    # in the window held all the same. Under load the groups lived 2 s (calc) and 4 s (lake) from
    # launch to their last fate (and twice that until taken); alone, 4 s and 8 s, training 3.5 and 3.
    seg = _seg(0, 4.0, 12, {"calc": 4.0, "lake": 8.0})
    idle = {"lifetime_s": {"calc": 4.0, "lake": 8.0}, "trained_per_group": {"calc": 3.5, "lake": 3.0}}
    bounds = {"async_a1": {"bound": 10.0, "bottleneck": "generate+train", "window": WINDOW, "idle": idle}}
    r = aggregate({"async_a1": [seg]}, bounds)["async_a1"]
    assert r["trained_per_group"] == 3.0
    # alone: 2 steps x 4 groups / (2·4 + 2·8 group-seconds) = 1/3 batch/s, of 2·3.5 + 2·3 trajectories
    assert r["window_bound_traj_per_s"] == pytest.approx(13 / 3)
    # under load: 8 / (2·2 + 2·4) = 2/3 batch/s of 4 groups x 3 trained; until taken: half that
    assert r["window_bound_load_traj_per_s"] == pytest.approx(8.0)
    assert r["window_bound_taken_traj_per_s"] == pytest.approx(4.0)
    assert r["min_bound_by"] == "window" and r["achieved_over_min_bound"] == pytest.approx(3.0 / (13 / 3))
    assert r["achieved_over_window_load"] == pytest.approx(3.0 / 8.0)
    assert r["rounds"]["of_min_bound"]["rounds"] == pytest.approx([3.0 / (13 / 3)])


def test_achieved_over_min_of_compute_and_window_bound_with_spread_over_rounds() -> None:
    res = _results()
    r, sync = res["results"]["async_a1"], res["results"]["sync"]
    assert r["traj_per_s"] == pytest.approx(32 / 7.2)  # over both rounds' steady states
    assert r["group_lifetime_s"] == {"calc": 4.0, "lake": 8.0} and r["group_rollout_s"]["lake"] == 4.0
    assert r["window_bound_traj_per_s"] == pytest.approx(16 / 3) and r["min_bound_by"] == "window"
    assert r["achieved_over_min_bound"] == pytest.approx((32 / 7.2) / (16 / 3))
    assert r["achieved_over_bound"] == pytest.approx((32 / 7.2) / 10.0)
    # sync: no window (not async), its min bound is the compute bound
    assert sync["window_bound_traj_per_s"] is None and sync["min_bound_traj_per_s"] == 10.0
    # per round: 4.0/1.6 = 2.5 and 5.0/2.0 = 2.5 vs Sync+; 2.0 and 2.5 vs One-off
    rounds = r["rounds"]
    assert rounds["vs_sync"]["rounds"] == pytest.approx([2.5, 2.5])
    assert rounds["vs_one_off"] == {"median": 2.25, "min": 2.0, "max": 2.5, "rounds": [2.0, 2.5]}
    assert rounds["of_min_bound"]["rounds"] == pytest.approx([4.0 / (16 / 3), 5.0 / (16 / 3)])
    assert rounds["traj_per_s"]["rounds"] == pytest.approx([4.0, 5.0])
    assert sync["rounds"]["vs_sync"]["rounds"] == [1.0, 1.0]
    g = goals(res["results"])["async_a1"]
    assert (
        g["of_bound"]["ratio"] == pytest.approx(r["achieved_over_min_bound"])
        and g["of_bound"]["met"] is False
    )
    assert g["of_compute_bound"]["ratio"] == pytest.approx(r["achieved_over_bound"])
    assert g["vs_one_off"]["rounds"]["min"] == 2.0 and "vs_admission" not in g


def test_reward_runtime_counters_per_mode_and_the_elastic_vs_stand_in_line() -> None:
    before = {
        "runtime_busy_s": 1.0,
        "runtime_provisioned_s": 2.0,
        "runtime_cold_starts": 1,
        "runtime_workers": 3,
    }
    after = {
        "runtime_busy_s": 4.0,
        "runtime_provisioned_s": 14.0,
        "runtime_cold_starts": 3,
        "runtime_workers": 1,
    }
    assert reward_delta(before, after) == {
        "runtime_busy_s": 3.0,
        "runtime_provisioned_s": 12.0,
        "runtime_cold_starts": 2.0,
        "runtime_workers": 1.0,
    }
    res = _results()
    rw = res["results"]["async_a1"]["reward"]
    # two segments of 3 busy s in 12 provisioned s each, 2 cold starts each
    assert rw["runtime_utilisation"] == pytest.approx(0.25) and rw["runtime_cold_starts"] == 4.0
    assert res["results"]["sync"]["reward"] is None
    lines = reward_lines(res)
    assert any("utilisation 25%" in x and "4 cold starts" in x for x in lines), lines
    versus = [x for x in lines if "in-process stand-in" in x]
    # async α=1 at 32/7.2 traj/s against the stand-in at 32/6.4: 0.89x; per round 0.8 and 1.0
    assert len(versus) == 1 and "0.89x" in versus[0] and "0.80–1.00" in versus[0], versus


def test_printed_table_and_summary_carry_the_new_columns(tmp_path) -> None:
    res = _results()
    res.update(
        size_name="quick",
        size={"rounds": 2, "steps": 2, "warmup": True},
        machine={
            "cpus_usable": 2,
            "memory_gib": 24,
            "loadavg_start": (1.0, 1.0, 1.0),
            "loadavg_end": (2.0, 2.0, 2.0),
        },
        capacity={
            "generate": {"traj_per_s": 20.0, "gen_tok_per_s": 100.0, "prompt_tok_per_s": 1000.0},
            "train": {"traj_per_s": 20.0, "tok_per_s": 1000.0},
            "env": {"concurrency": 8, "traj_per_s": 30.0, "calls_per_s": 90.0},
        },
        goals=goals(res["results"]),
        mode_configs={
            m: {"mode": "async" if m != "sync" and m != "one_off" else m, "alpha": 1} for m in res["results"]
        },
        wall_s=100.0,
    )
    table = print_table(res)
    for text in (
        "window bound (idle) traj/s",
        "window bound (load) traj/s",
        "CPU-charged bound traj/s",
        "of tightest",
        "held against the tightest, window",
        "vs One-off",
        "2.50x",
        "25% busy, 4 cold",
        "Little's law",
    ):
        assert text in table, text
    assert "[rounds 2.00–2.50, median 2.25]" in table  # the goal line vs One-off
    assert "median [min–max] over rounds" in markdown(res)


def test_the_buffer_records_each_groups_life_on_the_timeline() -> None:
    async def scenario() -> Timeline:
        state = RunState(alpha=1)
        with Timeline() as tl:
            state.announce("g0-calc", 2, "calc")
            state.announce("g1-lake", 1, "lake")
            for i, (g, task) in enumerate([("g0-calc", "calc"), ("g0-calc", "calc"), ("g1-lake", "lake")]):
                t = Trajectory(f"{g}-{i}", task, "e", g, 0, 0)
                t.fate = Fate.FINISHED
                state.settle(t)
            batch = await state.get_batch(2, {"calc": 1, "lake": 1}, version=0)
        assert len(batch) == 3
        return tl

    tl = asyncio.run(scenario())
    groups = [(st, lane) for st, _, _, lane in tl.intervals]
    assert sorted(groups) == [
        ("group", "calc"),
        ("group", "lake"),
        ("group_rollout", "calc"),
        ("group_rollout", "lake"),
    ]
    by = {(st, lane): (s, e) for st, s, e, lane in tl.intervals}
    for task in ("calc", "lake"):  # launched → last fate → taken
        assert by[("group", task)][0] == by[("group_rollout", task)][0]
        assert by[("group_rollout", task)][1] <= by[("group", task)][1]
    sums = group_sums(tl.intervals, "group", (float("-inf"), float("inf")))
    assert set(sums) == {"calc", "lake"} and all(n == 1 for _, n in sums.values())


def test_latency_samples_per_task_from_the_runners_lanes() -> None:
    assert task_of("g12-calc-3") == "calc" and task_of("r0-lake-0") == "lake"
    assert task_of("cal-1") is None and task_of("") is None
    ivs = [
        ("train", 10.0, 20.0, ""),
        ("env", 0.0, 1.0, "g0-calc-0"),
        ("generate", 1.0, 1.5, "g0-calc-0"),  # ended before training: alone
        ("generate", 12.0, 14.0, "g0-calc-0"),  # ended while training ran
        ("reward", 14.0, 14.2, "g0-calc-0"),
        ("generate", 2.0, 2.25, "g1-lake-1"),  # never scored: no turns sample
        ("group", 0.0, 15.0, "calc"),
    ]
    s = latency_samples(ivs)
    assert s["calc"]["generate"] == [0.5, 2.0] and s["calc"]["env"] == [1.0]
    assert s["calc"]["reward"] == [pytest.approx(0.2)] and s["calc"]["turns"] == [2]
    assert s["calc"]["generate_alone"] == [0.5] and s["calc"]["generate_beside_train"] == [2.0]
    assert s["lake"]["generate"] == [0.25] and s["lake"]["turns"] == []
