"""DatasetEnv: loading (JSONL, Parquet, once per process), seeds → rows, epochs, the train/held-out
split, single- and multi-turn episodes, and every bad input as a ConfigError naming file, row and key."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from rollart_core.control.rollout import derive_seed
from rollart_core.errors import ConfigError
from rollart_core.registry import build, resolve
from rollart_core.types import Trajectory, Turn
from rollart_env import dataset
from rollart_env.dataset import DatasetEnv, extract_reply, load_rows, permute

ROOT = Path(__file__).resolve().parents[3]
DIGITS = list("0123456789")


def _write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _rows(n: int) -> list[dict[str, Any]]:
    return [{"id": f"q{i}", "prompt": f"What is {i} mod 10?", "answer": i % 10, "extra": i} for i in range(n)]


def _env(path: Path, **options: Any) -> DatasetEnv:
    return build("env", "dataset", {"path": str(path), **options}, "tasks.0.env.options")


@pytest.fixture
def data(tmp_path: Path) -> Path:
    return _write_jsonl(tmp_path / "d.jsonl", _rows(50))


def test_entry_point_resolves() -> None:
    assert resolve("env", "dataset") is DatasetEnv


async def test_single_turn_episode_carries_the_reference(data: Path) -> None:
    env = _env(data, split="all", match="number", info_keys=["extra"])
    obs, info = await env.reset(7)
    row = json.loads(data.read_text().splitlines()[info["row"]])
    assert obs == row["prompt"] == info["question"]
    assert info["answer"] == row["answer"] and info["extra"] == row["extra"]
    assert info["location"] == f"line {info['row'] + 1}" and info["split"] == "train"
    right = await env.step(f"The answer is {row['answer']}.")
    assert right.terminated and right.info["success"] and right.reward == 1.0
    await env.reset(7)
    wrong = await env.step(str(row["answer"] + 1))
    assert wrong.terminated and wrong.info["success"] is False and wrong.reward == 0.0
    with pytest.raises(RuntimeError):
        await env.step("1")


async def test_the_reference_is_where_rollart_rewards_read_it(data: Path) -> None:
    """number_match / exact_match read info['answer'] and the last turn's reply (rollart-reward)."""
    from rollart_reward.rewards import ExactMatchReward, NumberMatchReward

    env = _env(data, answer_key="answer", split="all")
    _, info = await env.reset(3)
    traj = Trajectory("t", "arith", "dataset", "g", 3, 0)
    traj.info.update(info)
    traj.turns.append(Turn(context_ids=[1], action_text=f"so \\boxed{{{info['answer']}}}"))
    assert (await NumberMatchReward().score(traj)).score == 1.0
    assert (await ExactMatchReward().score(traj)).score == 1.0
    traj.turns[-1].action_text = str(info["answer"] + 1)
    assert (await NumberMatchReward().score(traj)).score == 0.0


async def test_reset_is_deterministic_and_shuffle_seed_reorders(data: Path) -> None:
    a, b = _env(data, split="all"), _env(data, split="all")
    assert [a.pick(s) for s in range(200)] == [b.pick(s) for s in range(200)]
    assert (await a.reset(12345))[0] == (await b.reset(12345))[0]
    other = _env(data, split="all", shuffle_seed=1)
    assert [a.pick(s)[0] for s in range(50)] != [other.pick(s)[0] for s in range(50)]


def test_consecutive_seeds_visit_every_row_once_per_epoch(data: Path) -> None:
    env = _env(data, split="train", heldout_size=10)
    n = len(env.train_rows)
    assert n == 40
    epochs = [[env.pick(e * n + k) for k in range(n)] for e in range(3)]
    for e, picks in enumerate(epochs):
        assert sorted(r for r, _, _ in picks) == sorted(env.train_rows)
        assert {ep for _, _, ep in picks} == {e} and {s for _, s, _ in picks} == {"train"}
    assert [r for r, _, _ in epochs[0]] != [r for r, _, _ in epochs[1]]  # each epoch in a fresh order


@pytest.mark.parametrize("n", [1, 2, 3, 5, 17, 64, 1000])
def test_permute_is_a_permutation(n: int) -> None:
    assert sorted(permute(i, n, "k") for i in range(n)) == list(range(n))
    with pytest.raises(ValueError):
        permute(n, n, "k")


