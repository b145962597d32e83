"""A second run in the same output directory: the filesystem weight store an earlier run left there
must not swallow the new run's versions (retention used to keep the old run's newest versions and
drop the new version 1 at once; seen as "version 1 is not committed (latest: 60)")."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from rollart_core.config import RunConfig, load_config
from rollart_core.control.checkpoint import set_aside_earlier_run
from rollart_core.control.pipeline import weight_store_options
from rollart_core.errors import ConfigError
from rollart_weightsync.filesystem import FilesystemWeightStore

ROOT = Path(__file__).resolve().parents[2]


def _config(tmp_path: Path, **loop: object) -> RunConfig:
    data = yaml.safe_load((ROOT / "examples" / "frozenlake_tiny.yaml").read_text())
    data["output_dir"] = str(tmp_path / "run")
    data["loop"].update(loop)
    p = tmp_path / "cfg.yaml"
    p.write_text(yaml.safe_dump(data))
    return load_config(p)


def _earlier_run(root: Path) -> None:
    store = FilesystemWeightStore(root=root)
    for v in (59, 60):
        store.push(v, {"w": torch.full((2,), float(v))}).result()
    store.close()


def _latest(root: Path) -> int | None:
    store = FilesystemWeightStore(root=root)
    try:
        return store.latest_version()
    finally:
        store.close()


def test_a_new_run_in_the_same_directory_starts_from_an_empty_store(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    _earlier_run(cfg.output_dir / "weights")
    store = FilesystemWeightStore(**weight_store_options(cfg))
    try:
        assert store.latest_version() is None
        store.push(1, {"w": torch.ones(2)}).result()
        assert torch.equal(store.pull(1)["w"], torch.ones(2))
    finally:
        store.close()


def test_a_resumed_run_keeps_the_store(tmp_path: Path) -> None:
    cfg = _config(tmp_path, resume_from=str(tmp_path / "run" / "checkpoint-60"))
    _earlier_run(cfg.output_dir / "weights")
    store = FilesystemWeightStore(**weight_store_options(cfg))
    try:
        assert store.latest_version() == 60
    finally:
        store.close()


def test_a_named_root_with_an_earlier_runs_weights_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared-weights"
    _earlier_run(shared)
    cfg = _config(tmp_path)
    cfg = cfg.model_copy(
        update={"weight_store": cfg.weight_store.model_copy(update={"options": {"root": str(shared)}})}
    )
    with pytest.raises(ConfigError, match="earlier run"):
        weight_store_options(cfg)
    assert _latest(shared) == 60  # nothing removed


def test_a_new_run_sets_the_earlier_run_aside_and_a_resumed_run_keeps_it(tmp_path: Path) -> None:
    out = tmp_path / "run"
    (out / "checkpoint-50").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 60}\n')
    _earlier_run(out / "weights")
    assert set_aside_earlier_run(out, resume_from=out / "checkpoint-50") is None
    assert (out / "metrics.jsonl").is_file()

    moved = set_aside_earlier_run(out, resume_from=None)
    assert moved is not None and moved.parent == out.parent and moved.name.startswith("run.")
    assert not out.exists()  # the new run starts from nothing
    assert (moved / "metrics.jsonl").read_text() == '{"step": 60}\n'  # nothing of it deleted
    assert (moved / "checkpoint-50").is_dir()
    assert _latest(moved / "weights") == 60

    (out / "logs").mkdir(parents=True)  # a directory with only the new run's log is no earlier run
    assert set_aside_earlier_run(out, resume_from=None) is None
    (out / "summary.json").write_text("{}")
    again = set_aside_earlier_run(out, resume_from=None)
    assert again is not None and again != moved and again.exists()  # same second: a distinct name
