"""A real ``rollart train`` run (the README's main job, shortened, run as a user runs it) trains and
checkpoints, leaves a report a browser shows, and a checkpoint that ``rollart export --hf`` turns into
a model vLLM serves with the trainer's own greedy tokens."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.vllm, pytest.mark.ray]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    tmp = tmp_path_factory.mktemp("front-door")
    cfg = yaml.safe_load((ROOT / "examples" / "frozenlake_tiny.yaml").read_text())
    cfg["model"]["path"] = str(tmp / "model")
    cfg["output_dir"] = str(tmp / "run")
    cfg["tasks"][0].update(group_size=4, groups_per_step=2)
    cfg["loop"].update(steps=2, eval_every=2, eval_episodes=8, eval_temperature=0.0, save_every=2)
    path = tmp / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    r = subprocess.run(
        [sys.executable, "-m", "rollart_core.cli", "train", str(path)],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    return tmp / "run", r


def test_quiet_console_and_report_files(run_dir: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    run, r = run_dir
    # vLLM / Ray lines went to the run's logs, not the console; the step lines and the summary stayed
    assert (
        "VllmEngine pid" not in r.stdout + r.stderr
        and "Started a local Ray instance" not in r.stdout + r.stderr
    )
    assert len([ln for ln in r.stdout.splitlines() if ln.startswith("step ")]) == 3  # eval at 0, steps 1, 2
    summary = json.loads(r.stdout[r.stdout.index("\n{\n") + 1 :])
    for phase in ("import_s", "ray_start_s", "model_s", "trainer_start_s", "engines_start_s", "first_step_s"):
        assert summary[phase] > 0, phase
    assert summary["import_s"] < summary["first_step_s"] < summary["wall_s"] + summary["first_step_s"]
    assert summary["outcome"] == "completed" and summary["completed"] is True
    assert json.loads((run / "summary.json").read_text())["steps"] == summary["steps"] == 2
    assert "Started a local Ray instance" in (run / "logs" / "rollart.log").read_text()
    assert (run / "logs" / "ray").is_symlink() and any((run / "logs" / "ray").glob("worker-*.out"))
    tail = r.stderr.strip().splitlines()[-4:]
    assert tail[0] == f"run directory: {run}" and tail[2] == f"report:        {run / 'report.html'}", tail
    assert tail[3].startswith("tensorboard:   tensorboard --logdir ")
    for png in ("curves.png", "throughput.png", "staleness.png", "timeline.png"):
        assert (run / png).stat().st_size > 1000, png
    assert json.loads((run / "timeline.json").read_text())["intervals"]


def test_main_job_trains_checkpoints_and_creates_its_model(
    run_dir: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    """The README's main job, run exactly as a user runs it (shortened): ``rollart train <config>``."""
    run, r = run_dir
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("step ")]
    assert any("reward_mean=" in ln and "traj_per_s=" in ln and "gen_tok_per_s=" in ln for ln in lines), (
        r.stdout
    )
    summary = json.loads(r.stdout[r.stdout.index("\n{\n") + 1 :])
    assert summary["final_version"] == 2 and summary["fates"] == {"finished": 16}
    metrics = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["version"] for m in metrics if m["step"] > 0] == [1, 2]
    assert "eval_success" in metrics[-1]
    ckpt = run / "checkpoint-2"
    assert (ckpt / "model.safetensors").is_file() and (ckpt / "tokenizer.json").is_file()
    assert (run.parent / "model" / "config.json").is_file()  # the model was created on first use, in code


def test_rollart_report_rebuilds_it(run_dir: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    from rollart_core.cli import main

    run, _ = run_dir
    (run / "report.html").unlink()
    (run / "timeline.png").unlink()
    assert main(["report", str(run)]) == 0
    text = (run / "report.html").read_text()
    assert "src='timeline.png'" in text and (run / "timeline.png").is_file() and "first_step_s" in text


_PROBE = """<script>
window.addEventListener('load', () => {
  const imgs = [...document.images].map(i => [i.getAttribute('src'), i.naturalWidth, i.naturalHeight]);
  const pre = document.createElement('pre'); pre.id = 'probe';
  pre.textContent = 'PROBE' + JSON.stringify(imgs) + 'END'; document.body.appendChild(pre);
});
</script>"""


def test_report_loads_in_headless_chromium(
    run_dir: tuple[Path, subprocess.CompletedProcess[str]], tmp_path: Path
) -> None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("chromium is not installed (scripts/setup.sh installs Debian's chromium)")
    run, _ = run_dir
    probe = run / "probe.html"  # the report plus a script that reports each image's natural size
    probe.write_text((run / "report.html").read_text().replace("</body>", _PROBE + "</body>"))
    try:
        r = subprocess.run(
            [
                browser,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--enable-logging=stderr",
                "--v=0",
                f"--user-data-dir={tmp_path / 'profile'}",
                "--dump-dom",
                probe.as_uri(),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        probe.unlink()
    assert r.returncode == 0, r.stderr[-2000:]
    found = re.search(r'<pre id="probe">PROBE(.*?)END</pre>', r.stdout)
    assert found, r.stdout[-2000:]
    images = json.loads(found.group(1))
    assert {src for src, *_ in images} >= {"curves.png", "throughput.png", "staleness.png", "timeline.png"}
    assert all(w > 0 and h > 0 for _, w, h in images), images
    console_errors = [
        ln for ln in r.stderr.splitlines() if "CONSOLE" in ln or "Failed to load resource" in ln
    ]
    assert not console_errors, console_errors


def test_export_hf_serves_the_trainers_greedy_tokens(
    run_dir: tuple[Path, subprocess.CompletedProcess[str]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollart_core.cli import main

    run, _ = run_dir
    ckpt, hf = run / "checkpoint-2", tmp_path / "hf"
    assert (ckpt / "trainer_state.pt").is_file()  # what the export leaves behind
    assert main(["export", str(ckpt), "--hf", str(hf)]) == 0
    assert main(["export", str(ckpt), "--hf", str(hf)]) == 2 and "already exists" in capsys.readouterr().err
    names = {p.name for p in hf.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= names
    assert not any(n.startswith("rollart") or n.endswith(".pt") for n in names), names

    tok = AutoTokenizer.from_pretrained(str(hf))
    policy = AutoModelForCausalLM.from_pretrained(
        str(ckpt), dtype=torch.float32
    ).eval()  # the trainer's weights
    prompts = [
        tok.encode(t)
        for t in (
            "the agent moves left",
            "reach goal avoid hole",
            "you are at position",
            "reply with one letter",
        )
    ]
    n_new = 6
    expected = []
    with torch.no_grad():
        for ids in prompts:
            seq = list(ids)
            for _ in range(n_new):
                seq.append(int(policy(torch.tensor([seq])).logits[0, -1].argmax()))
            expected.append(seq[len(ids) :])

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(hf), dtype="float32", max_model_len=256, enforce_eager=True, seed=0)
    try:
        outs = llm.generate(
            [{"prompt_token_ids": ids} for ids in prompts],
            SamplingParams(temperature=0.0, max_tokens=n_new, ignore_eos=True),
            use_tqdm=False,
        )
        got = [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
    assert got == expected
