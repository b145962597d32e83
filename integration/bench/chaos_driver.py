"""Chaos, the driver's own death: ``kill -9`` of ``rollart train`` mid-run, then ``loop.resume_from``.

    uv run --no-sync python integration/bench/chaos_driver.py [--seed 0] [--out runs/bench/chaos_driver.json]
    uv run --no-sync python integration/bench/chaos.py --quick --driver-kill    # after the chaos run

The run is the chaos run's config (``chaos.chaos_config``: two engines, a trainer worker group with
``save_every: 1``, env actors, two reward runtimes, each in a session of its own) as a
``rollart train`` process. When its checkpoint ``kill_after`` (drawn from the seed: 2-4) is written,
the driver is SIGKILLed. Checked: every process seen descending from the driver (sampled every 0.2 s)
or in its session is gone within 10 s (``left_after_10s``, and the seconds until the last one went);
then a new ``rollart train`` with ``resume_from`` the newest checkpoint runs two more steps and ends
with ``completed``, every launched trajectory with one fate, and nothing of it left after it ends.
What the crash cost: the steps made after the newest checkpoint (``steps_lost``, from the killed
run's metrics) and the trajectories that went with them (``trajectories_lost``: those fated in the
steps after the checkpoint, plus those in flight at the last step's training, an estimate of the ones
in flight at the kill).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from rollart_core.resources import LOOPBACK_ENV
from rollart_core.watchdog import descendants, process_table, start_time

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chaos import chaos_config  # a sibling script


def _session(sid: int) -> dict[int, int]:
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                fields = Path(f"/proc/{name}/stat").read_bytes().rsplit(b")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] not in (b"Z", b"X"):
                out[int(name)] = int(fields[19])
    return out


def _alive(procs: dict[int, int]) -> dict[int, int]:
    return {p: s for p, s in procs.items() if start_time(p) == s}


def _start(cfg: dict[str, Any], root: Path, tag: str) -> subprocess.Popen[bytes]:
    path = root / f"{tag}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with open(root / f"{tag}.log", "w") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "rollart_core.cli", "train", str(path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _steps(metrics: Path) -> list[dict[str, Any]]:
    if not metrics.exists():
        return []
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


def driver_kill(seed: int, root: Path) -> dict[str, Any]:
    """One driver kill + resume; returns the figures and the broken promises (``violations``)."""
    base = chaos_config(root, quick=True, seed=seed).model_dump(mode="json", exclude_unset=True)
    base["loop"]["steps"] = 100_000
    kill_after = random.Random(seed).randint(2, 4)
    run = Path(base["output_dir"])
    t0 = time.monotonic()
    driver = _start(base, root, "killed")
    seen: dict[int, int] = {}
    resumed: subprocess.Popen[bytes] | None = None
    result: dict[str, Any] = {"seed": seed, "kill_after_checkpoint": kill_after, "violations": []}
    try:
        while not (run / f"checkpoint-{kill_after}").is_dir():
            if driver.poll() is not None or time.monotonic() - t0 > 900:
                raise RuntimeError(
                    f"the run ended before checkpoint-{kill_after}: {(root / 'killed.log').read_text()[-2000:]}"
                )
            table = process_table()
            seen.update({p: table[p][1] for p in descendants({driver.pid}, table) if p not in seen})
            seen.update({p: s for p, s in _session(driver.pid).items() if p not in seen})
            time.sleep(0.2)
        result["processes_seen"] = len(_alive(seen))
        driver.send_signal(signal.SIGKILL)
        t_kill = time.monotonic()
        driver.wait()
        result["killed_at_s"] = t_kill - t0
        left = {**_alive(seen), **_session(driver.pid)}
        while left and time.monotonic() - t_kill < 30:
            time.sleep(0.1)
            left = {**_alive(seen), **_session(driver.pid)}
        result["all_gone_after_s"] = None if left else time.monotonic() - t_kill
        result["left_after_10s"] = len(left) if result["all_gone_after_s"] is None else 0
        if result["all_gone_after_s"] is None or result["all_gone_after_s"] > 10:
            result["violations"].append(f"processes of the killed run alive > 10 s: {sorted(left)}")

        newest = max(int(p.name.rsplit("-", 1)[1]) for p in run.glob("checkpoint-*"))
        rows = _steps(run / "metrics.jsonl")
        made = max((int(r.get("step", 0)) for r in rows), default=0)
        result.update(checkpoint=newest, steps_made=made, steps_lost=max(0, made - newest))
        after = [r for r in rows if int(r.get("step", 0)) > newest]
        # the work that died with the driver: trajectories fated in the steps after the checkpoint,
        # plus those in flight at the kill (at most what was in flight at the last step's training)
        fated_after = sum(sum(r.get("fates", {}).values()) for r in after)
        inflight = int(rows[-1].get("inflight_at_train", 0)) if rows else 0
        result["trajectories_lost"] = fated_after + inflight
        cfg = json.loads(json.dumps(base))
        cfg["loop"].update(steps=newest + 2, resume_from=str(run / f"checkpoint-{newest}"))
        t_resume = time.monotonic()
        resumed = _start(cfg, root, "resumed")
        rc = resumed.wait(timeout=900)
        result["resume_s"] = time.monotonic() - t_resume
        summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else {}
        result.update(
            resume_rc=rc,
            resume_outcome=summary.get("outcome"),
            resume_final_version=summary.get("final_version"),
            resume_launched=summary.get("launched"),
            resume_fates_total=sum(summary.get("fates", {}).values()),
        )
        if rc != 0 or summary.get("outcome") != "completed":
            result["violations"].append(
                f"resume failed (rc {rc}): {(root / 'resumed.log').read_text()[-1500:]}"
            )
        if summary.get("final_version") != newest + 2:
            result["violations"].append(
                f"resume ended at version {summary.get('final_version')}, not {newest + 2}"
            )
        if summary.get("launched") != result["resume_fates_total"]:
            result["violations"].append("resumed run: launched != sum of fates")
        deadline = time.monotonic() + 10
        while _session(resumed.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _session(resumed.pid):
            result["violations"].append(f"the resumed run left processes: {sorted(_session(resumed.pid))}")
    finally:
        for pid, start in {**seen, **_session(driver.pid)}.items():  # only what this bench started
            if start_time(pid) == start:
                os.kill(pid, signal.SIGKILL)
        for proc in (driver, resumed):
            if proc is not None and proc.poll() is None:
                for pid in _session(proc.pid):
                    os.kill(pid, signal.SIGKILL)
                proc.wait()
    return result


def table(r: dict[str, Any]) -> str:
    rows = [
        (
            "driver SIGKILLed after",
            f"checkpoint-{r['kill_after_checkpoint']} ({r.get('killed_at_s', 0):.0f} s in)",
        ),
        ("processes of the run seen", r.get("processes_seen")),
        ("all gone after", "no" if r.get("all_gone_after_s") is None else f"{r['all_gone_after_s']:.1f} s"),
        ("steps made / newest checkpoint", f"{r.get('steps_made')} / {r.get('checkpoint')}"),
        ("steps lost / trajectories lost", f"{r.get('steps_lost')} / {r.get('trajectories_lost')}"),
        (
            "resume",
            f"rc {r.get('resume_rc')}, {r.get('resume_outcome')}, v{r.get('resume_final_version')}, "
            f"launched {r.get('resume_launched')} = fates {r.get('resume_fates_total')}, "
            f"{r.get('resume_s', 0):.0f} s",
        ),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("runs/bench/chaos_driver.json"))
    args = ap.parse_args(argv)
    for k, v in {**LOOPBACK_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}.items():
        os.environ.setdefault(k, v)
    with tempfile.TemporaryDirectory(prefix="rollart-chaos-driver-") as tmp:
        result = driver_kill(args.seed, Path(tmp))
    print(table(result))
    for v in result["violations"]:
        print(f"VIOLATION: {v}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, default=str))
    print(f"wrote {args.out}")
    return 1 if result["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
