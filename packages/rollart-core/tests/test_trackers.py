"""W&B (offline) and MLflow (local file store) as metrics back-ends: a run on the control plane's
in-process fakes logs to both at once, and the numbers are read back with each tracker's own format
(the ``.wandb`` record file; MLflow's client). Bad input: a missing package, a store that cannot
start, a store that breaks mid-run."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import struct
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from rollart_core.cli import _bad_input_line
from rollart_core.config import LoggingConfig, RunConfig
from rollart_core.control.train import train
from rollart_core.errors import ConfigError, MissingExtraError
from rollart_core.metrics import MemorySink, MultiSink
from rollart_core.report import load_rows, write_report
from rollart_core.trackers import Trackers, _redacted, tracking


@pytest.fixture(autouse=True)
def _stop_wandb_service(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """wandb runs a service process per Python process; stop it after each test that started it.
    MLflow's file-store opt-in: unset before (rollart sets it), removed after."""
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    yield
    if "wandb" in sys.modules and sys.modules["wandb"] is not None:
        sys.modules["wandb"].teardown()


def _with_logging(cfg: RunConfig, **logging_cfg: Any) -> RunConfig:
    return cfg.model_copy(update={"logging": LoggingConfig.model_validate(logging_cfg)})


def _wandb_records(run_dir: Path) -> list[Any]:
    """Every record of the offline run's ``run-<id>.wandb`` file: W&B's record log (a 7-byte header,
    32 KiB blocks of CRC-checked chunks) of ``wandb_internal_pb2.Record`` messages. wandb 0.31 reads
    it only in its Go service, so the test reads it here."""
    from wandb.proto import wandb_internal_pb2

    [path] = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, pos, buf = [], 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # too little room for a chunk header: the block is padded
            pos += 32768 - pos % 32768
            continue
        crc, n, kind = struct.unpack_from("<IHB", data, pos)
        chunk = data[pos + 7 : pos + 7 + n]
        if kind == 0:
            break
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc
        pos += 7 + n
        buf = chunk if kind in (1, 2) else buf + chunk  # FULL, FIRST / MIDDLE, LAST
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(buf)
            records.append(record)
    return records


def _mlflow_run(store: Path) -> tuple[Any, Any]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store.as_uri())
    [run] = client.search_runs([client.get_experiment_by_name("rollart").experiment_id])
    return client, run


