"""The README's main job, run exactly as a user runs it (shortened): ``rollart train <config>``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.vllm, pytest.mark.ray]
ROOT = Path(__file__).resolve().parents[2]


def test_rollart_train_cli_end_to_end(tmp_path: Path) -> None:
    cfg = yaml.safe_load((ROOT / "examples" / "frozenlake_tiny.yaml").read_text())
    cfg["model"]["path"] = str(tmp_path / "model")
    cfg["output_dir"] = str(tmp_path / "run")
    cfg["tasks"][0].update(group_size=4, groups_per_step=2)
    cfg["train"].update(
        steps=2, eval_every=2, eval_episodes=8, eval_temperature=0.0, save_every=2
    )  # greedy eval
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    r = subprocess.run(
        [sys.executable, "-m", "rollart_core.cli", "train", str(path)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("step ")]
    assert any("reward_mean=" in ln and "traj_per_s=" in ln and "gen_tok_per_s=" in ln for ln in lines), (
        r.stdout
    )
    summary = json.loads(r.stdout[r.stdout.index("\n{\n") + 1 :])
    assert summary["final_version"] == 2 and summary["fates"] == {"finished": 16}
    metrics = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["version"] for m in metrics if m["step"] > 0] == [1, 2]
    assert "eval_success" in metrics[-1]
    ckpt = tmp_path / "run" / "checkpoint-2"
    assert (ckpt / "model.safetensors").is_file() and (ckpt / "tokenizer.json").is_file()
    # the model was created on first use, in code
    assert (tmp_path / "model" / "config.json").is_file()
