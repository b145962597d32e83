"""Learning curves on held-out seeds: Sync+ vs async (alpha=1), same machine, same script.

    uv run --no-sync python integration/bench/learning.py --minutes 15 [--config examples/frozenlake_learn.yaml]

Each mode trains from the same initial tiny model for the same wall-clock budget (run one after
the other: running both at once would make them fight for the same 2 cores), evaluating success
on held-out map seeds every ``--eval-every`` steps. Writes ``learning.json`` (both curves, with wall
time) and ``learning.png`` into ``--out``, and prints when each mode first reached the sync run's
final success rate, and when (seconds and episodes) each first reached ``--target`` (0.8, the
issue's bar). The trainer runs in its own process (torch trainer ``spawn``), on all cores in sync
mode and on half of them in async mode, where training overlaps rollout (as ``rollart bench``;
``--async-train-cores all`` gives async's trainer every core too, time-sharing them with generation);
``--in-process-trainer`` keeps the config's trainer as it is. Every point also records
``episodes``: the trajectories trained on so far (sample efficiency, independent of how busy the
machine was). ``--modes sync`` runs one mode only.

Each mode's CPU use is measured too (``cpu_busy``: the fraction of all cores busy from its first
step to its end, whatever ran: engine, trainer, environments, the loop). Overlapping rollout with
training can only use the cores the synchronous run left idle, so ``1 / cpu_busy`` of the sync run
is the most async can gain in wall time on this machine at equal work per episode
(``overlap_ceiling`` in the JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import time
from pathlib import Path
from typing import Any, Literal

from rollart_core.bench.workload import train_threads
from rollart_core.config import load_config
from rollart_core.loop import train
from rollart_core.timeline import CpuMeter


class _Curve:
    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.points: list[dict[str, Any]] = []
        self.episodes = 0

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self.episodes += int(metrics.get("batch_size", 0))
        row = {
            "step": step,
            "wall_s": time.perf_counter() - self.t0,
            "episodes": self.episodes,
            **{k: v for k, v in metrics.items() if isinstance(v, (int, float))},
        }
        self.points.append(row)
        print(
            f"  step {step:>4}  t={row['wall_s']:7.1f}s  episodes={self.episodes:>6}  "
            f"eval={metrics.get('eval_success', float('nan')):.3f}  "
            f"train_success={metrics.get('success_rate', float('nan')):.3f}",
            flush=True,
        )

    def close(self) -> None:
        pass


def _run(
    cfg_path: Path,
    mode: str,
    alpha: int,
    minutes: float,
    eval_every: int,
    out: Path,
    in_process_trainer: bool,
    eval_temperature: float | None,
    async_train_cores: Literal["all", "half"],
) -> tuple[list[dict[str, Any]], float | None]:
    cfg = load_config(cfg_path)
    cfg.train.mode, cfg.train.alpha = mode, alpha  # type: ignore[assignment]
    if not in_process_trainer:
        cfg.trainer.options.update(
            spawn=True, num_threads=train_threads("all" if mode == "sync" else async_train_cores)
        )
    cfg.train.steps = 100_000
    cfg.train.eval_every = eval_every
    cfg.train.eval_temperature = eval_temperature
    cfg.train.save_every = 0
    cfg = cfg.model_copy(update={"output_dir": out / f"{mode}-a{alpha}"})
    curve = _Curve()

    async def main() -> float | None:
        async with CpuMeter(period=1.0) as cpu:
            task = asyncio.create_task(train(cfg, sink=curve))
            deadline = time.perf_counter() + minutes * 60
            while not task.done() and time.perf_counter() < deadline:
                await asyncio.sleep(1.0)
            t_end = time.perf_counter()
            task.cancel()
            (outcome,) = await asyncio.gather(task, return_exceptions=True)
        if isinstance(outcome, Exception):  # a failed run must not pass for a short one
            raise RuntimeError(
                f"{mode} alpha={alpha}: training failed after {len(curve.points)} logged steps"
            ) from outcome
        # from the first step (after the pipeline's start-up and the initial evaluation) to the end
        steps = [p["wall_s"] for p in curve.points if p["step"] >= 1]
        return cpu.busy((curve.t0 + steps[0], t_end)) if steps else None

    print(f"== {mode} alpha={alpha} for {minutes} min")
    busy = asyncio.run(main())
    print(f"   cpu busy from the first step to the end: {busy if busy is None else round(busy, 3)}")
    return curve.points, busy


def _rate(points: list[dict[str, Any]], key: str) -> float | None:
    """``key`` per minute from the first step to the last."""
    steps = [p for p in points if p["step"] >= 1]
    if len(steps) < 2 or steps[-1]["wall_s"] <= steps[0]["wall_s"]:
        return None
    return (steps[-1][key] - steps[0][key]) / (steps[-1]["wall_s"] - steps[0]["wall_s"]) * 60


def _first_reaching(points: list[dict[str, Any]], target: float, key: str = "wall_s") -> float | None:
    for p in points:
        if p.get("eval_success", -1) >= target:
            return p[key]
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="examples/frozenlake_learn.yaml")
    ap.add_argument("--minutes", type=float, default=15.0)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--out", default="runs/learning")
    ap.add_argument("--target", type=float, default=0.8, help="held-out success to time (the issue's bar)")
    ap.add_argument("--modes", default="sync,async_a1", help="which of sync, async_a1 to run (in this order)")
    ap.add_argument("--quick", action="store_true", help="a 2-minute smoke run per mode")
    ap.add_argument(
        "--in-process-trainer",
        action="store_true",
        help="train in the control process (the config's trainer options unchanged)",
    )
    ap.add_argument(
        "--async-train-cores",
        choices=["half", "all"],
        default="half",
        help="the spawned trainer's share of the cores in async mode (sync: always all)",
    )
    ap.add_argument(
        "--eval-temperature",
        type=float,
        help="held-out evaluation temperature (0: greedy); default: the config's train.eval_temperature",
    )
    args = ap.parse_args()
    if args.quick:
        args.minutes, args.eval_every = 2.0, 2
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    modes = {"sync": ("sync", 0), "async_a1": ("async", 1)}
    if args.eval_temperature is None:
        args.eval_temperature = load_config(Path(args.config)).train.eval_temperature
    chosen = args.modes.split(",")
    if not chosen or any(m not in modes for m in chosen):
        ap.error(f"--modes: a comma-separated subset of {list(modes)}")
    runs = {
        m: _run(
            Path(args.config),
            *modes[m],
            args.minutes,
            args.eval_every,
            out,
            args.in_process_trainer,
            args.eval_temperature,
            args.async_train_cores,
        )
        for m in chosen
    }
    curves = {m: r[0] for m, r in runs.items()}
    cpu_busy = {m: r[1] for m, r in runs.items()}
    evals = {k: [p for p in v if "eval_success" in p] for k, v in curves.items()}
    first = evals[chosen[0]]
    sync_final = first[-1]["eval_success"] if first else 0.0
    summary = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "trainer": "in process"
        if args.in_process_trainer
        else f"spawned: all cores in sync, {args.async_train_cores} in async",
        "minutes_per_mode": args.minutes,
        "eval_temperature": args.eval_temperature,
        "sync_final_eval_success": sync_final,
        "best_eval_success": {k: max((p["eval_success"] for p in v), default=None) for k, v in evals.items()},
        "seconds_to_sync_final": {k: _first_reaching(v, sync_final) for k, v in evals.items()},
        "target": args.target,
        "seconds_to_target": {k: _first_reaching(v, args.target) for k, v in evals.items()},
        "episodes_to_target": {k: _first_reaching(v, args.target, "episodes") for k, v in evals.items()},
        "cpu_busy": cpu_busy,
        "steps_per_min": {k: _rate(v, "step") for k, v in curves.items()},
        "episodes_per_s": {k: (r / 60 if (r := _rate(v, "episodes")) else None) for k, v in curves.items()},
        "overlap_ceiling": 1 / cpu_busy["sync"] if cpu_busy.get("sync") else None,
        "curves": curves,
    }
    t_sync, t_async = (
        summary["seconds_to_sync_final"].get("sync"),
        summary["seconds_to_sync_final"].get("async_a1"),
    )
    summary["async_speedup_to_sync_final"] = (t_sync / t_async) if t_sync and t_async else None
    (out / "learning.json").write_text(json.dumps(summary, indent=2))
    nan = float("nan")
    print(
        f"\n{'mode':<10} {'best eval':>10} {'s to sync-final':>16} {f's to {args.target}':>9} {f'episodes to {args.target}':>16}"
    )
    for k in curves:
        print(
            f"{k:<10} {summary['best_eval_success'][k] or 0:>10.3f} {summary['seconds_to_sync_final'][k] or nan:>16.1f} "
            f"{summary['seconds_to_target'][k] or nan:>9.1f} {summary['episodes_to_target'][k] or nan:>16.0f}"
        )
    print(f"async speed-up to the sync run's final success: {summary['async_speedup_to_sync_final']}")
    for k in curves:
        busy = cpu_busy[k]
        print(
            f"{k:<10} cpu busy {busy if busy is None else f'{busy:.2f}'}, {summary['steps_per_min'][k] or nan:.1f} steps/min, "
            f"{summary['episodes_per_s'][k] or nan:.1f} episodes/s"
        )
    if summary["overlap_ceiling"]:
        print(
            f"overlap ceiling (1 / sync's cpu busy): async can be at most {summary['overlap_ceiling']:.2f}x faster "
            "per episode from overlapping rollout and training on these cores"
        )
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        for k, v in evals.items():
            ax.plot([p["wall_s"] / 60 for p in v], [p["eval_success"] for p in v], marker="o", label=k)
            ax2.plot([p["episodes"] for p in v], [p["eval_success"] for p in v], marker="o", label=k)
        ax.set_xlabel("wall time (min)")
        ax2.set_xlabel("episodes trained on")
        for a in (ax, ax2):
            a.set_ylabel("held-out success rate")
            a.grid(alpha=0.3)
            a.legend()
        fig.suptitle("FrozenLake (random 4x4 maps), tiny Qwen2 on CPU")
        fig.tight_layout()
        fig.savefig(out / "learning.png", dpi=120)
    except ImportError:
        print("matplotlib not installed: no PNG")
    print(f"wrote {out / 'learning.json'}")


if __name__ == "__main__":
    main()
