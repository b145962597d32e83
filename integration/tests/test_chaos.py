"""The quick chaos run (``integration/bench/chaos.py --quick``) keeps every promise of the fault model:
with env actors, an engine actor and a trainer rank SIGKILLed and 20% of reward calls failing, the run
completes its steps, every launched trajectory has exactly one fate, nothing is trained twice or past
alpha, the killed engine is back on the served weights and serving before the run ends, and no
process it started outlives it. Slow (minutes: two vLLM engines, a trainer group, four env actors and
two reward runtimes on Ray): ``pytest -m slow integration/tests/test_chaos.py``."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.ray]

BENCH = Path(__file__).resolve().parents[1] / "bench" / "chaos.py"


def test_schedule_is_seeded_and_covers_every_fault() -> None:
    spec = importlib.util.spec_from_file_location("chaos_bench", BENCH)
    assert spec is not None and spec.loader is not None
    chaos = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(chaos)
    plan = chaos.schedule(3, 6, 10)
    assert plan == chaos.schedule(3, 6, 10)
    assert sorted(f["kind"] for f in plan) == ["engine", "env", "trainer"]
    assert plan[0]["kind"] == "engine" and plan[0]["at_version"] == 0  # first: its restart is the longest
    assert all(1 <= f["at_version"] <= 4 for f in plan if f["kind"] != "engine")
    assert next(f for f in plan if f["kind"] == "trainer")["at_version"] >= 2  # a checkpoint to come back to
    assert sum(f["kind"] == "env" for f in chaos.schedule(0, 12, 16)) == 2  # 10% of 16 actors, rounded up


def test_quick_chaos_run_keeps_the_invariants(tmp_path: Path) -> None:
    out = tmp_path / "chaos.json"
    # a process of its own: the run starts and must stop its own Ray cluster, and its leftover check
    # looks at the processes that descend from it
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--seed", "1", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["error"] is None, r["error"]
    assert r["steps"] == r["steps_asked"]
    assert r["launched"] == r["fates_total"] and r["lost"] == 0, r["fates"]
    assert r["trained_twice"] == 0
    assert r["lag_violations"] == 0 and r["lag_max"] <= r["alpha"]
    assert r["leftover_processes"] == {}, r["leftover_processes"]
    assert r["faults_by_kind"] == {"env": 1, "engine": 1, "trainer": 1}, r["faults"]
    assert r["trainer_restarts"] == 1
    # the killed engine came back on the served weights and served requests before the run ended
    assert r["engine_back_at_version"] is not None and r["engine_served_after_back"] >= 1, r["faults"]
    versions = r["engine_versions_at_back"]  # the engine was brought to the version the other serves
    assert versions[r["engine_killed"]] == max(versions.values()), versions
    assert not any(r["proxy_session_tables"].values()), r["proxy_session_tables"]
    assert r["env_manager"]["actor_deaths"] >= 1
    assert any(sum(c.values()) for c in r["reward_runtime_faults"].values()), r["reward_runtime_faults"]
    assert r["violations"] == [] and proc.returncode == 0, proc.stdout[-3000:]