def test_train_and_heldout_are_disjoint_and_stable(data: Path, tmp_path: Path) -> None:
    train = _env(data, split="train", heldout_fraction=0.3)
    held = _env(data, split="heldout", heldout_fraction=0.3)
    assert set(train.train_rows).isdisjoint(train.heldout_rows)
    assert sorted(train.train_rows + train.heldout_rows) == list(range(50))
    assert 5 <= len(train.heldout_rows) <= 25
    assert {train.pick(s)[0] for s in range(10_000)} == set(train.train_rows)
    assert {held.pick(s)[0] for s in range(10_000)} == set(train.heldout_rows)
    assert len(_env(data, heldout_size=7).heldout_rows) == 7
    # by id_key, the split follows the rows when the file is reordered and extended
    by_id = _env(data, id_key="id", heldout_size=7)
    held_ids = {f"q{i}" for i in by_id.heldout_rows}
    shuffled = _write_jsonl(tmp_path / "shuffled.jsonl", _rows(50)[::-1])
    again = _env(shuffled, id_key="id", heldout_size=7)
    assert {f"q{49 - i}" for i in again.heldout_rows} == held_ids


async def test_auto_split_serves_heldout_rows_to_rollart_eval_seeds(data: Path) -> None:
    env = _env(data, heldout_size=10)  # split: auto
    eval_rows = []
    for e in range(10):
        _, info = await env.reset(derive_seed("heldout", 0, e))  # the seeds of control.train.evaluate
        assert info["split"] == "heldout"
        eval_rows.append(info["row"])
    assert sorted(eval_rows) == sorted(env.heldout_rows)  # episode e: the e-th held-out row, all distinct
    for n in range(100):  # rollout's training seeds
        _, info = await env.reset(derive_seed(0, "s", n, 0))
        assert info["split"] == "train" and info["row"] in env.train_rows


async def test_multi_turn_feedback_until_max_turns(data: Path) -> None:
    env = _env(
        data,
        split="all",
        match="number",
        max_turns=3,
        feedback_template="Your answer {answer} is wrong ({turns_left} left). Try again.",
    )
    _, info = await env.reset(0)
    wrong = (info["answer"] + 1) % 10
    first = await env.step(f"I think {wrong}")
    assert not first.terminated and not first.truncated
    assert first.observation == f"Your answer {wrong} is wrong (2 left). Try again."
    second = await env.step("no idea")
    assert second.observation == "Your answer (none) is wrong (1 left). Try again." and not second.terminated
    third = await env.step(str(wrong))
    assert third.terminated and third.info == {"success": False, "attempts": 3, "extracted": str(wrong)}
    # a right answer ends the episode at once
    await env.reset(0)
    await env.step(str(wrong))
    right = await env.step(f"<answer>{info['answer']}</answer>")
    assert right.terminated and right.info["success"] and right.info["attempts"] == 2


def test_extract_reply_bounded_and_tagged() -> None:
    assert extract_reply("first 3 then 4", "number") == "4"
    assert extract_reply("<answer>7</answer> and 9", "number") == "7"
    assert extract_reply("x \\boxed{1,000}", "number") == "1000"
    assert extract_reply("nothing", "number") is None
    assert extract_reply("  Paris. ", "exact") == "Paris"
    assert extract_reply("9" * 100_000, "number") is not None  # only the tail is parsed, bounded


async def test_exact_match_and_action_vocabulary(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "caps.jsonl", [{"q": "Capital of France?", "a": "Paris"}] * 3)
    env = _env(path, prompt_key="q", answer_key="a", split="all", match="exact", system_prompt="Be brief.")
    assert env.system_prompt == "Be brief." and env.action_vocabulary is None
    _, info = await env.reset(0)
    assert info["answer"] == info["a"] == "Paris"
    assert (await env.step(" paris.")).info["success"]
    one_digit = _write_jsonl(tmp_path / "digits.jsonl", _rows(20))
    assert _env(one_digit, split="all", action_vocabulary=DIGITS).action_vocabulary == tuple(DIGITS)


async def test_parquet_loading(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(_rows(30)), path)
    env = _env(path, split="all", match="number", id_key="id")
    _, info = await env.reset(4)
    assert info["location"] == f"row {info['row'] + 1}" and info["answer"] == info["row"] % 10
    assert (await env.step(str(info["answer"]))).info["success"]
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"PAR1 not really")
    with pytest.raises(ConfigError, match=r"broken\.parquet: not a readable Parquet file"):
        _env(broken)
    missing = tmp_path / "nokey.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "p"}]), missing)
    with pytest.raises(ConfigError, match=r"nokey\.parquet, row 1: no key 'answer'"):
        _env(missing, split="all")


