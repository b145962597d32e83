"""A run's trajectories on disk (``loop.export_trajectories``) and their export as one table, on
hand-made trajectories: the rows, both formats, the readers that need no rollart, crash safety and
resume, the error for a run without trajectories. A real run: integration/tests/test_trajectory_export.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollart_core.cli import main
from rollart_core.errors import ConfigError
from rollart_core.trajectories import COLUMNS, TrajectoryLog, export_trajectories, trajectory_rows
from rollart_core.types import Fate, Trajectory, Turn


def traj(tid: str, group: str, versions: list[int], fate: Fate = Fate.FINISHED) -> Trajectory:
    t = Trajectory(tid, "lake", "frozenlake", group, 7, min(versions))
    t.turns = [
        Turn([1, 2, 3], [10, 11], [-0.5, -0.25], versions[:2], "length", "ab"),
        Turn([4], [12], [-1.0], versions[2:], "stop", "c"),
    ]
    t.reward, t.fate, t.terminated = 1.0, fate, True
    t.timings = {"generate": 0.5, "total": 1.5}
    t.info = {"success": True, "reward_details": {"source": "env", "hit": 1}, "turns": 2}
    return t


def decode(ids: object) -> str:
    return " ".join(str(i) for i in ids)  # type: ignore[attr-defined]


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    log = TrajectoryLog(run, decode)
    log.write_lines(1, log.lines(1, [traj("a", "g1", [0, 0, 0]), traj("b", "g1", [0, 1, 1])]))
    log.write_lines(2, log.lines(2, [traj("c", "g2", [1, 1, 1], Fate.ABORTED_STALE)]))
    rows = [
        {"step": 1, "version": 1, "batch_traj_ids": ["a"], "batch_start_versions": [0]},
        {"step": 2, "version": 2, "batch_traj_ids": ["b"], "batch_start_versions": [0]},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3, "ver')
    return run


def test_rows_are_flat_and_complete(run_dir: Path) -> None:
    rows = list(trajectory_rows(run_dir))
    assert [r["traj_id"] for r in rows] == ["a", "b", "c"] and all(set(r) == set(COLUMNS) for r in rows)
    a, b, c = rows
    assert a["prompt_ids"] == [1, 2, 3] and a["response_ids"] == [10, 11, 4, 12]
    assert a["response_mask"] == [1, 1, 0, 1] and a["logprobs"] == [-0.5, -0.25, 0.0, -1.0]
    assert b["versions"] == [0, 1, -1, 1] and (b["min_version"], b["max_version"]) == (0, 1)
    assert (a["trained_step"], b["trained_step"], c["trained_step"]) == (1, 2, None)  # torn line skipped
    assert (a["step"], c["step"], c["fate"]) == (1, 2, "aborted_stale")
    assert json.loads(a["reward_details"]) == {"source": "env", "hit": 1} and a["success"] is True
    assert json.loads(a["timings"]) == {"generate": 0.5, "total": 1.5} and a["total_s"] == 1.5
    assert json.loads(a["info"]) == {"success": True, "turns": 2}
    assert a["prompt_text"] == "1 2 3" and a["response_text"] == "10 11 4 12"
    assert a["turn_context_lens"] == [3, 1] and a["turn_output_lens"] == [2, 1]
    assert a["finish_reasons"] == ["length", "stop"] and a["turn_new_sequence"] == [False, False]


def test_jsonl_and_parquet_read_back_without_rollart(run_dir: Path) -> None:
    path, n = export_trajectories(run_dir)
    assert path == run_dir / "trajectories.jsonl" and n == 3
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert lines == list(trajectory_rows(run_dir))
    pq = pytest.importorskip("pyarrow.parquet")
    out, n = export_trajectories(run_dir, run_dir / "x" / "t.parquet", format="parquet")
    table = pq.read_table(out)
    assert n == table.num_rows == 3 and table.column_names == list(COLUMNS)
    assert table.column("versions").to_pylist()[1] == [0, 1, -1, 1]
    pa = pytest.importorskip("pyarrow")
    assert table.schema.field("versions").type.value_type == pa.int64()
    assert table.column("trained_step").to_pylist() == [1, 2, None]
    assert pq.ParquetFile(out).num_row_groups == 2  # one per step: never the whole run in memory


@pytest.mark.parametrize("reader", ["pandas", "datasets", "duckdb"])
def test_third_party_readers(run_dir: Path, reader: str) -> None:
    mod = pytest.importorskip(reader)
    jsonl, _ = export_trajectories(run_dir)
    parquet, _ = export_trajectories(run_dir, format="parquet")
    for path in (jsonl, parquet):
        if reader == "pandas":
            df = mod.read_json(path, lines=True) if path.suffix == ".jsonl" else mod.read_parquet(path)
            versions = [list(v) for v in df["versions"]]
        elif reader == "datasets":
            kind = "json" if path.suffix == ".jsonl" else "parquet"
            versions = mod.load_dataset(kind, data_files=str(path), split="train")["versions"]
        else:
            fn = "read_json_auto" if path.suffix == ".jsonl" else "read_parquet"
            versions = [r[0] for r in mod.sql(f"SELECT versions FROM {fn}('{path}')").fetchall()]
        assert [list(v) for v in versions] == [[0, 0, -1, 0], [0, 1, -1, 1], [1, 1, -1, 1]]


def test_a_run_without_trajectories_says_how_to_save_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ConfigError, match=r"loop: \{export_trajectories: true\}"):
        export_trajectories(tmp_path / "run")
    assert not (tmp_path / "run" / "trajectories.jsonl").exists()
    assert main(["export", "--trajectories", str(tmp_path / "run")]) == 2
    assert "export_trajectories: true" in capsys.readouterr().err
    assert main(["export", "--trajectories", str(tmp_path / "nope")]) == 2
    assert main(["export", str(tmp_path)]) == 2  # a checkpoint without --hf
    assert "--hf" in capsys.readouterr().err


def test_cli_export_and_crash_safety(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (run_dir / "trajectories" / "step-000003.jsonl.tmp").write_text('{"half": ')  # a crash mid-write
    out = run_dir / "out.jsonl"
    assert main(["export", "--trajectories", str(run_dir), "--out", str(out)]) == 0
    assert "exported 3 trajectories" in capsys.readouterr().out
    assert len(out.read_text().splitlines()) == 3
    # a resumed run from step 2 makes step 2 again: the earlier attempt's step 2 goes
    TrajectoryLog(run_dir, None, first_step=2)
    assert [r["traj_id"] for r in trajectory_rows(run_dir)] == ["a", "b"]


def test_a_later_relabel_reaches_the_export(tmp_path: Path) -> None:
    log = TrajectoryLog(tmp_path, None)
    waits, trained = traj("w", "g1", [0, 0, 0]), traj("t", "g1", [0, 0, 0])
    log.write_lines(1, log.lines(1, [waits, trained], trained=[trained]))
    waits.fate = Fate.ABORTED_STALE  # the buffer found it too old (RunState relabels it)
    log.write_lines(2, log.lines(2, []))
    log.write_lines(3, log.lines(3, []))  # reported once
    rows = list(trajectory_rows(tmp_path))
    assert [(r["traj_id"], r["fate"], r["step"]) for r in rows] == [
        ("w", "aborted_stale", 1),
        ("t", "finished", 1),
    ]
    assert len((tmp_path / "trajectories" / "step-000002.jsonl").read_text().splitlines()) == 1
    assert (tmp_path / "trajectories" / "step-000003.jsonl").read_text() == ""
