"""Plot a run's held-out success: docs/figures/<name>_learning.{png,json}, over steps and minutes.

A multi-task run (``eval_success_by_task`` in its rows) gets one held-out curve per task and each
task's training success (mean over 4 steps).

    uv run --no-sync python docs/figures/learning_curves.py dataset_math runs/dataset-math \
        --title "..." --baseline 0.18 "best constant digit" --note "..." --command "..."

The run directory is what ``rollart train`` writes: ``metrics.jsonl`` (one row per step, step 0 the
evaluation before training) and ``summary.json`` (start-up phases, wall time; also for a run stopped by Ctrl-C or SIGTERM).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

OUT = Path(__file__).resolve().parent
STARTUP = ("import_s", "model_s", "ray_start_s", "engines_start_s", "eval0_s", "first_step_s", "wall_s")


def curves(run_dir: Path) -> dict[str, Any]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    evals = [
        {
            "step": r["step"],
            "elapsed_s": r.get("elapsed", 0.0),
            "eval_success": r["eval_success"],
            "by_task": r.get("eval_success_by_task", {}),
        }
        for r in rows
        if "eval_success" in r
    ]
    train = [
        {
            "step": r["step"],
            "elapsed_s": r["elapsed"],
            "success_rate": r.get("success_rate"),
            "by_task": r.get("success_by_task", {}),
        }
        for r in rows
        if r["step"] > 0 and "elapsed" in r
    ]
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    return {
        "eval": evals,
        "train": train,
        "timings_s": {k: summary[k] for k in STARTUP if k in summary},
    }


def _per_task(ax: Any, data: dict[str, Any], tasks: list[str], key: str, scale: float) -> None:
    """One colour per task: held-out success (greedy, markers) and training success (thin)."""
    for i, task in enumerate(tasks):
        color = f"C{i}"
        rows = [t for t in data["train"] if task in t["by_task"]]
        xs = [t[key] / scale for t in rows]
        ys = [t["by_task"][task] for t in rows]
        windows = [ys[max(0, j - 3) : j + 1] for j in range(len(ys))]
        smooth = [sum(w) / len(w) for w in windows]
        ax.plot(xs, smooth, color=color, lw=0.8, alpha=0.5)
        ev = [e for e in data["eval"] if task in e["by_task"]]
        ax.plot([e[key] / scale for e in ev], [e["by_task"][task] for e in ev], "o-", color=color, label=task)
    ax.legend(fontsize=8, loc="upper left", title="held-out (greedy); thin: training", title_fontsize=7)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("name", help="figure name: writes <name>_learning.{png,json}")
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--title", default="")
    ap.add_argument("--baseline", nargs=2, action="append", default=[], metavar=("VALUE", "LABEL"))
    ap.add_argument("--note", default="")
    ap.add_argument("--command", default="")
    args = ap.parse_args(argv)
    data = curves(args.run_dir)
    result = {
        "run_dir": str(args.run_dir),
        "command": args.command,
        "note": args.note,
        "baselines": {label: float(v) for v, label in args.baseline},
        **data,
    }
    (OUT / f"{args.name}_learning.json").write_text(json.dumps(result, indent=1) + "\n")
    tasks = sorted({t for e in data["eval"] for t in e["by_task"]})
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    for ax, key, label in ((axes[0], "step", "training step"), (axes[1], "elapsed_s", "minutes of training")):
        scale = 60.0 if key == "elapsed_s" else 1.0
        if len(tasks) > 1:
            _per_task(ax, data, tasks, key, scale)
            ax.set_xlabel(label)
            ax.set_ylim(0, 1.04)
            continue
        ax.plot(
            [t[key] / scale for t in data["train"]],
            [t["success_rate"] for t in data["train"]],
            color="0.75",
            label="training success (sampled)",
        )
        ax.plot(
            [e[key] / scale for e in data["eval"]],
            [e["eval_success"] for e in data["eval"]],
            "o-",
            label="held-out success (greedy)",
        )
        for (value, name), style in zip(args.baseline, (":", "--"), strict=False):
            ax.axhline(float(value), ls=style, color="k", lw=1, label=name)
        ax.set_xlabel(label)
        ax.set_ylim(0, 1.04)  # a success of 1.0 stays visible
    axes[0].set_ylabel("success")
    axes[0].legend(fontsize=8, loc="upper left")
    fig.suptitle(args.title, fontsize=10)
    fig.tight_layout()
    fig.savefig(OUT / f"{args.name}_learning.png", dpi=110)
    print(json.dumps(data["eval"]))


if __name__ == "__main__":
    main()
