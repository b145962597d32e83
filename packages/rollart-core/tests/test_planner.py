"""Planner: hand-computed roofline cases, pool sizing, the simulator's sanity, ``rollart plan``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rollart_core.cli import main
from rollart_core.errors import ConfigError
from rollart_core.plan.catalogue import DEFAULT_CATALOGUE, load_catalogue
from rollart_core.plan.planner import decode_step, estimate, make_plan, max_batch, prefill_seconds
from rollart_core.plan.simulate import simulate
from rollart_core.plan.workload import (
    LatencyDist,
    ModelProfile,
    TaskProfile,
    TrainProfile,
    WorkloadProfile,
    profile_from_trajectories,
)
from rollart_core.types import Fate, Trajectory, Turn

# 7B, 28 layers, 4 KV heads × 128, bf16: weights 14e9 B, KV 2·28·4·128·2 = 57,344 B per token
MODEL = ModelProfile(params=7e9, num_layers=28, num_kv_heads=4, head_dim=128, dtype_bytes=2)
H800, H20 = DEFAULT_CATALOGUE["H800"], DEFAULT_CATALOGUE["H20"]
PREFILL_HEAVY = TaskProfile(name="rag", prompt_tokens=8000, output_tokens_per_turn=16)
DECODE_HEAVY = TaskProfile(name="reason", prompt_tokens=100, output_tokens_per_turn=16000)


def test_kv_and_prefill_by_hand() -> None:
    assert MODEL.kv_bytes_per_token == 57344 and MODEL.weight_bytes == 14e9
    # 2 · 7e9 · 8000 / (989e12 · 0.5) = 0.22649 s on H800; / (148e12 · 0.5) = 1.51351 s on H20
    assert prefill_seconds(8000, MODEL, H800) == pytest.approx(0.22649, rel=1e-4)
    assert prefill_seconds(8000, MODEL, H20) == pytest.approx(1.51351, rel=1e-4)


def test_decode_step_by_hand() -> None:
    # mean context 100 + 16000/2 = 8100 tokens → 464.5 MB of KV per sequence
    ctx = DECODE_HEAVY.mean_context()
    assert ctx == 8100
    # H20: (96 GiB · 0.9 − 14e9) / (8100 · 57344) = 169 sequences
    b = max_batch(ctx, MODEL, H20, 256)
    assert b == 169
    step, bound = decode_step(b, ctx, MODEL, H20)
    # memory: (14e9 + 169 · 8100 · 57344) / (4e12 · 0.7) = 0.033035 s; compute: 2·7e9·169/(148e12·0.5) = 0.031973 s
    assert (step, bound) == (pytest.approx(0.033035, rel=1e-3), "bandwidth")
    # batch 1 on H800 is pure weight streaming: 14e9 / (3.35e12 · 0.7) = 5.97 ms per token
    assert decode_step(1, 0, MODEL, H800) == (pytest.approx(5.970e-3, rel=1e-3), "bandwidth")


def test_prefill_heavy_prefers_compute_class_decode_heavy_prefers_bandwidth_class() -> None:
    cat = {"H800": H800, "H20": H20}
    pf = {n: estimate(PREFILL_HEAVY, MODEL, n, hw) for n, hw in cat.items()}
    # prefill: H800 0.2265 s × $2.2/h = 1.38e-4 $; H20 1.5135 s × $0.9/h = 3.78e-4 $
    assert pf["H800"].cost < pf["H20"].cost  # type: ignore[union-attr]
    dc = {n: estimate(DECODE_HEAVY, MODEL, n, hw) for n, hw in cat.items()}
    # decode: H20 16000 · 0.033035/169 = 3.13 GPU-s × $0.9/h; H800 (batch 136) 16000 · 0.03294/136 = 3.87 × $2.2/h
    assert dc["H20"].decode_s == pytest.approx(3.128, rel=1e-2)  # type: ignore[union-attr]
    assert dc["H20"].cost < dc["H800"].cost / 2  # type: ignore[union-attr]
    # batches big enough that the rollout computes longer than one trajectory lives
    big = [t.model_copy(update={"trajectories_per_step": 4096}) for t in (PREFILL_HEAVY, DECODE_HEAVY)]
    plan = make_plan(WorkloadProfile(model=MODEL, tasks=big), cat, gpus=16)
    chosen = {tp.task: (tp.prefill.hw, tp.decode.hw) for tp in plan.tasks}
    assert chosen == {"rag": ("H800", "H800"), "reason": ("H20", "H20")}
    assert sum(plan.pools.values()) + plan.trainer_gpus == 16
    assert plan.pools["H20"] > plan.pools["H800"]  # decode needs more GPU-s
    assert plan.bottleneck == "generation" and plan.split.gen_busy > 0.9


def test_pd_split_when_one_task_is_both() -> None:
    both = TaskProfile(name="agent", prompt_tokens=32000, output_tokens_per_turn=8000)
    plan = make_plan(WorkloadProfile(model=MODEL, tasks=[both]), {"H800": H800, "H20": H20}, gpus=8)
    tp = plan.tasks[0]
    assert tp.disaggregated and (tp.prefill.hw, tp.decode.hw) == ("H800", "H20")
    assert tp.gpus_prefill >= 1 and tp.gpus_decode >= 1
    assert tp.gpus_prefill + tp.gpus_decode + plan.trainer_gpus == 8


def test_bottleneck_moves_to_environments_or_training() -> None:
    slow_train = WorkloadProfile(model=MODEL, tasks=[PREFILL_HEAVY], train=TrainProfile(train_s=600))
    assert make_plan(slow_train, DEFAULT_CATALOGUE, gpus=64).bottleneck == "training"
    with pytest.raises(ConfigError, match="unknown hardware class 'B300'"):
        make_plan(slow_train, DEFAULT_CATALOGUE, classes=["B300"])
    huge = WorkloadProfile(model=ModelProfile(params=1e12), tasks=[PREFILL_HEAVY])
    with pytest.raises(ConfigError, match="fits no GPU class"):
        make_plan(huge, DEFAULT_CATALOGUE)


def _sim_profile(env: LatencyDist, train_s: float) -> WorkloadProfile:
    task = TaskProfile(
        name="t",
        trajectories_per_step=64,
        group_size=8,
        turns=4,
        env_latency_s=env,
        generate_s=LatencyDist(mean=0.5),
    )
    return WorkloadProfile(tasks=[task], train=TrainProfile(train_s=train_s, sync_s=0.2), gen_slots=64)


def test_async_beats_sync_on_heavy_tailed_envs() -> None:
    prof = _sim_profile(LatencyDist(mean=1.0, dist="lognormal", sigma=1.5), train_s=5.0)
    sync = simulate(prof, mode="sync", steps=10)
    asyn = simulate(prof, mode="async", alpha=1, steps=10)
    assert asyn.traj_per_s > 1.3 * sync.traj_per_s, (asyn, sync)
    assert asyn.trained >= 9 * 64 * 0.9


def test_async_equals_sync_without_overlap_to_gain() -> None:
    prof = _sim_profile(LatencyDist(mean=1.0), train_s=0.0)
    prof.train.sync_s = 0.0
    sync = simulate(prof, mode="sync", steps=6)
    asyn = simulate(prof, mode="async", alpha=1, max_pending_steps=1, steps=6)
    # every trajectory takes 5 env calls + 4 turns = 7 s; 64 of them per step in both modes
    assert sync.traj_per_s == pytest.approx(64 / 7.0, rel=1e-6)
    assert asyn.traj_per_s == pytest.approx(sync.traj_per_s, rel=0.05)
    assert asyn.aborted == 0
    # the loop's default depth, alpha + 1 steps of groups in flight: twice the groups at once, each
    # living 7 s (Little's law)
    deep = simulate(prof, mode="async", alpha=1, steps=6)
    assert deep.traj_per_s == pytest.approx(2 * 64 / 7.0, rel=0.05) and deep.aborted == 0


def test_shared_hardware_slows_only_the_overlap() -> None:
    prof = _sim_profile(LatencyDist(mean=0.5), train_s=5.0)
    apart = {m: simulate(prof, mode=m, alpha=1, steps=8) for m in ("sync", "async")}
    prof.train.colocated_slowdown = prof.train.train_colocated_slowdown = (
        1.0  # both at half speed when overlapped
    )
    shared = {m: simulate(prof, mode=m, alpha=1, steps=8) for m in ("sync", "async")}
    # Sync+ never overlaps training with rollout: unchanged. Async loses part of its gain: while
    # generation runs beside it the trainer is at half speed, but env waits (no compute) still overlap.
    assert shared["sync"].traj_per_s == pytest.approx(apart["sync"].traj_per_s, rel=1e-9)
    assert shared["sync"].traj_per_s < shared["async"].traj_per_s < 0.9 * apart["async"].traj_per_s


def test_simulation_scales_to_thousands_of_gpus() -> None:
    task = TaskProfile(
        name="swe",
        trajectories_per_step=4096,
        group_size=16,
        prompt_tokens=4000,
        context_tokens_per_turn=500,
        output_tokens_per_turn=300,
        turns=8,
        env_latency_s=LatencyDist(mean=3.0, dist="lognormal", sigma=1.0),
        reward_s=LatencyDist(mean=1.0),
    )
    prof = WorkloadProfile(model=MODEL, tasks=[task], train=TrainProfile(train_s=120, sync_s=10))
    # (how fast it runs is for a benchmark, not a test: CI machines are shared)
    plan = make_plan(prof, DEFAULT_CATALOGUE, gpus=2048, simulate_steps=3)
    assert plan.simulated["async"].trained >= 4096
    sim = {m: r.traj_per_s for m, r in plan.simulated.items()}
    assert min(sim["async"], sim["one_off"]) >= sim["sync"], sim  # (one measured async step: noisy)


def test_profile_from_trajectories() -> None:
    trajs = []
    for i in range(4):
        t = Trajectory(f"t{i}", "lake", "frozenlake", "g", 0, 0)
        t.turns = [Turn([1] * 100, [5]), Turn([2] * 10, [6]), Turn([3] * 10, [7])]
        t.timings = {"env": 0.4, "generate": 0.3, "reward": 0.01}
        t.fate = Fate.FINISHED if i < 3 else Fate.ENV_FAILED
        trajs.append(t)
    rows = [
        {"train_s": 9.0, "sync_s": 9.0},
        {"train_s": 1.0, "sync_s": 0.2, "traj_per_s": 5, "step_s": 2, "wait_s": 1},
        {"train_s": 3.0, "sync_s": 0.4, "traj_per_s": 7, "step_s": 2, "wait_s": 1},
    ]
    prof = profile_from_trajectories(trajs, rows, group_size={"lake": 4})
    task = prof.task("lake")
    assert (task.prompt_tokens, task.context_tokens_per_turn, task.output_tokens_per_turn, task.turns) == (
        100,
        10,
        1,
        3,
    )
    assert task.env_latency_s.mean == pytest.approx(0.1) and task.generate_s.mean == pytest.approx(0.1)  # type: ignore[union-attr]
    assert (prof.train.train_s, prof.train.sync_s) == (2.0, pytest.approx(0.3))  # warm-up row skipped
    assert prof.measured["traj_per_s"] == 6
    with pytest.raises(ConfigError, match="no finished trajectory"):
        profile_from_trajectories(trajs[3:])


# the command line ----------------------------------------------------------------------------------

CONFIG = Path(__file__).resolve().parents[3] / "examples" / "frozenlake_tiny.yaml"


def _profile_file(tmp_path: Path) -> Path:
    prof = WorkloadProfile(
        model=MODEL, tasks=[TaskProfile(name="frozenlake", prompt_tokens=8000, output_tokens_per_turn=16)]
    )
    path = tmp_path / "run.json"
    path.write_text(prof.model_dump_json())
    return path


def test_cli_plan_prints_plan_and_bottleneck(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            ["plan", str(CONFIG), "--profile", str(_profile_file(tmp_path)), "--gpus", "8", "--simulate", "3"]
        )
        == 0
    )
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert first.startswith("plan from the profile") and "written by hand, not measured" in first, first
    assert "frozenlake      H800" in out and "training: H800 × " in out and "predicted bottleneck (" in out
    assert "simulated sync" in out and "simulated one_off" in out and "simulated async" in out
    cat = tmp_path / "cat.yaml"
    cat.write_text("H800: {flops: 1.0e12, mem_bw: 1.0e11, mem_bytes: 1.0e11, price_per_hour: 100}\n")
    assert (
        main(
            [
                "plan",
                str(CONFIG),
                "--profile",
                str(_profile_file(tmp_path)),
                "--catalogue",
                str(cat),
                "--json",
            ]
        )
        == 0
    )
    plan = json.loads(capsys.readouterr().out)
    assert plan["tasks"][0]["prefill"]["hw"] != "H800"  # the made-expensive class is avoided


def test_cli_plan_bad_input_exits_2_without_traceback(tmp_path: Path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "rollart_core.cli", "plan", *args],
            capture_output=True,
            text=True,
            timeout=120,
        )

    cases = [
        ((str(tmp_path / "missing.yaml"),), "no such config file"),
        ((str(CONFIG), "--profile", str(tmp_path / "none.json")), "no such profile file"),
        ((str(CONFIG), "--classes", "H800,B300"), "unknown hardware class 'B300'"),
        ((str(CONFIG), "--params", "1e12"), "the model fits no GPU class of the catalogue"),
        ((str(CONFIG), "--gpus", "2", "--params", "7e9"), "--gpus 2 is too small"),
        ((str(CONFIG), "--train-mfu", "1.5"), "--train-mfu must be in (0, 1]"),
    ]
    bad = tmp_path / "bad.yaml"
    bad.write_text("H900: {flops: -1, price_per_hour: 1}\n")
    cases.append(((str(CONFIG), "--catalogue", str(bad)), "hardware class 'H900': flops"))
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"tasks": [{"name": "chess"}]}))
    cases.append(((str(CONFIG), "--profile", str(wrong)), "profile tasks ['chess'] are not tasks"))
    for args, msg in cases:
        out = run(*args)
        assert out.returncode == 2, (args, out.stderr)
        assert msg in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_catalogue_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such catalogue file"):
        load_catalogue(tmp_path / "x.yaml")


def test_planned_config_routes_tasks_to_the_plans_pools(tmp_path: Path) -> None:
    """``rollart plan --write-config``: the plan as engine groups and task routes ``rollart train`` accepts."""
    from rollart_core.config import RunConfig, load_config
    from rollart_core.plan.cli import plan_config

    cfg = RunConfig.model_validate(
        {
            "model": {"path": str(tmp_path / "m")},
            "engines": [{"name": "gen", "impl": "vllm", "options": {"x": 1}}],
            "tasks": [
                {"name": n, "env": {"impl": "frozenlake"}, "reward": {"impl": "success"}}
                for n in ("rag", "reason", "agent")
            ],
        }
    )
    both = TaskProfile(name="agent", prompt_tokens=32000, output_tokens_per_turn=8000)
    plan = make_plan(
        WorkloadProfile(model=MODEL, tasks=[PREFILL_HEAVY, DECODE_HEAVY, both]),
        {"H800": H800, "H20": H20},
        gpus=16,
    )
    data = plan_config(cfg, plan)
    counts = {e["pool"]: e["count"] for e in data["engines"]}
    assert counts == {hw: n for hw, n in plan.pools.items() if hw in ("H800", "H20")}
    assert all(e["impl"] == "vllm" and e["options"] == {"x": 1} for e in data["engines"])
    routes = {t["name"]: (t["engine_group"], t["prefill_engine_group"], t["pd"]) for t in data["tasks"]}
    assert routes["rag"] == ("h800", None, "off") and routes["reason"] == ("h20", None, "off")
    assert routes["agent"] == ("h20", "h800", "on")
    import yaml

    out = tmp_path / "planned.yaml"
    out.write_text(yaml.safe_dump(data))
    assert {e.name for e in load_config(out).engines} == {"h800", "h20"}
    # through the CLI: rollart plan CONFIG --write-config OUT
    src, written = tmp_path / "run.yaml", tmp_path / "cli-planned.yaml"
    src.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    assert main(["plan", str(src), "--gpus", "8", "--write-config", str(written)]) == 0
    planned = load_config(written)
    assert all(t.engine_group is not None for t in planned.tasks)
    # the trainer pool is written too: a worker group, one GPU per rank, on its class's pool
    trainer = planned.trainer
    assert trainer.pool == "H800" and trainer.num_gpus == 1 and trainer.ranks is not None
    assert sum(e.count for e in planned.engines) + trainer.ranks == 8
    assert trainer.impl == cfg.trainer.impl and trainer.options == cfg.trainer.options
