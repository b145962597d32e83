"""Timeline, utilisation, bound and aggregation arithmetic of ``rollart bench``, on hand-made intervals."""

from __future__ import annotations

import pytest

from rollart_core.bench.figures import aggregate, goals
from rollart_core.bench.workload import SIZES
from rollart_core.timeline import (
    STAGES,
    Timeline,
    bottleneck_bound,
    mean_concurrency,
    merge,
    record,
    union_length,
    utilisation,
)


def test_merge_and_union_count_overlaps_once() -> None:
    iv = [(5.0, 6.0), (0.0, 2.0), (1.0, 3.0), (3.0, 4.0), (8.0, 8.0)]
    assert merge(iv) == [(0.0, 4.0), (5.0, 6.0)]  # touching spans join, empty ones vanish
    assert union_length(iv, (0.0, 10.0)) == pytest.approx(5.0)
    assert union_length(iv, (1.5, 5.5)) == pytest.approx(3.0)  # clipped to the window
    assert union_length([], (0.0, 1.0)) == 0.0


def test_utilisation_and_concurrency() -> None:
    # two requests overlapping for 1 s inside a 4 s window: busy 3 s, 4 request-seconds
    iv = [(0.0, 2.0), (1.0, 3.0)]
    assert utilisation(iv, (0.0, 4.0)) == pytest.approx(0.75)
    assert mean_concurrency(iv, (0.0, 4.0)) == pytest.approx(1.0)
    assert utilisation(iv * 5, (0.0, 2.0)) == pytest.approx(1.0)  # never above 1
    with pytest.raises(ValueError):
        utilisation(iv, (1.0, 1.0))
    with pytest.raises(ValueError):
        union_length([(2.0, 1.0)], (0.0, 4.0))


def test_bottleneck_bound_min_and_shared_cores() -> None:
    b = bottleneck_bound({"generate": 10.0, "train": 10.0, "env": 8.0, "reward": 100.0})
    assert b["bound"] == 8.0 and b["bottleneck"] == "env"
    # generation and training on the same cores: one trajectory costs 1/10 + 1/10 s
    b = bottleneck_bound(
        {"generate": 10.0, "train": 10.0, "env": 8.0, "reward": 100.0}, shared=("generate", "train")
    )
    assert b["bound"] == pytest.approx(5.0) and b["bottleneck"] == "generate+train"
    with pytest.raises(ValueError):
        bottleneck_bound({"generate": 0.0})


def test_timeline_records_only_while_active() -> None:
    record("train", 0.0, 1.0)  # nobody listening: dropped
    with Timeline() as tl:
        record("train", 1.0, 2.0)
        record("generate", 0.0, 4.0, "t0")
    record("train", 5.0, 6.0)
    assert tl.of("train") == [(1.0, 2.0)] and tl.of("generate") == [(0.0, 4.0)]
    s = tl.summary((0.0, 4.0))
    assert set(s) == set(STAGES)
    assert s["train"]["utilisation"] == pytest.approx(0.25) and s["generate"]["utilisation"] == 1.0
    assert s["env"] == {"utilisation": 0.0, "mean_concurrency": 0.0, "count": 0.0}


def _seg(wall: float, trained: int, util: float, fates: dict[str, int]) -> dict:
    stages = {st: {"utilisation": util, "mean_concurrency": util, "count": 1.0} for st in STAGES}
    return {
        "wall_s": wall,
        "steps": 2,
        "trained": trained,
        "trained_by_task": {"t": trained},
        "gen_tokens": 10.0 * trained,
        "trained_gen_tokens": 6.0 * trained,
        "wasted_gen_tokens": 4.0 * trained,
        "launched": sum(fates.values()),
        "episodes": {"t": [3.0 * trained, trained]},
        "fates": fates,
        "step_s": [wall / 2, wall / 2],
        "lag_max": 1,
        "stages": stages,
        "cpu_busy": util,
    }