def test_parquet_without_pyarrow_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from rollart_core.errors import MissingExtraError

    path = tmp_path / "x.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # an absent module: import raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(MissingExtraError, match=r"pip install 'rollart-env\[parquet\]'"):
        _env(path)


def test_file_read_once_per_process_and_again_when_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _write_jsonl(tmp_path / "once.jsonl", _rows(20))
    reads: list[str] = []
    real = dataset._read_jsonl

    def counting(p: str) -> list:
        reads.append(p)
        return real(p)

    monkeypatch.setattr(dataset, "_read_jsonl", counting)
    envs = [_env(path, split="all") for _ in range(100)]  # one env per trajectory, as the runner does
    assert len(reads) == 1 and all(e.train_rows == envs[0].train_rows for e in envs)
    _write_jsonl(path, _rows(30))
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a new modification time for sure
    assert len(_env(path, split="all").train_rows) == 30 and len(reads) == 2
    assert len(load_rows(path)) == 30 and len(reads) == 2


BAD_FILES = [
    ("missing", None, "cannot read the file"),
    ("empty", "", "holds no rows"),
    ("blank", "\n\n  \n", "holds no rows"),
    ("bad_json", '{"prompt": "a", "answer": 1}\n{"prompt": \n', r"line 2: not valid JSON"),
    ("not_object", '{"prompt": "a", "answer": 1}\n[1, 2]\n', "line 2: a row must be a JSON object, got list"),
    ("no_answer", '{"prompt": "a", "answer": 1}\n\n{"prompt": "b"}\n', r"line 3: no key 'answer'"),
    ("no_prompt", '{"answer": 1}\n', r"line 1: no key 'prompt'"),
    ("prompt_not_str", '{"prompt": 5, "answer": 1}\n', r"line 1: 'prompt' must be a non-empty string"),
]


@pytest.mark.parametrize(("name", "content", "message"), BAD_FILES, ids=[b[0] for b in BAD_FILES])
def test_bad_files_name_file_row_and_key(
    tmp_path: Path, name: str, content: str | None, message: str
) -> None:
    path = tmp_path / f"{name}.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=message) as err:
        _env(path, split="all")
    assert f"{name}.jsonl" in str(err.value)


def test_bad_file_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "latin.jsonl"
    path.write_bytes(b'{"prompt": "caf\xe9", "answer": 1}\n')
    with pytest.raises(ConfigError, match=r"latin\.jsonl: not UTF-8"):
        _env(path, split="all")


