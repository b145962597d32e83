"""A run's report: ``report.html`` and its PNGs, in the run directory.

``rollart train`` writes it when the run ends (also when it fails, with the steps it has);
``rollart report RUN_DIR`` rebuilds it from what the run left there:

- ``metrics.jsonl`` (one row per step; step 0 is the held-out evaluation before training),
- ``timeline.json`` (optional): the per-stage busy intervals (:mod:`rollart_core.timeline`),
- ``summary.json`` (optional): the run summary, start-up phases included.

Plots: learning curves (train reward and success, held-out success; per task where the rows carry
per-task values), throughput, staleness (``lag_max`` / ``lag_mean``), and the per-stage timeline
(the bench's colours and merge). Without matplotlib the page still has the tables.
"""

from __future__ import annotations

import html
import json
import logging
from pathlib import Path
from typing import Any

from rollart_core.errors import ConfigError
from rollart_core.timeline import STAGES, merge

__all__ = ["load_rows", "save_timeline", "write_report"]

log = logging.getLogger(__name__)
_COLOURS = {
    "generate": "#1f77b4",
    "env": "#2ca02c",
    "reward": "#ff7f0e",
    "train": "#d62728",
    "weight_sync": "#9467bd",
}
_PHASES = (
    "import_s",
    "model_s",
    "trainer_start_s",
    "ray_start_s",
    "build_local_s",
    "engines_start_s",
    "env_manager_start_s",
    "eval0_s",
    "first_step_s",
    "wall_s",
)


def load_rows(run_dir: Path) -> list[dict[str, Any]]:
    """The rows of ``metrics.jsonl`` (a torn last line is skipped)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(f"{run_dir}: not a run directory (no metrics.jsonl)")
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def save_timeline(intervals: list[tuple[str, float, float, str]], t0: float, path: Path) -> None:
    """Save a run's intervals relative to ``t0`` (seconds), for :func:`write_report` to plot later."""
    path.write_text(json.dumps({"intervals": [[s, a - t0, b - t0, lane] for s, a, b, lane in intervals]}))


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            xs.append(r["step"])
            ys.append(float(v))
    return xs, ys


def _per_task(rows: list[dict[str, Any]]) -> dict[str, dict[str, tuple[list[float], list[float]]]]:
    """``{metric: {task: (steps, values)}}`` for every dict-valued ``*_by_task`` metric."""
    out: dict[str, dict[str, tuple[list[float], list[float]]]] = {}
    for r in rows:
        for k, v in r.items():
            if k.endswith("_by_task") and isinstance(v, dict):
                for task, x in v.items():
                    if isinstance(x, (int, float)):
                        xs, ys = out.setdefault(k, {}).setdefault(task, ([], []))
                        xs.append(r["step"])
                        ys.append(float(x))
    return out


def _plot(
    path: Path, panels: list[tuple[str, str, list[tuple[str, tuple[list[float], list[float]]]]]]
) -> bool:
    import matplotlib.pyplot as plt

    panels = [p for p in panels if any(xs for _, (xs, _) in p[2])]
    if not panels:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.4), squeeze=False)
    for ax, (title, ylabel, lines) in zip(axes[0], panels, strict=True):
        for label, (xs, ys) in lines:
            if xs:
                ax.plot(xs, ys, marker="o", ms=3, label=label)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _plot_timeline(intervals: list[list[Any]], path: Path) -> bool:
    import matplotlib.pyplot as plt

    if not intervals:
        return False
    fig, ax = plt.subplots(figsize=(12, 2.6))
    for row, st in enumerate(reversed(STAGES)):
        spans = merge([(a, b) for name, a, b, *_ in intervals if name == st])
        ax.broken_barh([(a, b - a) for a, b in spans], (row + 0.1, 0.8), color=_COLOURS[st])
    ax.set_yticks([i + 0.5 for i in range(len(STAGES))], list(reversed(STAGES)))
    ax.set_ylim(0, len(STAGES))
    ax.set_xlabel("seconds since the first recorded stage")
    ax.set_title("busy stages over time (union of concurrent calls)", fontsize=10, loc="left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _table(head: list[str], rows: list[list[str]]) -> str:
    return (
        "<table><tr>"
        + "".join(f"<th>{html.escape(h)}</th>" for h in head)
        + "</tr>"
        + "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows)
        + "</table>"
    )


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3f}"
    if isinstance(v, dict):
        return " ".join(f"{k}={_cell(x)}" for k, x in sorted(v.items()))
    return "" if v is None else str(v)