async def test_a_run_logs_to_wandb_offline_and_mlflow_at_once(
    fakes: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")  # no network whatever a user's environment says
    cfg = _with_logging(fakes.fake_config(tmp_path), backends=["wandb", "mlflow"], run_name="fake-run")
    out = cfg.output_dir
    with tracking(cfg) as trackers:  # what `rollart train` does around train()
        assert trackers is not None
        summary = await asyncio.wait_for(train(cfg, pipeline=fakes.FakePipeline(cfg, fakes.Script())), 60)
        summary = {**summary, "outcome": "completed", "trackers": trackers.status()}
        report = write_report(out, summary)
        trackers.finish(summary, [report, *sorted(out.glob("*.png"))])
    rows = [r for r in load_rows(out) if r["step"] >= 1]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert summary["trackers"] == {"wandb": "ok", "mlflow": "ok"}

    # W&B: one history row per step with the same numbers, the config, the summary, the report
    records = _wandb_records(out)
    history = [
        {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    assert [h["_step"] for h in history] == [1, 2, 3]
    for h, row in zip(history, rows, strict=True):
        numbers = {k: v for k, v in row.items() if isinstance(v, (int, float)) and k != "step"}
        assert {"success_rate", "traj_per_s", "loss", "version"} <= set(numbers)
        assert {k: h[k] for k in numbers} == pytest.approx(numbers)  # every number of the step
        assert h["fates/finished"] == row["fates"]["finished"]
    [run] = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.display_name == "fake-run"
    config = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert config["loop"]["steps"] == 3 and config["tasks"][0]["name"] == "t"
    summary_items = {
        u.key: json.loads(u.value_json)
        for r in records
        if r.WhichOneof("record_type") == "summary"
        for u in r.summary.update
        if u.key
    }
    assert summary_items["final_version"] == summary["final_version"] == 3
    assert summary_items["completed"] is True
    saved = {f.path for r in records if r.WhichOneof("record_type") == "files" for f in r.files.files}
    assert "report/report.html" in saved
    assert "exit" in {r.WhichOneof("record_type") for r in records}  # the run was ended

    # MLflow: the metric history of every step, the config as params and a file, summary, report
    client, mrun = _mlflow_run(out / "mlruns")
    assert mrun.info.status == "FINISHED" and mrun.info.run_name == "fake-run"
    got = client.get_metric_history(mrun.info.run_id, "traj_per_s")
    assert [(m.step, m.value) for m in got] == [(r["step"], pytest.approx(r["traj_per_s"])) for r in rows]
    assert [m.value for m in client.get_metric_history(mrun.info.run_id, "version")] == [1, 2, 3]
    assert [m.value for m in client.get_metric_history(mrun.info.run_id, "fates/finished")] == [
        r["fates"]["finished"] for r in rows
    ]
    assert mrun.data.params["loop.steps"] == "3"
    assert mrun.data.metrics["summary/final_version"] == 3
    assert mrun.data.tags["rollart.outcome"] == "completed"
    files = {a.path for a in client.list_artifacts(mrun.info.run_id)}
    assert {"config.json", "summary.json", "report"} <= files
    assert "report/report.html" in {a.path for a in client.list_artifacts(mrun.info.run_id, "report")}


async def test_a_store_breaking_mid_run_warns_once_and_the_run_completes(
    fakes: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = _with_logging(fakes.fake_config(tmp_path, steps=4), backends=["wandb", "mlflow"])
    out = cfg.output_dir
    trackers = Trackers.start(cfg)
    assert trackers is not None

    class BreakStoresAt(MemorySink):
        """Before step 2 reaches the trackers: both stores' folders replaced by plain files."""

        def log(self, step: int, metrics: dict[str, Any]) -> None:
            super().log(step, metrics)
            if step == 2:
                for folder in (out / "wandb", out / "mlruns"):
                    shutil.rmtree(folder)
                    folder.write_text("not a folder any more")

    memory = BreakStoresAt()
    with caplog.at_level(logging.WARNING, logger="rollart_core.trackers"):
        summary = await asyncio.wait_for(
            train(cfg, sink=MultiSink(memory, trackers), pipeline=fakes.FakePipeline(cfg, fakes.Script())), 60
        )
        trackers.finish(summary)
    assert summary["completed"] and summary["steps"] == 4
    assert [r["step"] for r in memory.rows] == [1, 2, 3, 4]  # every step still reached the other sinks
    status = trackers.status()
    assert set(status) == {"wandb", "mlflow"}
    for name in ("wandb", "mlflow"):
        assert status[name]["missed"] == 3, status  # steps 3 and 4, the summary
        failures = [r for r in caplog.records if r.getMessage().startswith(f"tracker {name} failed")]
        assert len(failures) == 1, [r.getMessage() for r in caplog.records]
    assert "the W&B run file" in status["wandb"]["error"]


def test_a_missing_package_is_one_line_naming_the_extra(
    fakes: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for module, extra in (("wandb", "wandb"), ("mlflow", "mlflow"), ("tensorboardX", "tensorboard")):
        with monkeypatch.context() as m:
            m.setitem(sys.modules, module, None)  # `import module` now fails as if it were absent
            cfg = _with_logging(fakes.fake_config(tmp_path), backends=["tensorboard", "mlflow", "wandb"])
            with pytest.raises(MissingExtraError) as err:
                Trackers.start(cfg)
            line = _bad_input_line(err.value)
            assert (
                line == f"{module!r} is not installed. Install it with: pip install 'rollart-core[{extra}]'"
            )
    assert not (tmp_path / "run").exists()  # nothing started: every package is checked first


def test_an_unwritable_store_is_a_config_error_at_start(fakes: ModuleType, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cases = [
        ({"backends": ["mlflow"], "mlflow": {"tracking_uri": str(blocker / "mlruns")}}, "logging.mlflow"),
        ({"backends": ["wandb"], "wandb": {"dir": str(blocker / "wb")}}, "logging.wandb.dir"),
    ]
    for logging_cfg, field in cases:
        cfg = _with_logging(fakes.fake_config(tmp_path), **logging_cfg)
        with pytest.raises(ConfigError, match=field) as err:
            Trackers.start(cfg)
        assert "cannot write" in str(err.value) and "\n" not in str(err.value)


def test_logging_config_refuses_unknown_keys_and_repeats(fakes: ModuleType, tmp_path: Path) -> None:
    assert LoggingConfig().backends == ["tensorboard"] and LoggingConfig().wandb.mode == "offline"
    for bad in (
        {"backends": ["wandb", "wandb"]},
        {"backends": ["neptune"]},
        {"wandb": {"projekt": "x"}},
        {"mlflow": {"tracking_url": "x"}},
    ):
        with pytest.raises(ValueError):
            LoggingConfig.model_validate(bad)
    cfg = fakes.fake_config(tmp_path)
    rel = _with_logging(cfg, mlflow={"tracking_uri": "mlruns"}, wandb={"dir": "wb"}).resolve_paths(tmp_path)
    assert rel.logging.mlflow.tracking_uri == str(tmp_path / "mlruns")
    assert rel.logging.wandb.dir == tmp_path / "wb"


def test_secrets_are_not_sent_to_trackers() -> None:
    config = {"reward": {"options": {"api_key": "sk-1", "admin_token": "t", "max_tokens": 5}}, "token": None}
    assert _redacted(config) == {
        "reward": {"options": {"api_key": "<redacted>", "admin_token": "<redacted>", "max_tokens": 5}},
        "token": None,
    }


async def test_train_from_python_starts_and_ends_its_trackers(fakes: ModuleType, tmp_path: Path) -> None:
    """No `tracking` block: train()'s own metrics sink starts the chosen trackers and ends them."""
    cfg = _with_logging(fakes.fake_config(tmp_path, steps=2), backends=["tensorboard", "mlflow"])
    await asyncio.wait_for(train(cfg, pipeline=fakes.FakePipeline(cfg, fakes.Script())), 60)
    client, mrun = _mlflow_run(cfg.output_dir / "mlruns")
    assert mrun.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(mrun.info.run_id, "version")] == [1, 2]
    assert any((cfg.output_dir / "tensorboard").iterdir())
