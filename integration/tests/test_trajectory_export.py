"""A short real run (tiny model, vLLM CPU, Ray; async, alpha 1) with ``loop.export_trajectories``,
then ``rollart export --trajectories`` in both formats, read back without rollart's types: every
trajectory the run ended is there once, with its fate, and the per-token versions of the trained
ones agree with the run's metrics (start versions, policy lag)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from rollart_core.cli import main

pytestmark = [pytest.mark.vllm, pytest.mark.ray]


async def test_a_run_exports_its_trajectories(tmp_path: Path, tiny_model: Path) -> None:
    from rollart_core.control.train import train

    from .conftest import slice_config

    cfg = slice_config(tmp_path, model_path=tiny_model, steps=3)
    cfg.loop.mode, cfg.loop.alpha, cfg.loop.export_trajectories = "async", 1, True
    summary = await train(cfg)
    run = cfg.output_dir
    assert summary["steps"] == 3 and sorted(p.name for p in (run / "trajectories").iterdir()) == [
        f"step-00000{s}.jsonl" for s in (1, 2, 3)
    ]
    assert main(["export", "--trajectories", str(run)]) == 0
    rows = [json.loads(line) for line in (run / "trajectories.jsonl").read_text().splitlines()]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]

    # each trajectory once, with its final fate; the run counted every one of them (and the ones
    # still in flight at the stop, or ended after the last step's row, which no step saved)
    assert len({r["traj_id"] for r in rows}) == len(rows) > 0
    exported = Counter(r["fate"] for r in rows)
    assert all(n <= summary["fates"].get(fate, 0) for fate, n in exported.items()), (exported, summary)
    by_step = {m["step"]: m for m in metrics}
    # the trained ones: in the step's batch, their per-token versions give the metrics' start version
    # and policy lag
    by_id = {r["traj_id"]: r for r in rows}
    for step, m in by_step.items():
        trained = [by_id[t] for t in m["batch_traj_ids"]]
        assert len(trained) == m["batch_size"] and all(r["trained_step"] == step for r in trained)
        assert all(r["fate"] == "finished" for r in trained)
        for r, start in zip(trained, m["batch_start_versions"], strict=True):
            generated = [v for v, keep in zip(r["versions"], r["response_mask"], strict=True) if keep]
            assert generated and min(generated) == r["min_version"] == start
            assert len(generated) == r["num_generated"] == len([x for x in r["response_mask"] if x])
            assert all(0 <= v <= m["version"] - 1 for v in generated)
        lags = [m["version"] - 1 - r["min_version"] for r in trained]
        assert max(lags) == m["lag_max"] <= cfg.loop.alpha
        assert all(r["prompt_text"] and r["response_text"] is not None for r in trained)
    assert {r["trained_step"] for r in rows} - {None} == {1, 2, 3}

    pq = pytest.importorskip("pyarrow.parquet")
    assert (
        main(["export", "--trajectories", str(run), "--format", "parquet", "--out", str(tmp_path / "t.pq")])
        == 0
    )
    table = pq.read_table(tmp_path / "t.pq")
    assert table.column("traj_id").to_pylist() == [r["traj_id"] for r in rows]
    assert table.column("versions").to_pylist() == [r["versions"] for r in rows]
    for reader in ("pandas", "datasets"):  # where installed; a clean environment is checked by hand
        try:
            mod = __import__(reader)
        except ImportError:
            continue
        if reader == "pandas":
            assert [list(v) for v in mod.read_parquet(tmp_path / "t.pq")["versions"]] == table.column(
                "versions"
            ).to_pylist()
        else:
            ds = mod.load_dataset("parquet", data_files=str(tmp_path / "t.pq"), split="train")
            assert ds["versions"] == table.column("versions").to_pylist()
