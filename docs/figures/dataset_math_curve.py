"""Plot a dataset_math run's held-out success: docs/figures/dataset_math_learning.{png,json}.

uv run --no-sync python docs/figures/dataset_math_curve.py runs/dataset-math/metrics.jsonl
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

OUT = Path(__file__).resolve().parent


def main(metrics_path: str, note: str = "") -> None:
    rows = [json.loads(line) for line in Path(metrics_path).read_text().splitlines() if line.strip()]
    evals = [
        {"step": r["step"], "eval_success": r["eval_success"], "eval_reward": r.get("eval_reward")}
        for r in rows
        if "eval_success" in r
    ]
    train = [
        {"step": r["step"], "success_rate": r.get("success_rate"), "reward_mean": r.get("reward_mean")}
        for r in rows
        if r["step"] > 0 and "reward_mean" in r
    ]
    result = {"metrics": str(metrics_path), "note": note, "eval": evals, "train": train}
    (OUT / "dataset_math_learning.json").write_text(json.dumps(result, indent=1) + "\n")
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(
        [t["step"] for t in train],
        [t["reward_mean"] for t in train],
        color="0.7",
        label="train reward (sampled)",
    )
    ax.plot(
        [e["step"] for e in evals],
        [e["eval_success"] for e in evals],
        "o-",
        label="held-out success (greedy)",
    )
    ax.axhline(0.1, ls=":", color="k", label="random digit (0.1)")
    ax.set_xlabel("training step")
    ax.set_ylabel("success")
    ax.set_ylim(0, 1)
    ax.set_title("dataset_math: tiny random Qwen2 on one-digit word problems")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(OUT / "dataset_math_learning.png", dpi=120)
    print(json.dumps(evals))


if __name__ == "__main__":
    main(*sys.argv[1:3])
