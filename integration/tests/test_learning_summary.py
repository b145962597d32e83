"""The learning bench's arithmetic (``integration/bench/learning.py``): what the time-to-train
figures are computed from. Synthetic curves; no run."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from rollart_core.config import ComponentConfig, RunConfig

BENCH = Path(__file__).resolve().parents[1] / "bench" / "learning.py"


@pytest.fixture(scope="module")
def learning() -> ModuleType:
    spec = importlib.util.spec_from_file_location("learning_bench", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _curve(evals: list[tuple[float, float]], step_s: float = 1.0) -> list[dict]:
    """Points with an evaluation (wall_s, success) each; steps one per ``step_s``."""
    return [
        {"step": i + 1, "wall_s": t, "episodes": 64 * (i + 1), "eval_success": s}
        for i, (t, s) in enumerate(evals)
    ]


def test_censored_sync_gives_a_lower_bound_and_the_median_counts_it(learning: ModuleType) -> None:
    runs = [
        # seed 0: sync reaches 0.8 at 300 s, async at 100 s
        {"mode": "sync", "seed": 0, "points": _curve([(100, 0.2), (300, 0.8), (500, 0.9)]), "cpu_busy": 0.9},
        {
            "mode": "async_a1",
            "seed": 0,
            "points": _curve([(50, 0.3), (100, 0.85), (200, 0.9)]),
            "cpu_busy": 0.8,
        },
        # seed 1: sync never reaches 0.8 in the 600 s budget; async at 200 s
        {"mode": "sync", "seed": 1, "points": _curve([(200, 0.3), (550, 0.6)]), "cpu_busy": 0.9},
        {"mode": "async_a1", "seed": 1, "points": _curve([(100, 0.5), (200, 0.8)]), "cpu_busy": 0.8},
    ]
    rows = learning.summarise(runs, ["sync", "async_a1"], 0.8, 600.0)
    sync_t = rows["sync"]["s_to_target"]
    assert sync_t["values"] == [300.0, None] and sync_t["censored"] == 1
    assert sync_t["median"] is None  # one of two never reached it: the median is above the budget
    ups = rows["async_a1"]["speedup_to_target"]
    assert [u["speedup_to_target"] for u in ups["per_seed"]] == [3.0, 3.0]
    assert [u["lower_bound"] for u in ups["per_seed"]] == [False, True] and ups["any_lower_bound"]
    # the same seed's sync final success (median of its last three evaluations) is the bar
    assert rows["async_a1"]["s_to_sync_final"]["values"] == [100.0, 100.0]
    assert rows["async_a1"]["final_minus_sync"]["values"] == pytest.approx([0.05, 0.2])


def test_training_time_leaves_out_the_start_up_before_the_first_step(learning: ModuleType) -> None:
    def with_start(t0: float, evals: list[tuple[float, float]]) -> list[dict]:
        return [{"step": 0, "wall_s": t0, "episodes": 0, "eval_success": 0.0}, *_curve(evals)]

    runs = [  # the step-0 evaluation logged at 40 s (sync) and 30 s (async)
        {"mode": "sync", "seed": 0, "points": with_start(40, [(340, 0.8)]), "cpu_busy": 0.9},
        {"mode": "async_a1", "seed": 0, "points": with_start(30, [(130, 0.85)]), "cpu_busy": 0.8},
        # seed 1: sync never reaches the bar: its training budget is 600 - 40 s
        {"mode": "sync", "seed": 1, "points": with_start(40, [(500, 0.5)]), "cpu_busy": 0.9},
        {"mode": "async_a1", "seed": 1, "points": with_start(40, [(180, 0.8)]), "cpu_busy": 0.8},
    ]
    rows = learning.summarise(runs, ["sync", "async_a1"], 0.8, 600.0)
    assert rows["async_a1"]["train_s_to_target"]["values"] == [100.0, 140.0]
    assert rows["sync"]["train_s_to_target"]["values"] == [300.0, None]
    ups = rows["async_a1"]["training_speedup_to_target"]["per_seed"]
    assert [u["training_speedup_to_target"] for u in ups] == pytest.approx([3.0, 4.0])
    assert [u["training_lower_bound"] for u in ups] == [False, True]
    # from the command's start the same runs give 340/130 and >= 600/180
    assert [u["speedup_to_target"] for u in ups] == pytest.approx([340 / 130, 600 / 180])


def test_env_latency_wraps_training_envs_and_keeps_evaluation_plain(learning: ModuleType) -> None:
    cfg = RunConfig.model_validate(
        {
            "name": "t",
            "model": {"path": "m"},
            "engines": [{"name": "gen", "impl": "vllm"}],
            "tasks": [
                {
                    "name": "lake",
                    "env": {"impl": "frozenlake", "options": {"size": 4}},
                    "reward": {"impl": "success"},
                }
            ],
            "trainer": {"impl": "torch"},
        }
    )
    wrapped = learning.with_env_latency(cfg, 0.3, 1.0, seed=7)
    task = wrapped.tasks[0]
    assert task.env.impl == "straggler" and task.env.options["env"]["impl"] == "frozenlake"
    assert task.env.options["faults"] == {"seed": 7, "step_latency_s": 0.3, "step_latency_sigma": 1.0}
    assert task.eval_env is not None and task.eval_env.impl == "frozenlake"
    assert cfg.tasks[0].env.impl == "frozenlake"  # the input config is left alone
    assert learning.with_env_latency(cfg, 0.0, 1.0, seed=7) is cfg
    paired = learning.with_env_latency(cfg, 0.3, 1.0, seed=7, paired_scope="sync/seed7")
    assert paired.tasks[0].env.options["paired_scope"] == "sync/seed7"

    agent = cfg.model_copy(deep=True)
    agent.tasks[0].env = ComponentConfig(impl="agent", options={"entry": "a.py:solve", "task_data": {"k": 1}})
    slow = learning.with_env_latency(agent, 2.0, 0.5, seed=7, paired_scope="sync/seed7")
    env = slow.tasks[0].env  # an agent's episode is one call: the latency goes to its tools
    assert env.impl == "agent" and env.options["entry"] == "a.py:solve"
    assert env.options["task_data"] == {"k": 1, "tool_latency_s": 2.0, "tool_latency_sigma": 0.5}
    assert slow.tasks[0].eval_env is not None and "task_data" in slow.tasks[0].eval_env.options
    assert slow.tasks[0].eval_env.options["task_data"] == {"k": 1}  # held-out evaluation is not slowed
    assert agent.tasks[0].env.options["task_data"] == {"k": 1}


def test_task_options_set_every_task_and_bad_ones_are_refused(learning: ModuleType) -> None:
    task = {
        "env": {"impl": "frozenlake"},
        "reward": {"impl": "success"},
        "group_size": 8,
        "groups_per_step": 8,
    }
    cfg = RunConfig.model_validate(
        {
            "name": "t",
            "model": {"path": "m"},
            "engines": [{"name": "gen", "impl": "vllm"}],
            "tasks": [{"name": "a", **task}, {"name": "b", **task, "group_size": 2}],
            "trainer": {"impl": "torch"},
        }
    )
    shaped = learning.with_task_options(cfg, {"group_size": 4, "groups_per_step": 16})
    assert [(t.group_size, t.groups_per_step) for t in shaped.tasks] == [(4, 16), (4, 16)]
    assert [t.group_size for t in cfg.tasks] == [8, 2]  # the input config is left alone
    assert learning.with_task_options(cfg, {}) is cfg
    with pytest.raises(ValueError, match="group_sizee"):
        learning.with_task_options(cfg, {"group_sizee": 4})
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        learning.with_task_options(cfg, {"group_size": 0})
    args = learning.argparse.Namespace(task_options={"group_size": 4}, async_task_options={"group_size": 2})
    assert learning._task_options(args, "sync") == {"group_size": 4}
    assert learning._task_options(args, "async") == {"group_size": 2}


def test_runs_of_different_budgets_time_the_bar_whole_and_compare_finals_at_the_shorter(
    learning: ModuleType,
) -> None:
    runs = [
        # a 1500 s Sync+ run: past the async runs' 840 s it reaches 0.8 (at 1200 s) and then 0.95
        {
            "mode": "sync",
            "seed": 0,
            "budget_s": 1500.0,
            "points": _curve([(300, 0.5), (600, 0.6), (800, 0.7), (1200, 0.8), (1400, 0.95), (1490, 0.95)]),
            "cpu_busy": 0.9,
        },
        {
            "mode": "async_a1",
            "seed": 0,
            "budget_s": 840.0,
            "points": _curve([(200, 0.6), (400, 0.8), (600, 0.8), (820, 0.85)]),
            "cpu_busy": 0.8,
        },
        # seed 1: the long Sync+ run never reaches 0.8 either: the bound is its own 1500 s
        {
            "mode": "sync",
            "seed": 1,
            "budget_s": 1500.0,
            "points": _curve([(700, 0.5), (1450, 0.7)]),
            "cpu_busy": 0.9,
        },
        {"mode": "async_a1", "seed": 1, "budget_s": 840.0, "points": _curve([(500, 0.8)]), "cpu_busy": 0.8},
    ]
    rows = learning.summarise(runs, ["sync", "async_a1"], 0.8, 840.0)
    assert rows["sync"]["s_to_target"]["values"] == [1200.0, None]
    ups = rows["async_a1"]["speedup_to_target"]["per_seed"]
    assert [u["speedup_to_target"] for u in ups] == pytest.approx([3.0, 1500 / 500])
    assert [u["lower_bound"] for u in ups] == [False, True]
    # finals at the shorter budget (840 s): Sync+ seed 0 had 0.5/0.6/0.7 by then (median 0.6), not 0.95
    assert rows["sync"]["final_success"]["values"] == [0.6, 0.5]
    assert rows["async_a1"]["final_minus_sync"]["values"] == pytest.approx([0.2, 0.3])
    # ... and the Sync+ final that async is timed to is that 0.6: reached at 200 s
    assert rows["async_a1"]["s_to_sync_final"]["values"] == [200.0, 500.0]


def test_merge_refuses_files_of_different_task_options(
    learning: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def write(name: str, task_options: dict[str, int]) -> str:
        cmd = {
            "config": "c.yaml",
            "env_latency": 0.3,
            "env_sigma": 1.0,
            "minutes": 1.0,
            "task_options": task_options,
        }
        path = tmp_path / name
        path.write_text(learning.json.dumps({"command": cmd, "runs": []}))
        return str(path)

    a, b = write("a.json", {"group_size": 4}), write("b.json", {"group_size": 2})
    monkeypatch.setattr("sys.argv", ["learning.py", "--merge", a, b, "--out", str(tmp_path / "out")])
    with pytest.raises(SystemExit):
        learning.main()
    assert "different workloads" in capsys.readouterr().err