def test_aggregate_ratios_bound_and_wall_weighted_utilisation() -> None:
    segments = {
        "sync": [
            _seg(10.0, 20, 0.5, {"finished": 20, "env_failed": 2}),
            _seg(30.0, 20, 0.1, {"finished": 20}),
        ],
        "async_a1": [_seg(10.0, 40, 0.9, {"finished": 40, "aborted_stale": 3})],
    }
    bounds = {
        "sync": {"bound": 5.0, "bottleneck": "generate+train"},
        "async_a1": {"bound": 5.0, "bottleneck": "generate+train"},
    }
    r = aggregate(segments, bounds)
    assert r["sync"]["traj_per_s"] == pytest.approx(1.0)  # 40 trajectories in 40 s
    assert r["async_a1"]["traj_per_s"] == pytest.approx(4.0)
    assert r["async_a1"]["vs_sync"] == pytest.approx(4.0) and r["sync"]["vs_sync"] == 1.0
    assert r["async_a1"]["achieved_over_bound"] == pytest.approx(0.8)
    assert r["sync"]["utilisation"]["train"] == pytest.approx((0.5 * 10 + 0.1 * 30) / 40)
    assert r["sync"]["cpu_busy"] == pytest.approx((0.5 * 10 + 0.1 * 30) / 40)
    assert r["sync"]["fates"] == {"finished": 40, "env_failed": 2} and r["sync"]["launched"] == 42
    assert r["sync"]["trained_by_task"] == {"t": 40}
    assert r["sync"]["gen_waste"] == pytest.approx(0.4)  # 4 of every 10 generated tokens wasted
    assert r["sync"]["episode_s"] == {"t": pytest.approx(3.0)}
    assert r["sync"]["measured_step_s_mean"] == pytest.approx(10.0)  # steps of 5 s and 15 s
    g = goals(r)["async_a1"]
    assert {k: g["vs_sync"][k] for k in ("ratio", "goal", "met")} == {
        "ratio": pytest.approx(4.0),
        "goal": 4.6,
        "met": False,
    }
    assert g["of_bound"]["met"] is False and "vs_one_off" not in g
    # a mode with env replicas is also compared with Sync+ given the same replicas
    r["sync_r3"], r["async_a2_r3"] = {**r["sync"], "traj_per_s": 2.0}, {**r["async_a1"], "traj_per_s": 10.0}
    g = goals(r)["async_a2_r3"]
    assert g["vs_sync_r3"]["ratio"] == pytest.approx(5.0) and g["vs_sync_r3"]["met"]
    assert g["vs_sync"]["ratio"] == pytest.approx(10.0) and "vs_sync_r3" not in goals(r)["async_a1"]


def test_env_replicas_wrap_every_task_env_in_the_replicated_entry_point(tmp_path) -> None:
    from rollart_core.bench.workload import MODES, SIZES, mode_config, workload_config
    from rollart_core.registry import build

    size = SIZES["micro"]
    base = workload_config(size, tmp_path, tmp_path / "model")
    plain, hedged = mode_config(base, MODES["sync"], size), mode_config(base, MODES["sync_r3"], size)
    for i, (t, h) in enumerate(zip(plain.tasks, hedged.tasks, strict=True)):
        assert h.env.impl == "replicated" and h.env.options["replicas"] == 3
        assert h.env.options["env"] == t.env.model_dump()
        env = build("env", h.env.impl, h.env.options, f"tasks.{i}.env.options")
        assert (
            len(env._replicas) == 3
            and env.system_prompt == build("env", t.env.impl, t.env.options, "x").system_prompt
        )


async def test_cpu_meter_reads_the_machines_busy_fraction() -> None:
    import asyncio
    import time

    from rollart_core.timeline import CpuMeter, cpu_jiffies

    busy0, total0 = cpu_jiffies()
    assert 0 <= busy0 <= total0
    async with CpuMeter(period=0.05) as meter:
        t0 = time.perf_counter()
        while cpu_jiffies()[0] - busy0 < 10 or len(meter.samples) < 3:  # keeps a core busy meanwhile
            sum(range(10_000))
            await asyncio.sleep(0)
        t1 = time.perf_counter()
    assert len(meter.samples) >= 2
    frac = meter.busy((t0, t1))
    assert frac is not None and 0 < frac <= 1
    assert CpuMeter().busy((0.0, 1.0)) is None  # no samples: no figure


def test_episode_sums_weight_each_steps_mean_by_its_count() -> None:
    from rollart_core.bench.figures import episode_sums

    rows = [
        {"finished_by_task": {"a": 2, "b": 1}, "episode_s_by_task": {"a": 1.0, "b": 4.0}},
        {"finished_by_task": {"a": 1}, "episode_s_by_task": {"a": 4.0}},
        {"finished_by_task": {}, "episode_s_by_task": {}},
    ]
    assert episode_sums(rows) == {"a": [6.0, 3], "b": [4.0, 1]}