def write_report(run_dir: Path, summary: dict[str, Any] | None = None, error: str | None = None) -> Path:
    """Write ``report.html`` (and ``curves.png``, ``throughput.png``, ``staleness.png``,
    ``per_task.png``, ``timeline.png`` where there is data) into ``run_dir``; returns the page's path.
    ``summary`` (else ``summary.json`` if present); ``error``: why the run stopped, shown on top."""
    run_dir = Path(run_dir)
    rows = load_rows(run_dir)
    if summary is None and (run_dir / "summary.json").is_file():
        summary = json.loads((run_dir / "summary.json").read_text())
    tl_path = run_dir / "timeline.json"
    intervals = json.loads(tl_path.read_text())["intervals"] if tl_path.is_file() else []
    steps = [r for r in rows if r.get("step", 0) >= 1]
    images: list[tuple[str, str]] = []
    try:
        import matplotlib
    except ImportError:
        log.warning("matplotlib is not installed: report.html without plots (pip install matplotlib)")
    else:
        matplotlib.use("Agg")
        plots = {
            "curves.png": (
                "Learning curves",
                [
                    (
                        "reward and success",
                        "",
                        [
                            ("train reward", _series(steps, "reward_mean")),
                            ("train success", _series(steps, "success_rate")),
                            ("held-out success", _series(rows, "eval_success")),
                        ],
                    ),
                    ("held-out reward", "", [("held-out reward", _series(rows, "eval_reward"))]),
                    ("loss", "", [("loss", _series(steps, "loss"))]),
                ],
            ),
            "throughput.png": (
                "Throughput",
                [
                    ("trajectories", "per second", [("finished traj/s", _series(steps, "traj_per_s"))]),
                    ("generated tokens", "per second", [("gen tok/s", _series(steps, "gen_tok_per_s"))]),
                    (
                        "step time",
                        "seconds",
                        [
                            ("step", _series(steps, "step_s")),
                            ("wait", _series(steps, "wait_s")),
                            ("train", _series(steps, "train_s")),
                            ("sync", _series(steps, "sync_s")),
                        ],
                    ),
                ],
            ),
            "staleness.png": (
                "Staleness",
                [
                    (
                        "policy lag of the trained batch",
                        "versions",
                        [("lag_max", _series(steps, "lag_max")), ("lag_mean", _series(steps, "lag_mean"))],
                    )
                ],
            ),
            "per_task.png": (
                "Per task",
                [(k, "", list(v.items())) for k, v in sorted(_per_task(steps).items())],
            ),
        }
        for name, (title, panels) in plots.items():
            if _plot(run_dir / name, panels):
                images.append((title, name))
        if _plot_timeline(intervals, run_dir / "timeline.png"):
            images.append(("Per-stage timeline", "timeline.png"))
    keys = [
        "step",
        "reward_mean",
        "success_rate",
        "eval_success",
        "traj_per_s",
        "gen_tok_per_s",
        "lag_max",
        "lag_mean",
        "loss",
        "version",
        "fates",
    ]
    step_table = _table(keys, [[_cell(r.get(k)) for k in keys] for r in rows])
    name = (summary or {}).get("name") or run_dir.name
    page = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>rollart run {html.escape(str(name))}</title>",
        "<style>body{font-family:sans-serif;margin:2em}td,th{border:1px solid #ccc;padding:3px 6px;"
        "font-size:13px}table{border-collapse:collapse}.err{color:#b00;font-weight:bold}</style></head><body>",
        f"<h1>rollart run {html.escape(str(name))}</h1>",
        f"<p>{len(steps)} training steps in <code>{html.escape(str(run_dir))}</code></p>",
    ]
    if error:
        page.append(f"<p class='err'>The run stopped early: {html.escape(error)}</p>")
    if summary:
        phases = [[k, _cell(summary[k])] for k in _PHASES if k in summary]
        if phases:
            page += ["<h2>Start-up and wall time (seconds)</h2>", _table(["phase", "s"], phases)]
        page += [
            "<h2>Summary</h2>",
            _table(
                ["key", "value"],
                [[k, _cell(v)] for k, v in summary.items() if k not in _PHASES and k != "history"],
            ),
        ]
    for title, img in images:
        page.append(
            f"<h2>{html.escape(title)}</h2><img src='{img}' alt='{html.escape(title)}' style='max-width:100%'>"
        )
    if matplotlib is None:
        page.append("<p>(matplotlib not installed: no plots)</p>")
    page += ["<h2>Steps</h2>", step_table, "</body></html>"]
    out = run_dir / "report.html"
    out.write_text("\n".join(page), encoding="utf-8")
    return out
