"""The front door of ``rollart``: bad input is one clear line and exit code 2 (``--verbose`` adds the
traceback); warnings are summarised per step; the report is written from a run's metrics."""

from __future__ import annotations

import json
import logging
import socket
from pathlib import Path

import pytest
import yaml

from rollart_core.cli import main
from rollart_core.console import route_logs
from rollart_core.metrics import ConsoleSink, since_process_start

ROOT = Path(__file__).resolve().parents[3]


def _example(tmp_path: Path) -> dict:
    cfg = yaml.safe_load((ROOT / "examples" / "frozenlake_tiny.yaml").read_text())
    cfg["model"]["path"] = str(tmp_path / "model")
    cfg["output_dir"] = str(tmp_path / "run")
    return cfg


def _write(tmp_path: Path, cfg: dict, name: str = "cfg.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _one_error_line(capsys: pytest.CaptureFixture[str], rc: int) -> str:
    out, err = capsys.readouterr()
    assert rc == 2, (out, err)
    assert "Traceback" not in out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rollart: error: "), err
    return lines[0]


def test_missing_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = _one_error_line(capsys, main(["train", str(tmp_path / "nope.yaml")]))
    assert "nope.yaml" in line and "no such config file" in line


def test_yaml_error_names_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ntasks: [\n  - {a: 1\n")
    line = _one_error_line(capsys, main(["train", str(bad)]))
    assert "bad.yaml" in line and "not valid YAML" in line


def test_unknown_field_names_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _example(tmp_path)
    cfg["loop"]["stepz"] = 3
    line = _one_error_line(capsys, main(["train", _write(tmp_path, cfg)]))
    assert "loop.stepz" in line


def test_model_dir_without_weights(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _example(tmp_path)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    line = _one_error_line(capsys, main(["train", _write(tmp_path, cfg)]))
    assert str(model) in line and "no weights" in line
    assert not (tmp_path / "run").exists()  # nothing started


def test_port_in_use_names_field_and_port(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cfg = _example(tmp_path)
        cfg["tasks"][0]["reward_executor"] = {"impl": "serverless", "options": {"runtime": {"port": port}}}
        line = _one_error_line(capsys, main(["train", _write(tmp_path, cfg)]))
    assert f"port {port}" in line and "tasks.0.reward_executor.options.runtime.port" in line


def test_verbose_shows_the_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["train", str(tmp_path / "nope.yaml"), "--verbose"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" in err and err.strip().splitlines()[-1].startswith("rollart: error: ")


def test_export_refuses_a_non_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    line = _one_error_line(capsys, main(["export", str(tmp_path / "ckpt"), "--hf", str(tmp_path / "hf")]))
    assert "not a checkpoint" in line and "safetensors" in line and not (tmp_path / "hf").exists()


def test_report_of_a_non_run_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = _one_error_line(capsys, main(["report", str(tmp_path)]))
    assert "metrics.jsonl" in line


def test_logs_go_to_the_file_and_warnings_are_summarised(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log_file = tmp_path / "logs" / "rollart.log"
    with route_logs(log_file):
        logging.getLogger("vllm.engine").info("an engine detail")
        for i in range(12):
            logging.getLogger("rollart_env.manager").warning("env %d crashed: %s", i, "boom")
        ConsoleSink(["reward_mean"]).log(1, {"reward_mean": 0.5})
        ConsoleSink(["reward_mean"]).log(2, {"reward_mean": 0.6})
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert lines[0].startswith("step   1") and "reward_mean=0.500" in lines[0]
    assert lines[1] == "  warnings: 12× rollart_env.manager: env 0 crashed: boom", lines
    assert lines[2].startswith("step   2") and len(lines) == 3  # drained: nothing repeated at step 2
    assert "crashed" not in err and "engine detail" not in out + err
    text = log_file.read_text()
    assert "an engine detail" in text and text.count("crashed: boom") == 12


def test_report_from_metrics(tmp_path: Path) -> None:
    from rollart_core.report import write_report

    rows = [{"step": 0, "eval_success": 0.1, "version": 0}]
    rows += [
        {
            "step": s,
            "reward_mean": 0.1 * s,
            "success_rate": 0.1 * s,
            "traj_per_s": 2.0,
            "gen_tok_per_s": 15.0,
            "lag_max": 1,
            "lag_mean": 0.5,
            "version": s,
            "fates": {"finished": 8},
            "episode_s_by_task": {"a": 1.0, "b": 2.0},
            **({"eval_success": 0.3} if s == 2 else {}),
        }
        for s in (1, 2)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3, "torn')
    page = write_report(tmp_path, {"import_s": 3.0, "first_step_s": 50.0})
    text = page.read_text()
    for png in ("curves.png", "throughput.png", "staleness.png", "per_task.png"):
        assert f"src='{png}'" in text and (tmp_path / png).stat().st_size > 1000
    assert "first_step_s" in text and "timeline.png" not in text  # no timeline saved


def test_since_process_start_is_positive() -> None:
    age = since_process_start()
    assert age is not None and 0 < age < 24 * 3600


def test_live_display_shows_progress_eta_held_out_and_scrolls_each_step() -> None:
    import io

    from rich.console import Console

    from rollart_core.console import LiveSink

    sink = LiveSink(total_steps=4)
    printed = io.StringIO()
    sink.live.console.file = printed  # the scrolling step lines
    try:
        sink.log(0, {"eval_success": 0.25, "version": 0})
        for step in (1, 2, 3):
            sink.log(
                step,
                {
                    "reward_mean": 0.5,
                    "success_rate": 0.5,
                    "traj_per_s": 3.0,
                    "version": step,
                    "lag_max": 1,
                    "fates": {"finished": 8},
                },
            )
        panel = Console(file=io.StringIO(), width=120, record=True)
        panel.print(sink)
        text = panel.export_text()
    finally:
        sink.close()
    assert "step 3/4" in text and "held-out success 0.250" in text and "finished=8" in text
    assert "ETA -" not in text and "ETA " in text  # three steps logged: the ETA is an estimate
    lines = [ln for ln in printed.getvalue().splitlines() if ln.startswith("step")]
    assert len(lines) == 4 and lines[-1].startswith("step   3") and "held-out 0.25" in lines[0]
