"""``rollart bench`` end to end on the micro size: real engine, trainer, envs and rewards; the result
files exist and their numbers are consistent with each other."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.ray]
MODES = ["sync", "async_a1", "admission"]


@pytest.mark.slow  # ~65 s; CI keeps the bench's figure and timeline tests (rollart-core test_bench_*)
def test_rollart_bench_micro(tmp_path: Path, tiny_model: Path) -> None:
    out = tmp_path / "bench"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollart_core.cli",
            "bench",
            "--micro",
            "--modes",
            *MODES,
            "--out",
            str(out),
            "--model",
            str(tiny_model),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    assert "traj/s" in r.stdout and "of compute" in r.stdout and "Sync+" in r.stdout
    for name in ("bench.json", "summary.md", "report.html"):
        assert (out / name).stat().st_size > 0
    assert (out / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "timeline.png" in (out / "report.html").read_text()
    res = json.loads((out / "bench.json").read_text())
    assert res["machine"]["cpu_count"] >= 1 and res["config"]["tasks"][0]["name"] == "calc"

    cap = res["capacity"]
    for stage in ("generate", "train", "env", "reward_elastic", "reward_colocated"):
        assert cap[stage]["traj_per_s"] > 0, stage
    assert set(res["results"]) == set(MODES)
    for mode, m in res["results"].items():
        segs = res["segments"][mode]
        assert len(segs) == 1 and m["steps"] == segs[0]["steps"] == 1
        # every launched trajectory has exactly one fate
        assert sum(m["fates"].values()) == m["launched"] > 0, mode
        assert 0 < m["trained"] <= m["fates"].get("finished", 0)
        # every batch holds one group of each task (their groups_per_step), however fast each task is
        assert (
            set(m["trained_by_task"]) == {"calc", "lake"}
            and sum(m["trained_by_task"].values()) == m["trained"]
        )
        assert m["traj_per_s"] == pytest.approx(m["trained"] / m["wall_s"])
        # generated tokens: some went into the trained batch, never more than were generated
        assert 0.0 <= m["gen_waste"] < 1.0, mode
        assert set(m["episode_s"]) == {"calc", "lake"} and all(
            0 < v < m["wall_s"] + 60 for v in m["episode_s"].values()
        )
        assert m["achieved_over_bound"] == pytest.approx(m["traj_per_s"] / m["bound_traj_per_s"])
        assert m["bound_traj_per_s"] <= min(cap["generate"]["traj_per_s"], cap["train"]["traj_per_s"])
        assert all(0.0 <= u <= 1.0 for u in m["utilisation"].values()), m["utilisation"]
        assert (
            m["utilisation"]["generate"] > 0 and m["utilisation"]["train"] > 0 and m["utilisation"]["env"] > 0
        )
        seg = segs[0]
        assert all(0 <= s <= e <= seg["wall_s"] + 1e-3 for _, s, e in seg["intervals"])
        assert {name for name, _, _ in seg["intervals"]} >= {"generate", "env", "reward", "train"}
    assert res["results"]["sync"]["vs_sync"] == 1.0
    assert res["results"]["sync"]["utilisation"]["weight_sync"] > 0  # Sync+ updates right after training
    # the admission-only baseline: no redundancy, colocated reward, stale work never aborted early
    assert (
        res["results"]["admission"]["fates"].get("cancelled_redundant", 0)
        <= res["results"]["admission"]["launched"]
    )
    assert res["segments"]["admission"][0]["aborted_stale_early"] == 0
    assert res["mode_configs"]["admission"]["abort_stale"] is False
    assert res["results"]["admission"]["bottleneck"] and "async_a1" in res["goals"]
    assert "must be trained within alpha+1 = 2 steps" in r.stdout  # the staleness window of async α=1
    # the staleness window's bound: async modes measured their groups' lifetimes (launch → taken)
    for mode in ("async_a1", "admission"):
        m = res["results"][mode]
        assert all(v > 0 for v in m["group_lifetime_s"].values()) and set(m["group_lifetime_s"]) == {
            "calc",
            "lake",
        }
        assert all(m["group_rollout_s"][t] <= m["group_lifetime_s"][t] + 1e-6 for t in ("calc", "lake"))
        assert m["window_bound_traj_per_s"] > 0 and m["window_bound_load_traj_per_s"] > 0
        assert all(v > 0 for v in m["group_idle_s"].values()) and set(m["group_idle_s"]) == {"calc", "lake"}
        limits = (m["bound_traj_per_s"], m["cpu_bound_traj_per_s"], m["window_bound_traj_per_s"])
        assert m["achieved_over_min_bound"] == pytest.approx(m["traj_per_s"] / min(limits))
    assert res["results"]["sync"]["window_bound_traj_per_s"] is None
    # the CPU-charged bound: every stage's processes found, the machine's core-seconds all placed
    for mode, m in res["results"].items():
        cpu = m["cpu"]
        assert (
            cpu["cpu_s_per_traj_by_stage"]["generate"] > 0 and cpu["cpu_s_per_traj_by_stage"]["train"] > 0
        ), mode
        assert sum(cpu["share"].values()) == pytest.approx(1.0, abs=0.02), cpu
        assert m["cpu_bound_traj_per_s"] == pytest.approx(cpu["cores"] / cpu["cpu_s_per_traj"])
    assert "held against the tightest" in r.stdout and "Core-seconds:" in r.stdout
    assert res["rounds_done"] == 1 and not res["missing"]
    assert res["results"]["async_a1"]["rounds"]["vs_sync"]["rounds"] and "Little's law" in r.stdout
    # elastic reward through the real function runtime, which the bench started and stopped
    rw = res["results"]["async_a1"]["reward"]
    assert rw["runtime_calls"] > 0 and rw["runtime_provisioned_s"] > 0, rw
    assert 0 < rw["runtime_utilisation"] <= 1 and rw["runtime_cold_starts"] >= 0
    assert "reward through the function runtime" in r.stdout
    runtimes = [e for e in res["reward_executors"] if e["executor"] == "serverless"]
    assert len(runtimes) == 1 and runtimes[0]["url"].startswith("http://127.0.0.1:")
    assert not Path(f"/proc/{runtimes[0]['pid']}").exists(), "the reward runtime outlived the bench"
    assert res["results"]["admission"]["reward"]["utilisation"] > 0  # the colocated pool's share used