def test_each_mode_warms_up_for_its_pipeline_depth_before_throughput_is_measured(tmp_path) -> None:
    from rollart_core.bench.figures import steady_window
    from rollart_core.bench.workload import MODES, SIZES, mode_config, workload_config

    # Sync+ has no pipeline but leaves its first step out too: it measures the groups One-off measures
    assert MODES["sync"].warmup_steps() == 1 and MODES["one_off"].warmup_steps() == 1
    assert [MODES[m].warmup_steps() for m in ("async_a1", "async_a2", "async_a4_r3", "admission")] == [
        2,
        3,
        5,
        2,
    ]
    quick = SIZES["quick"]
    base = workload_config(quick, tmp_path, tmp_path / "model")
    for m in ("sync", "async_a2", "async_a4_r3"):
        assert mode_config(base, MODES[m], quick).loop.steps == quick.steps + MODES[m].warmup_steps()
    micro = SIZES["micro"]
    assert not micro.warmup and mode_config(base, MODES["async_a2"], micro).loop.steps == micro.steps

    rows = [
        {"elapsed": e, "batch_size": b} for e, b in [(3.0, 16), (4.0, 16), (5.0, 16), (7.0, 12), (9.0, 16)]
    ]
    (w0, w1), measured = steady_window(rows, 3)
    assert (w0, w1) == (5.0, 9.0) and [r["batch_size"] for r in measured] == [12, 16]
    assert steady_window(rows, 5) is None

    (w0, _), measured = steady_window(rows, 1)
    assert w0 == 3.0 and len(measured) == 4
    (w0, w1), measured = steady_window(rows, 0)  # no pipeline (Sync+): the whole segment
    assert (w0, w1) == (0.0, 9.0) and measured == rows


def test_the_modes_of_a_round_draw_the_same_env_seeds_and_latencies(tmp_path) -> None:
    from rollart_core.bench.workload import MODES, SIZES, mode_config, segment_config, workload_config

    quick = SIZES["quick"]
    base = workload_config(quick, tmp_path, tmp_path / "model")
    sync, hedged = (mode_config(base, MODES[m], quick) for m in ("sync", "async_a2_r3"))
    r0, r1 = segment_config(sync, 0, "sync"), segment_config(sync, 1, "sync")
    assert (r0.seed, r1.seed) == (base.seed, base.seed + 1000)  # rounds draw afresh, modes of a round alike
    assert workload_config(quick.model_copy(update={"seed": 8}), tmp_path, tmp_path / "m").seed == 8
    assert [t.env.options["paired_scope"] for t in r0.tasks] == ["round0/sync"] * 2
    assert "paired_scope" not in sync.tasks[0].env.options  # the mode's own config is left as it was
    inner = segment_config(hedged, 1, "async_a2_r3").tasks[1].env.options["env"]
    assert inner["impl"] == "straggler" and inner["options"]["paired_scope"] == "round1/async_a2_r3"


def test_bench_set_overrides_size_fields_and_rejects_unknown_ones(capsys: pytest.CaptureFixture[str]) -> None:
    from rollart_core.bench.harness import parse_overrides, sized
    from rollart_core.cli import main
    from rollart_core.errors import ConfigError

    over = parse_overrides(["env_latency_s=0.1", "groups_per_step=4", "env_timeout_s=null", "warmup=false"])
    assert over == {"env_latency_s": 0.1, "groups_per_step": 4, "env_timeout_s": None, "warmup": False}
    size = sized("quick", over)
    assert (size.env_latency_s, size.groups_per_step, size.env_timeout_s, size.warmup) == (
        0.1,
        4,
        None,
        False,
    )
    assert size.rounds == SIZES["quick"].rounds  # the rest stays the size's
    with pytest.raises(ConfigError, match="FIELD=VALUE"):
        parse_overrides(["groups_per_step"])
    with pytest.raises(ConfigError, match="greater than or equal to 1"):
        sized("quick", {"groups_per_step": 0})
    # the CLI: an unknown field is refused before anything starts, naming the fields there are
    assert main(["bench", "--micro", "--set", "group_sise=3"]) == 2
    err = capsys.readouterr().err
    assert "group_sise" in err and "fields: rounds, steps" in err and "Traceback" not in err
