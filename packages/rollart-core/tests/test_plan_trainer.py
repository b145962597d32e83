"""The planner's trainer pool: sizing from FLOPs on hand-computed cases, the split of a budget per
mode, the errors for a model or a budget that cannot work, and what ``rollart plan`` says first."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from rollart_core.cli import main
from rollart_core.config import RunConfig, load_config
from rollart_core.errors import ConfigError
from rollart_core.plan.catalogue import DEFAULT_CATALOGUE
from rollart_core.plan.planner import make_plan
from rollart_core.plan.trainer import (
    TrainerSizing,
    best_split,
    min_train_gpus,
    size_trainer,
    step_seconds,
    train_tokens_per_step,
)
from rollart_core.plan.workload import ModelProfile, TaskProfile, TrainProfile, WorkloadProfile

MODEL = ModelProfile(params=7e9, num_layers=28, num_kv_heads=4, head_dim=128, dtype_bytes=2)
H800 = DEFAULT_CATALOGUE["H800"]
# one step: 512 single-turn trajectories of 1,000 prompt + 1,000 generated tokens
TASK = TaskProfile(
    name="t", trajectories_per_step=512, group_size=8, prompt_tokens=1000, output_tokens_per_turn=1000
)


def test_trainer_sized_from_flops_by_hand() -> None:
    prof = WorkloadProfile(model=MODEL, tasks=[TASK])
    # tokens per step: 512 × (1,000 + 1,000) = 1,024,000
    assert train_tokens_per_step(prof) == 1_024_000
    t = size_trainer(prof, "H800", H800)
    # 6 · N · tokens = 6 × 7e9 × 1.024e6 = 4.3008e16 FLOP per step
    assert t.flops_per_step == pytest.approx(4.3008e16)
    # H800: 989e12 FLOP/s peak × MFU 0.4 = 3.956e14 FLOP/s per device; on 5: 4.3008e16 / 1.978e15 = 21.743 s
    assert t.mfu == 0.4 and t.seconds(5) == pytest.approx(21.743, rel=1e-4)
    assert t.seconds(10) == pytest.approx(21.743 / 2, rel=1e-4)
    # memory: 16 B/param × 7e9 = 112 GB over 0.75 × 80 GiB = 64.42 GB per device → 1.74 → 2 devices;
    # 70B: 1,120 GB / 64.42 GB = 17.4 → 18
    assert t.min_gpus == 2 and min_train_gpus(70e9, H800) == 18
    # the MFU the profile states is the one used: 0.2 doubles the step
    prof.train.mfu = 0.2
    assert size_trainer(prof, "H800", H800).seconds(5) == pytest.approx(2 * 21.743, rel=1e-4)
    # a measured step on 4 devices scales to the pool's size; without its devices it stays fixed
    prof.train = TrainProfile(train_s=30.0, gpus=4)
    assert size_trainer(prof, "H800", H800).seconds(8) == pytest.approx(15.0)
    prof.train = TrainProfile(train_s=30.0)
    assert size_trainer(prof, "H800", H800).seconds(8) == 30.0


def test_plan_lists_the_trainer_on_the_hand_computed_case() -> None:
    plan = make_plan(
        WorkloadProfile(model=MODEL, tasks=[TASK]), DEFAULT_CATALOGUE, gpus=8, classes=["H800"], mode="sync"
    )
    sync = plan.splits["sync"]
    assert plan.trainer.hw == "H800" and plan.trainer_gpus == sync.trainer_gpus
    assert sync.trainer_gpus + sync.rollout_gpus == 8
    assert sync.train_s == pytest.approx(4.3008e16 / (sync.trainer_gpus * 989e12 * 0.4))
    assert plan.stage_traj_per_s["training"] == pytest.approx(512 / sync.train_s)
    assert 0 < sync.train_busy < 1 and sync.train_busy == pytest.approx(sync.train_s / sync.step_s)


def _sizing(seconds_on_one: float) -> TrainerSizing:
    """A trainer whose step takes ``seconds_on_one / T`` on ``T`` devices."""
    return TrainerSizing("H800", 1, 1.0, 0.0, 1.0, 1.0, measured_s=seconds_on_one, measured_gpus=1)


def test_sync_minimises_the_sum_async_balances_the_stages() -> None:
    # 30 devices; rollout needs 100 GPU-s per step, training 400 GPU-s; no latency floor, no sync
    kw = {
        "min_trainer": 1,
        "min_rollout": 1,
        "gen_compute": lambda r: 100 / r,
        "latency_s": 0.0,
        "depth": 2,
        "trainer": _sizing(400.0),
        "push_s": 0.0,
        "sync_s": 0.0,
        "trajectories_per_step": 60,
    }
    sync = best_split("sync", 30, **kw)  # type: ignore[arg-type]
    # Sync+: 100/R + 400/T is least at T = 30·√400 / (√400 + √100) = 20: 10 s + 20 s
    assert (sync.trainer_gpus, sync.rollout_gpus) == (20, 10) and sync.step_s == pytest.approx(30.0)
    asyn = best_split("async", 30, **kw)  # type: ignore[arg-type]
    # async: max(100/R, 400/T) is least where they meet, T = 4R: T = 24, both 16.67 s
    assert (asyn.trainer_gpus, asyn.rollout_gpus) == (24, 6) and asyn.step_s == pytest.approx(100 / 6)
    assert asyn.traj_per_s == pytest.approx(60 / (100 / 6))
    assert sync.train_busy == pytest.approx(20 / 30) and asyn.train_busy == pytest.approx(1.0)
    # One-off overlaps like async but waits for the push and the update
    assert step_seconds("one_off", 10.0, 0.0, 8.0, 3.0, 1.0) == 12.0
    assert step_seconds("async", 10.0, 0.0, 8.0, 3.0, 1.0, depth=2) == 11.0
    # async, one step in flight: a group admitted at a batch starts after its training, push and
    # update, (0 + 8 + 3 + 1) / 1 = 12 s
    assert step_seconds("async", 10.0, 0.0, 8.0, 3.0, 1.0, depth=1) == 12.0
    assert step_seconds("sync", 10.0, 12.0, 8.0, 3.0, 1.0) == 24.0  # the latency floor: 12 s


def test_simulator_tells_sync_from_one_off_on_the_planned_split() -> None:
    plan = make_plan(
        WorkloadProfile(model=MODEL, tasks=[TASK]),
        DEFAULT_CATALOGUE,
        gpus=8,
        classes=["H800"],
        mode="sync",
        simulate_steps=6,
    )
    sim = {m: r.traj_per_s for m, r in plan.simulated.items()}
    assert sim["one_off"] > 1.3 * sim["sync"], sim  # the trainer's ~22 s overlap the next rollout
    for mode, r in plan.simulated.items():  # the closed form and the simulation agree here
        assert r.traj_per_s == pytest.approx(plan.splits[mode].traj_per_s, rel=0.15), mode
        assert r.train_busy > 0.5, (mode, r)


def test_small_batch_on_a_big_budget_is_latency_bound_not_generation_bound() -> None:
    """The plan never names generation the bottleneck while its devices sit idle."""
    small = TASK.model_copy(update={"trajectories_per_step": 64, "turns": 4})
    plan = make_plan(
        WorkloadProfile(model=MODEL, tasks=[small]), DEFAULT_CATALOGUE, gpus=128, simulate_steps=4
    )
    for sp in plan.splits.values():
        assert sp.bottleneck != "generation" or sp.gen_busy > 0.5, sp
    assert plan.bottleneck == "trajectory latency" and "training" in plan.stage_traj_per_s
    assert plan.enough_gpus is not None and plan.enough_gpus < 128  # fewer GPUs do as well


def test_a_model_or_budget_that_cannot_work_is_one_clear_error() -> None:
    huge = WorkloadProfile(model=ModelProfile(params=1e12), tasks=[TASK])
    with pytest.raises(ConfigError, match=r"fits no GPU class.*2 bytes/param × 1e\+12 = 2e\+03 GB"):
        make_plan(huge, DEFAULT_CATALOGUE)
    prof = WorkloadProfile(model=MODEL, tasks=[TASK])
    with pytest.raises(ConfigError, match=r"--gpus 2 is too small.*at least 2 H800.*rollout 1.*--gpus 3"):
        make_plan(prof, DEFAULT_CATALOGUE, gpus=2, classes=["H800"])
    tiny = WorkloadProfile(model=ModelProfile(params=1e8), tasks=[TASK])
    with pytest.raises(ConfigError, match=r"--gpus 1 is too small.*at least 1 H800.*rollout 1"):
        make_plan(tiny, DEFAULT_CATALOGUE, gpus=1)
    # 60B: its weights fit one H200 for generation (120 GB); training needs 16 × 60e9 = 960 GB over
    # 0.75 × 141 GiB = 113.5 GB per device → 8.5 → 9, plus one engine
    big = WorkloadProfile(
        model=ModelProfile(params=60e9), tasks=[TASK.model_copy(update={"prompt_tokens": 10})]
    )
    with pytest.raises(ConfigError, match=r"at least 9 H200.*give --gpus 10 or more"):
        make_plan(big, DEFAULT_CATALOGUE, gpus=8, classes=["H200"])
    with pytest.raises(ConfigError, match="trainer class 'CPU' is not a GPU class"):
        make_plan(prof, DEFAULT_CATALOGUE, train_class="CPU")


def test_parameters_counted_from_a_model_directory() -> None:
    smollm2 = {  # SmolLM2-135M-Instruct's config.json: tied embeddings, 3 KV heads of 64
        "model_type": "llama",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_attention_heads": 9,
        "num_hidden_layers": 30,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
    }
    m = ModelProfile.from_hf_config(smollm2)
    # 49,152 × 576 + 30 × (2·576·576 + 2·576·192 + 3·576·1536 + 2·576) + 576 = 134,515,008
    assert m.params == 134_515_008 and (m.num_layers, m.num_kv_heads, m.head_dim) == (30, 3, 64)
    with pytest.raises(ConfigError, match="hidden_size"):
        ModelProfile.from_hf_config({"vocab_size": 1})


# the command line ----------------------------------------------------------------------------------


def _config(tmp_path: Path, model_dir: Path) -> Path:
    cfg = RunConfig.model_validate(
        {
            "model": {"path": str(model_dir)},
            "engines": [{"name": "gen", "impl": "vllm", "options": {"x": 1}}],
            "trainer": {"impl": "torch", "options": {"lr": 0.001}},
            "tasks": [
                {
                    "name": "t",
                    "env": {"impl": "frozenlake"},
                    "reward": {"impl": "success"},
                    "group_size": 8,
                    "groups_per_step": 64,
                    "sampling": {"max_tokens": 512},
                }
            ],
            "loop": {"mode": "async", "alpha": 1},
        }
    )
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    return path


def test_cli_first_line_says_defaults_and_the_model_comes_from_its_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    shapes = {"hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32}
    (model_dir / "config.json").write_text(
        json.dumps({**shapes, "num_hidden_layers": 32, "vocab_size": 32000})
    )
    path = _config(tmp_path, model_dir)
    assert main(["plan", str(path), "--gpus", "16"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("PLAN FROM DEFAULTS, not a measured profile"), out[0]
    assert "model 6.74e+09 params (" in out[0] and "config.json" in out[0]  # a Llama-2-7B's shapes
    assert any(line.startswith("training: H800 × ") for line in out)
    assert main(["plan", str(path), "--gpus", "16", "--params", "1.5e9", "--train-mfu", "0.25"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "model 1.5e+09 params (--params" in first and "trainer MFU 0.25" in first
    measured = tmp_path / "measured.json"
    prof = WorkloadProfile(
        model=MODEL, tasks=[TASK.model_copy(update={"name": "t"})], measured={"traj_per_s": 3.0}
    )
    measured.write_text(prof.model_dump_json())
    assert main(["plan", str(path), "--gpus", "16", "--profile", str(measured)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith(f"plan from the profile {measured} (measured)") and "model 7e+09" in first


def test_cli_write_config_round_trip_with_the_trainer_pool(tmp_path: Path) -> None:
    path = _config(tmp_path, tmp_path / "absent")
    out = tmp_path / "planned.yaml"
    for mode in ("sync", "async"):
        assert main(["plan", str(path), "--gpus", "24", "--mode", mode, "--write-config", str(out)]) == 0
        planned = load_config(out)  # validates as a RunConfig
        assert planned.trainer.group and planned.trainer.pool == "H800" and planned.trainer.num_gpus == 1
        assert planned.trainer.options == {"lr": 0.001}
        ranks = planned.trainer.ranks or 0
        assert ranks >= 2 and ranks + sum(e.count for e in planned.engines) == 24
        assert all(e.pool is not None for e in planned.engines)
        assert f"{ranks} trainer + {24 - ranks} rollout GPUs" in out.read_text().splitlines()[0]


def test_rollout_latency_waits_for_the_slowest_group() -> None:
    from rollart_core.plan.planner import _choose, rollout_latency
    from rollart_core.plan.workload import LatencyDist

    const = TaskProfile(
        name="c",
        trajectories_per_step=64,
        turns=4,
        env_latency_s=LatencyDist(mean=1.0),
        generate_s=LatencyDist(mean=0.5),
    )
    prof = WorkloadProfile(model=MODEL, tasks=[const])
    plans = [_choose(const, MODEL, DEFAULT_CATALOGUE, None)]
    # 5 env calls of 1 s + 4 turns of 0.5 s = 7 s, for every group and so for the step
    assert rollout_latency(prof, plans, DEFAULT_CATALOGUE) == (pytest.approx(7.0), pytest.approx(7.0))
    tail = const.model_copy(update={"env_latency_s": LatencyDist(mean=1.0, dist="lognormal", sigma=1.5)})
    group_s, step_s = rollout_latency(WorkloadProfile(model=MODEL, tasks=[tail]), plans, DEFAULT_CATALOGUE)
    # a group waits for its slowest member (8 of 8), the step for its slowest of 8 groups
    assert step_s > 1.5 * group_s and group_s > 7.0
    capped = tail.model_copy(update={"env_timeout_s": 2.0})
    _, capped_s = rollout_latency(WorkloadProfile(model=MODEL, tasks=[capped]), plans, DEFAULT_CATALOGUE)
    assert capped_s < step_s and capped_s <= 5 * 2.0 + 4 * 0.5
    # measured turns need no roofline; a task without them does
    assert rollout_latency(prof) == rollout_latency(prof, plans, DEFAULT_CATALOGUE)
    roofline = const.model_copy(update={"generate_s": None})
    with pytest.raises(ValueError, match="'c' has no generate_s"):
        rollout_latency(WorkloadProfile(model=MODEL, tasks=[roofline]))