def test_bad_rows_for_the_chosen_options(tmp_path: Path) -> None:
    path = _write_jsonl(
        tmp_path / "d.jsonl",
        [{"prompt": "a", "answer": 3}, {"prompt": "b", "answer": "x"}, {"prompt": "c", "answer": 12}],
    )
    with pytest.raises(ConfigError, match=r"d\.jsonl, line 2: 'answer' = 'x' is not a number"):
        _env(path, split="all", match="number")
    with pytest.raises(ConfigError, match=r"line 2: 'answer' = 'x' is not in the action_vocabulary"):
        _env(path, split="all", action_vocabulary=DIGITS)
    with pytest.raises(ConfigError, match=r"line 1: no key 'id'"):
        _env(path, split="all", id_key="id")
    dup = _write_jsonl(tmp_path / "dup.jsonl", [{"id": 1, "prompt": "a", "answer": 1}] * 2)
    with pytest.raises(ConfigError, match="id_key 'id' are not unique"):
        _env(dup, split="all", id_key="id")
    with pytest.raises(ConfigError, match="leaves no training rows"):
        _env(path, heldout_size=3)
    with pytest.raises(ConfigError, match="no row is held out"):
        _env(path, split="heldout", heldout_fraction=0.0)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"path": "d.csv"}, "a .jsonl or .parquet file"),
        ({"path": "d.jsonl", "colour": 1}, "colour"),
        ({"path": "d.jsonl", "max_turns": 2}, "needs a feedback_template"),
        ({"path": "d.jsonl", "max_turns": 2, "feedback_template": "again"}, "needs match"),
        ({"path": "d.jsonl", "feedback_template": "again", "match": "number"}, "needs max_turns >= 2"),
        (
            {"path": "d.jsonl", "max_turns": 2, "match": "number", "feedback_template": "{reference}"},
            "unknown field",
        ),
        (
            {"path": "d.jsonl", "max_turns": 2, "match": "number", "feedback_template": "{answer"},
            "not a format string",
        ),
        ({"path": "d.jsonl", "action_vocabulary": ["1", "1"]}, "without repeats"),
        ({"path": "d.jsonl", "heldout_fraction": 1.0}, "heldout_fraction"),
        ({"path": "d.jsonl", "split": "all", "heldout_size": 3}, "split: all has no held-out rows"),
    ],
)
def test_invalid_options_are_config_errors(options: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build("env", "dataset", options, "tasks.0.env.options")


async def test_example_data_set_is_learnable_by_a_digit_policy() -> None:
    """examples/data/arith.jsonl: one-digit answers, uniform, distinct prompts, 200 held out."""
    path = ROOT / "examples" / "data" / "arith.jsonl"
    env = _env(path, id_key="id", heldout_size=200, match="number", action_vocabulary=DIGITS)
    rows = [row for row, _ in load_rows(path)]
    assert len(rows) >= 2000 and len({r["prompt"] for r in rows}) == len(rows)
    counts = [sum(r["answer"] == d for r in rows) for d in range(10)]
    assert max(counts) < 0.13 * len(rows)  # no constant digit is right much more often than 1 in 10
    assert len(env.heldout_rows) == 200


def test_sums_data_set_is_the_generators_output(tmp_path: Path) -> None:
    """examples/data/sums.jsonl (examples/dataset_math.yaml): exactly what make_arith.py --kind sums
    writes; every one-digit sum under every name, distinct prompts, 64 held out by id."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_arith", ROOT / "examples" / "data" / "make_arith.py")
    assert spec is not None and spec.loader is not None
    make_arith = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_arith)
    make_arith.main(["--kind", "sums", "--out", str(tmp_path / "sums.jsonl")])
    path = ROOT / "examples" / "data" / "sums.jsonl"
    assert (tmp_path / "sums.jsonl").read_bytes() == path.read_bytes()
    rows = [row for row, _ in load_rows(path)]
    assert len({r["prompt"] for r in rows}) == len(rows) == 55 * len(make_arith.NAMES)
    assert all(r["a"] + r["b"] == r["answer"] <= 9 and f"{r['a']} plus {r['b']}" in r["prompt"] for r in rows)
    env = _env(path, id_key="id", heldout_size=64, match="number", action_vocabulary=DIGITS)
    assert len(env.heldout_rows) == 64


@pytest.mark.parametrize(
    "case,words",
    [
        ("missing", ["nope.jsonl", "cannot read the file"]),
        ("empty", ["empty.jsonl", "holds no rows"]),
        ("no_key", ["keyless.jsonl", "line 2", "no key 'answer'"]),
    ],
)
async def test_a_bad_data_set_stops_check_config_train_and_the_pipeline_at_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str, words: list[str]
) -> None:
    """Before anything starts (no model made, no Ray, no engine): one line naming the task's options,
    the file, the row and the key, exit code 2 from the CLI."""
    import yaml

    from rollart_core.cli import main
    from rollart_core.config import load_config
    from rollart_core.control.pipeline import Pipeline

    paths = {
        "missing": tmp_path / "nope.jsonl",
        "empty": tmp_path / "empty.jsonl",
        "no_key": _write_jsonl(tmp_path / "keyless.jsonl", [_rows(1)[0], {"prompt": "What is 3?"}]),
    }
    paths["empty"].write_text("\n")
    cfg = yaml.safe_load((ROOT / "examples" / "dataset_math.yaml").read_text())
    cfg["model"] = {"path": str(tmp_path / "model"), "create_tiny": True}
    cfg["output_dir"] = str(tmp_path / "run")
    cfg["tasks"][0]["env"]["options"] = {"path": str(paths[case]), "split": "all"}
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump(cfg))
    for command in ("check-config", "train"):
        rc = main([command, str(config)])
        out, err = capsys.readouterr()
        assert rc == 2 and "Traceback" not in out + err, (out, err)
        assert len(err.strip().splitlines()) == 1 and err.startswith("rollart: error: tasks.0.env.options: ")
        assert all(w in err for w in words), err
    assert not (tmp_path / "run").exists() and not (tmp_path / "model").exists()
    pipeline = Pipeline(load_config(config))
    with pytest.raises(ConfigError, match=words[-1]):
        await pipeline.__aenter__()
    assert pipeline.timings == {} and not (tmp_path / "model").exists()  # failed before any phase
