"""The bench's non-circular bounds and its resilience (issue 41): the window bound does not move with
the trainer's speed, the CPU-charged bound on a synthetic segment, per-process CPU accounting on a
real child process, and a bench whose reward probe measures nothing still runs and writes its rounds
(on the control plane's in-process fakes, named as such in conftest)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from rollart_core.bench.cpu import BREAKDOWN, ProcessCpu, cpu_figures
from rollart_core.bench.figures import aggregate, group_sums, natural_lifetimes, window_bound
from rollart_core.bench.samples import version_waits
from rollart_core.metrics import MemorySink
from rollart_core.timeline import Timeline, bottleneck_bound


async def _fake_async_run(fakes: Any, tmp: Path, train_delay_s: float) -> list[tuple[str, float, float, str]]:
    """An async α=1 run on the fakes whose trainer takes ``train_delay_s`` per step; its timeline."""
    from rollart_core.control.train import train

    class SlowTrainer(fakes.CountingTrainer):
        def train_step(self, batch: list[Any]) -> dict[str, float]:
            time.sleep(train_delay_s)  # the trainer's own work, in its thread
            return super().train_step(batch)

    script = fakes.Script(step_delay_s=0.02)
    cfg = fakes.fake_config(tmp, mode="async", alpha=1, steps=6, abort_stale=False)
    p = fakes.FakePipeline(cfg, script)
    p.trainer = SlowTrainer(script)
    with Timeline() as tl:
        await asyncio.wait_for(train(cfg, sink=MemorySink(), pipeline=p), 60)
    return tl.intervals


async def test_window_bound_does_not_move_with_the_trainers_speed(fakes: Any, tmp_path: Path) -> None:
    # the same rollout (each episode ~0.1 s: 2 turns of a 0.02 s generation and a 0.02 s env step),
    # a trainer 0.01 s or 0.4 s per step
    spec = (2, {"t": 2}, {"t": 2})
    figures, raw = {}, {}
    for delay in (0.01, 0.4):
        ivs = await _fake_async_run(fakes, tmp_path / str(delay), delay)
        everything = (float("-inf"), float("inf"))
        seg = {
            "groups": group_sums(ivs, "group", everything),
            "groups_rollout": group_sums(ivs, "group_rollout", everything),
            "groups_wait": version_waits(ivs, everything),
        }
        taken = window_bound(*spec, {t: s / n for t, (s, n) in seg["groups"].items()})
        natural = window_bound(*spec, natural_lifetimes([seg]))
        rollout = window_bound(*spec, {t: s / n for t, (s, n) in seg["groups_rollout"].items()})
        figures[delay] = (taken, natural)
        raw[delay] = rollout
    (taken_fast, natural_fast), (taken_slow, natural_slow) = figures[0.01], figures[0.4]
    assert taken_fast is not None and taken_slow is not None
    assert natural_fast is not None and natural_slow is not None
    # launch → taken: the slow trainer keeps groups waiting, and that bound falls with it (circular)
    assert taken_slow < 0.5 * taken_fast, figures
    # launch → last member's fate moves too: a group launched ahead waits for the coming version
    assert raw[0.4] is not None and raw[0.01] is not None and raw[0.4] < 0.5 * raw[0.01], raw
    # less that wait: the rollout's own time
    assert natural_slow == pytest.approx(natural_fast, rel=0.35), figures


def test_cpu_charged_bound_and_breakdown_on_a_synthetic_segment() -> None:
    # 10 s on 2 cores (20 core-seconds): engines 6 s, trainer 4 s, reward runtime 1 s, driver 3 s
    # (of which 100 env calls x 5 ms and 40 in-process reward calls x 12.5 ms), Ray 1 s; the machine
    # was busy 17 s: 2 s were other processes', 3 s idle. 50 trajectories trained.
    seconds = {
        "generate": 6.0,
        "train": 4.0,
        "reward": 1.0,
        "driver": 3.0,
        "ray": 1.0,
        "busy": 17.0,
        "total": 20.0,
    }
    f = cpu_figures(seconds, trained=50, cores=2, in_driver={"env": 100 * 0.005, "reward": 40 * 0.0125})
    assert f is not None
    assert f["cpu_s_per_traj"] == pytest.approx(15.0 / 50)  # every stage of the run, per trajectory
    assert f["bound"] == pytest.approx(2 / 0.3)
    assert f["cpu_s_per_traj_by_stage"]["driver"] == pytest.approx(2.0 / 50)
    assert f["cpu_s_per_traj_by_stage"]["reward"] == pytest.approx(1.5 / 50)
    assert f["cpu_s_per_traj_by_stage"]["env"] == pytest.approx(0.5 / 50)
    share = f["share"]
    assert list(share) == list(BREAKDOWN) and sum(share.values()) == pytest.approx(1.0)
    assert share["other"] == pytest.approx(0.1) and share["idle"] == pytest.approx(0.15)
    # achieved / the bound is the run's share of the machine: 5 traj/s over 20/3
    assert (50 / 10) / f["bound"] == pytest.approx(f["run_share"]) == pytest.approx(0.75)
    assert cpu_figures(seconds, trained=0, cores=2) is None

    # through aggregate: the calls in the window times the probes' CPU per call
    seg = {
        "wall_s": 10.0,
        "steps": 2,
        "trained": 50,
        "trained_by_task": {"t": 50},
        "gen_tokens": 500.0,
        "trained_gen_tokens": 400.0,
        "wasted_gen_tokens": 0.0,
        "launched": 50,
        "episodes": {"t": [50.0, 50]},
        "fates": {"finished": 50},
        "step_s": [5.0, 5.0],
        "lag_max": 0,
        "stages": {
            st: {"utilisation": 0.5, "mean_concurrency": 0.5, "count": 1.0}
            for st in ("generate", "env", "reward", "train", "weight_sync")
        },
        "cpu_busy": 0.85,
        "cpu": {**seconds, "wall": 10.0},
        "calls": {"env": 100, "reward": 40},
    }
    bounds = {
        "sync": {
            "bound": 4.0,
            "bottleneck": "generate+train",
            "in_driver": {"env": 0.005, "reward": 0.0125},
            "cores": 2,
        }
    }
    r = aggregate({"sync": [seg]}, bounds)["sync"]
    assert r["cpu_bound_traj_per_s"] == pytest.approx(2 / 0.3)
    assert r["achieved_over_cpu_bound"] == pytest.approx(0.75)
    assert r["min_bound_by"] == "compute" and r["achieved_over_min_bound"] == pytest.approx(5.0 / 4.0)


async def test_process_cpu_charges_a_childs_time_to_its_stage() -> None:
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass\n"
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        async with ProcessCpu({"train": [child.pid]}, period=0.05) as cpu:
            t0 = time.perf_counter()
            # a process that burns 0.4 s of CPU and exits inside the window
            # a child of ours, not of the root: it is the driver's tree (``ray``)
            grandchild = subprocess.Popen([sys.executable, "-c", burn])
            grandchild.wait(timeout=30)
            t1 = time.perf_counter()
        s = cpu.seconds((t0, t1))
    finally:
        child.kill()
        child.wait()
    assert s is not None
    # the exited child's time reached us through our reaped time: counted once, as the driver's tree
    assert 0.3 <= s["ray"] + s["driver"] <= 1.2, s
    assert s["train"] < 0.2, s  # the sleeping root used next to nothing
    assert s["total"] > 0 and s["busy"] >= 0.3


def test_unmeasured_stages_bound_nothing_and_are_named() -> None:
    b = bottleneck_bound({"generate": 10.0, "train": 10.0, "env": 8.0, "reward": None}, ("generate", "train"))
    assert b["bound"] == pytest.approx(5.0) and b["unmeasured"] == ["reward"]
    b = bottleneck_bound({"generate": None, "train": 10.0, "env": 8.0}, ("generate", "train"))
    assert b["bottleneck"] == "env" and b["unmeasured"] == ["generate"]  # the shared pair left out whole
    assert bottleneck_bound({"reward": None})["bound"] is None


class _BenchFakes:
    """The conftest fakes, with what the bench asks of a pipeline besides the training loop."""

    def __init__(self, fakes: Any) -> None:
        self.fakes = fakes

    def pipeline(self, cfg: Any) -> contextlib.AbstractAsyncContextManager[Any]:
        fakes = self.fakes

        class Trainer(fakes.CountingTrainer):
            def set_num_threads(self, n: int) -> None:
                self.threads = n

        class Proxy(fakes.EchoProxy):
            async def weight_versions(self) -> dict[str, int]:
                return {"fake-0": self.version}

        @contextlib.asynccontextmanager
        async def open_pipeline(cfg: Any) -> AsyncIterator[Any]:
            script = fakes.Script(step_delay_s=0.005)
            p = fakes.FakePipeline(cfg, script)
            p.trainer, p.proxy = Trainer(script), Proxy(script)
            yield p

        return open_pipeline(cfg)


async def test_a_bench_whose_reward_probe_measures_nothing_still_writes_its_rounds(
    fakes: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from rollart_core.bench.harness import run_bench, sized

    # every reward call takes 1 s, the probes' windows 0.05 s and then 0.2 s: nothing finishes in them
    size = sized(
        "micro",
        {"reward_s": 1.0, "reward_sigma": 0.0, "capacity_s": 0.05, "env_latency_s": 0.0, "crash_prob": 0.0},
    )
    modes = ["admission", "abl_inline_standin"]  # in-process reward executors: no runtime to start
    res = await asyncio.wait_for(
        run_bench("micro", size, modes, tmp_path, tmp_path / "model", pipeline=_BenchFakes(fakes).pipeline),
        120,
    )
    for kind in ("colocated", "inline_standin"):
        cap = res["capacity"][f"reward_{kind}"]
        assert (
            cap["traj_per_s"] is None
            and "nothing finished within 0.05 s, nor within 0.2 s" in cap["unmeasured"]
        )
    out = capsys.readouterr().out
    for mode in modes:
        assert f"round 1/1 {mode} (" in out and "traj/s measured" in out
        r = res["results"][mode]
        assert r["traj_per_s"] > 0 and "reward" in r["unmeasured"]
        assert res["bounds"][mode]["unmeasured_why"]["reward"].startswith("nothing finished")
        assert r["window_bound_traj_per_s"] is not None  # the idle lifetimes were measured
        assert r["cpu_bound_traj_per_s"] is not None and r["cpu"]["share"]["idle"] >= 0
    written = json.loads((tmp_path / "bench.json").read_text())  # written after the round
    assert written["rounds_done"] == 1 and set(written["results"]) == set(modes)
    assert "unmeasured" in (tmp_path / "summary.md").read_text()


async def test_a_failed_segment_says_why_and_the_rounds_go_on(fakes: Any, tmp_path: Path) -> None:
    from rollart_core.bench.harness import RewardExecutors, guarded_segment, missing_lines, round_line
    from rollart_core.bench.workload import MODES, SIZES, mode_config, workload_config

    size = SIZES["micro"]
    cfg = mode_config(workload_config(size, tmp_path, tmp_path / "model"), MODES["admission"], size)
    cm = _BenchFakes(fakes).pipeline(cfg)
    async with cm as p:
        p.script.engine_down = True
        rewards = RewardExecutors()
        seg = await asyncio.wait_for(guarded_segment(p, cfg, "admission", 0, size, rewards, keep=False), 60)
        await rewards.aclose()
    assert seg["round"] == 0 and "engine is down" in seg["failed"]
    line = round_line(0, 2, "admission", seg)
    assert (
        line.startswith("round 1/2 admission (admission-only")
        and "no figure" in line
        and "engine is down" in line
    )
    missing = missing_lines({"admission": [seg]}, ["admission"], 2)
    assert "engine is down" in missing["admission"]["1"] and "not run" in missing["admission"]["2"]
    assert aggregate({"admission": [seg]}, {"admission": {"bound": 1.0}}) == {}  # no figure from it
