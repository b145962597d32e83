"""Ranges over several runs of ``planner_validation.py``: the bench against its bounds, and how close the
simulator and the planner's closed form came to what was measured.

    uv run --no-sync python integration/bench/planval_combine.py RUN1.json RUN2.json RUN3.json \
        [--out runs/planval/combined.json]

Each ``RUN.json`` is what ``planner_validation.py --out`` wrote. Per workload and mode, over the runs
(a run's figure is its bench's median over rounds): trained traj/s; its share of the compute bound,
of the CPU-charged bound and of the window bound at idle lifetimes and under load, and of the tighter
non-circular bound (which one); where the core-seconds went (generation, training, reward, idle); the simulator's
predicted / measured (replay and from Sync+) and the planner's closed form on the machine's cores
(recomputed from each run's measurements with this tree's :func:`planner_validation.cores_check`).
Prints ``min–max`` per figure and writes every run's figure as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from planner_validation import VALIDATED, cores_check

SHARES = ("of_bound", "of_cpu_bound", "of_window", "of_window_load", "of_min_bound")
CORE_SECONDS = ("generate", "train", "reward", "idle")


def figures(run: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """workload → mode → this run's figures."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for name, w in run["workloads"].items():
        bench, cores = w["bench"], cores_check(w["bench"])
        for mode in VALIDATED:
            r = bench["results"].get(mode)
            if not r or "rounds" not in r:
                continue
            rounds = r["rounds"]
            row: dict[str, Any] = {"traj_per_s": rounds["traj_per_s"]["median"]}
            row.update({k: rounds[k]["median"] for k in SHARES if rounds.get(k)})
            row["tighter"] = r.get("min_bound_by")
            share = (r.get("cpu") or {}).get("share", {})
            row.update({f"cores_{k}": share[k] for k in CORE_SECONDS if k in share})
            for source in ("replay", "from_sync"):
                sim = w.get("modes", {}).get(mode, {}).get(source)
                if sim:
                    row[f"sim_{source}"] = sim["ratio"]
            closed = cores.get("modes", {}).get(mode)
            if closed and closed["ratio"] is not None:
                row["closed_form"] = closed["ratio"]
            out.setdefault(name, {})[mode] = row
    return out


def span(xs: list[float], pct: bool) -> str:
    if not xs:
        return "–"
    lo, hi = min(xs), max(xs)
    f = (lambda x: f"{100 * x:.0f}%") if pct else (lambda x: f"{x:.2f}")
    return f(lo) if f(lo) == f(hi) else f"{f(lo)}–{f(hi)}"


COLUMNS = [
    ("traj/s", "traj_per_s", False),
    ("of compute", "of_bound", True),
    ("of CPU", "of_cpu_bound", True),
    ("of window idle", "of_window", True),
    ("of window load", "of_window_load", True),
    ("of the tighter", "of_min_bound", True),
    ("gen", "cores_generate", True),
    ("train", "cores_train", True),
    ("reward", "cores_reward", True),
    ("idle", "cores_idle", True),
    ("sim replay", "sim_replay", False),
    ("sim from Sync+", "sim_from_sync", False),
    ("closed form", "closed_form", False),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="JSON files written by planner_validation.py --out")
    ap.add_argument("--out", help="write every run's figures here (JSON)")
    args = ap.parse_args()
    per_run = [figures(json.loads(Path(f).read_text())) for f in args.runs]
    print(f"{len(per_run)} runs; each figure min–max over the runs (a run: its bench's median over rounds)")
    print("| workload, mode | " + " | ".join(c for c, _, _ in COLUMNS) + " | tighter bound |")
    print("|" + "---|" * (len(COLUMNS) + 2))
    combined: dict[str, Any] = {"runs": args.runs, "workloads": {}}
    for name in per_run[0]:
        for mode in VALIDATED:
            rows = [r[name][mode] for r in per_run if mode in r.get(name, {})]
            if not rows:
                continue
            cells = [span([r[k] for r in rows if k in r], pct) for _, k, pct in COLUMNS]
            tighter = sorted({str(r.get("tighter")) for r in rows})
            print(f"| {name}, {mode} | " + " | ".join(cells) + f" | {'/'.join(tighter)} |")
            medians = {
                k: statistics.median(xs) for _, k, _ in COLUMNS if (xs := [r[k] for r in rows if k in r])
            }
            combined["workloads"].setdefault(name, {})[mode] = {"runs": rows, "median": medians}
    if args.out:
        Path(args.out).write_text(json.dumps(combined, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
