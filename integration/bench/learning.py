"""Time-to-train on held-out seeds: Sync+ vs async, under environment latency, over several seeds.

    uv run --no-sync python integration/bench/learning.py --minutes 12 --seeds 0,1,2 \
        --modes sync,async_a1,async_a2 --env-latency 0.3 --env-sigma 1.0 --out runs/learning

Each (seed, mode) run trains from the same initial tiny model for the same wall-clock budget, one
after the other (both at once would fight for the same 2 cores); seeds are the outer loop, so the
modes are interleaved and a slow spell of the machine hits them alike. Held-out success is
evaluated every ``--eval-every`` steps.

**Environment latency.** Real agentic environments are sandboxes, tools, browsers and remote
services: a call takes hundreds of milliseconds, with a heavy tail. ``--env-latency M --env-sigma S``
adds a log-normal delay (median M seconds, spread S) to every ``reset`` and ``step`` of training
episodes, through the same fault-injection wrapper as ``rollart bench`` (rollart-env's ``straggler``:
every trajectory draws its own delays). The default, 0.3 s with sigma 1.0 (p99 about 10x the median:
3 s), is the order of a tool or sandbox call; 0 turns it off (FrozenLake answers in microseconds).
The delays are paired: every mode of one seed launches the same episode seeds, and the n-th episode
on a seed draws the same delays in each run (``straggler``'s ``paired_scope``), so the modes of a seed
wait on the same tails (since 2026-12-03). Held-out evaluation runs on the plain environment
(``TaskConfig.eval_env``): it measures the policy, and the instrument should not add wall time that
differs between modes.

Per mode it reports, as the median [min-max] over seeds: the wall time to reach held-out success
``--target`` (0.8), the time to reach the same seed's Sync+ final success, the final success (median
of the last three evaluations: one evaluation in 20-30 dips), steps/min and the machine's CPU busy
fraction from the first step on. A run that never reaches a bar within the budget counts as "> budget"
(the speed-up is then a lower bound, shown with ">="). Writes ``learning.json`` (every curve) and
``learning.png`` (median curve and min-max band per mode, over wall time and over episodes).

The trainer runs in its own process (torch trainer ``spawn``) on all cores in sync mode and on half
of them in async mode, where training overlaps rollout (as ``rollart bench``);
``--in-process-trainer`` keeps the config's trainer as it is. ``--trainer-option KEY=VALUE`` sets a
trainer option for every mode, ``--async-trainer-option KEY=VALUE`` for the async modes only (after
``--trainer-option``; e.g. ``ppo_epochs=1`` and ``mini_batches=4``: async spends its extra batches on fresh
data instead of a second pass over one-step-old data, with as many optimizer steps a batch as Sync+'s
two epochs of two) (each run records the options it trained with). ``--task-option KEY=VALUE`` and
``--async-task-option KEY=VALUE`` do the same for the tasks' fields (every task; validated as in a
config file), e.g. ``group_size=4`` and ``groups_per_step=16`` for async: its staleness window holds
alpha+1 steps of groups, and a group lives as long as its slowest member, so smaller groups turn the
window over sooner (docs/benchmarks.md, 2026-12-04 "group shape"). ``--merge`` puts runs made
separately (e.g. another mode or seed later) into one summary. Merged runs may have different budgets
(e.g. longer Sync+ runs, so that its time to the bar is measured rather than "> budget"): times to a
bar then come from each whole run, final success from the shortest budget, so finals compare alike.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import yaml

from rollart_core.bench.workload import train_threads
from rollart_core.config import ComponentConfig, RunConfig, load_config
from rollart_core.control.train import train
from rollart_core.signals import sigterm_as_sigint
from rollart_core.timeline import CpuMeter

MODES: dict[str, tuple[str, int]] = {"sync": ("sync", 0), "async_a1": ("async", 1), "async_a2": ("async", 2)}


class _Curve:
    def __init__(self, label: str) -> None:
        self.label = label
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
        if "eval_success" in metrics or step % 10 == 0:
            print(
                f"  [{self.label}] step {step:>4}  t={row['wall_s']:7.1f}s  episodes={self.episodes:>6}  "
                f"eval={metrics.get('eval_success', float('nan')):.3f}  "
                f"train_success={metrics.get('success_rate', float('nan')):.3f}",
                flush=True,
            )

    def close(self) -> None:
        pass


def with_env_latency(
    cfg: RunConfig, median_s: float, sigma: float, seed: int, paired_scope: str | None = None
) -> RunConfig:
    """Every task's training env wrapped in the ``straggler`` fault injector (log-normal delay on each
    reset/step); an ``agent`` env (whose episode is one call) gets ``task_data.tool_latency_s`` /
    ``tool_latency_sigma`` instead, for agents whose tools wait that long (drawn from the episode seed,
    e.g. ``examples/agents/smollm2_tool_agent.py``); held-out evaluation keeps the plain env. ``paired_scope`` (one per run): the n-th
    episode on a seed draws the same delays in every run, and runs of one seed launch the same episode
    seeds in every mode, so Sync+ and async of a seed wait on the same tails (common random numbers)."""
    if median_s <= 0:
        return cfg
    cfg = cfg.model_copy(deep=True)
    for task in cfg.tasks:
        task.eval_env = task.eval_env or task.env
        if task.env.impl == "agent":  # its latency is in the agent's tool calls (the episode is one call)
            data = {**task.env.options.get("task_data", {}), "tool_latency_s": median_s}
            data["tool_latency_sigma"] = sigma
            task.env = task.env.model_copy(update={"options": {**task.env.options, "task_data": data}})
            continue
        task.env = ComponentConfig(
            impl="straggler",
            options={
                "env": task.env.model_dump(),
                "faults": {"seed": seed, "step_latency_s": median_s, "step_latency_sigma": sigma},
                **({"paired_scope": paired_scope} if paired_scope else {}),
            },
        )
    return cfg


def with_task_options(cfg: RunConfig, options: dict[str, Any]) -> RunConfig:
    """``options`` (TaskConfig fields, e.g. ``group_size``) set on every task and validated as a config
    file's would be (an unknown field or a bad value raises pydantic's ValidationError)."""
    if not options:
        return cfg
    data = cfg.model_dump()
    for task in data["tasks"]:
        task.update(options)
    return RunConfig.model_validate(data)


def _task_options(args: argparse.Namespace, recipe: str) -> dict[str, Any]:
    return {**args.task_options, **(args.async_task_options if recipe == "async" else {})}


def _run(args: argparse.Namespace, mode: str, seed: int, out: Path) -> dict[str, Any]:
    recipe, alpha = MODES[mode]
    task_options = _task_options(args, recipe)
    cfg = with_task_options(load_config(Path(args.config)), task_options)
    cfg.seed = seed
    cfg.loop.mode, cfg.loop.alpha = recipe, alpha  # type: ignore[assignment]
    if not args.in_process_trainer:
        cfg.trainer.options.update(
            spawn=True, num_threads=train_threads("all" if recipe == "sync" else args.async_train_cores)
        )
    cfg.trainer.options.update(args.trainer_options)
    if recipe == "async":
        cfg.trainer.options.update(args.async_trainer_options)
    cfg.loop.steps = 100_000
    cfg.loop.eval_every = args.eval_every
    cfg.loop.save_every = 0
    if args.eval_temperature is not None:
        cfg.loop.eval_temperature = args.eval_temperature
    cfg = with_env_latency(cfg, args.env_latency, args.env_sigma, seed, paired_scope=f"{mode}/seed{seed}")
    cfg = cfg.model_copy(update={"output_dir": out / f"{mode}-s{seed}"})
    curve = _Curve(f"{mode} s{seed}")

    async def main() -> float | None:
        async with CpuMeter(period=1.0) as cpu:
            task = asyncio.create_task(train(cfg, sink=curve))
            deadline = time.perf_counter() + args.minutes * 60
            while not task.done() and time.perf_counter() < deadline:
                await asyncio.sleep(1.0)
            t_end = time.perf_counter()
            task.cancel()
            (outcome,) = await asyncio.gather(task, return_exceptions=True)
        if isinstance(outcome, Exception):  # a failed run must not pass for a short one
            raise RuntimeError(
                f"{mode} seed {seed}: training failed after {len(curve.points)} logged steps"
            ) from outcome
        # from the first step (after the pipeline's start-up and the initial evaluation) to the end
        steps = [p["wall_s"] for p in curve.points if p["step"] >= 1]
        return cpu.busy((curve.t0 + steps[0], t_end)) if steps else None

    print(f"== {mode} (alpha={alpha}) seed {seed} for {args.minutes} min", flush=True)
    busy = asyncio.run(main())
    return {
        "mode": mode,
        "seed": seed,
        "trainer_options": cfg.trainer.options,
        "task_options": task_options,
        "points": curve.points,
        "cpu_busy": busy,
        "budget_s": args.minutes * 60,
    }


def rate(points: list[dict[str, Any]], key: str) -> float | None:
    """``key`` per minute from the first step to the last."""
    steps = [p for p in points if p["step"] >= 1]
    if len(steps) < 2 or steps[-1]["wall_s"] <= steps[0]["wall_s"]:
        return None
    return (steps[-1][key] - steps[0][key]) / (steps[-1]["wall_s"] - steps[0]["wall_s"]) * 60


def first_reaching(points: list[dict[str, Any]], target: float, key: str = "wall_s") -> float | None:
    """The wall time (or ``key``) of the first evaluation at or above ``target``; None: never."""
    for p in points:
        if p.get("eval_success", -1) >= target:
            return float(p[key])
    return None


def training_start(points: list[dict[str, Any]]) -> float:
    """Wall time at which training began: when the step-0 evaluation was logged (the pipeline's
    start-up and that evaluation take the same ~40 s in every mode); 0 without a step-0 point."""
    return next((float(p["wall_s"]) for p in points if p["step"] == 0), 0.0)


def from_training_start(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    t0 = training_start(points)
    return [{**p, "wall_s": p["wall_s"] - t0} for p in points]


def final_success(points: list[dict[str, Any]], last: int = 3, until: float | None = None) -> float | None:
    """Median of the last ``last`` evaluations (of those logged by ``until`` s, when given)."""
    evals = [
        p["eval_success"]
        for p in points
        if "eval_success" in p and p["step"] >= 1 and (until is None or p["wall_s"] <= until)
    ]
    return statistics.median(evals[-last:]) if evals else None


def spread(values: list[float | None], budget: float | None = None) -> dict[str, Any]:
    """Median and min-max; None (never reached) counts as above ``budget`` (infinite without one)."""
    known = [v for v in values if v is not None]
    as_num = [v if v is not None else float("inf") for v in values]
    med = statistics.median(as_num) if as_num else None
    return {
        "median": None if med is None or med == float("inf") else med,
        "min": min(known) if known else None,
        "max": None if len(known) < len(values) else (max(known) if known else None),
        "censored": len(values) - len(known),
        "budget": budget,
        "values": values,
    }


def speedup(sync_s: float | None, mode_s: float | None, budget: float) -> tuple[float | None, bool]:
    """(sync time / mode time, is a lower bound): a sync run that never reached the bar took > budget."""
    if mode_s is None or mode_s <= 0:
        return None, False
    if sync_s is None:
        return budget / mode_s, True
    return sync_s / mode_s, False


def common_budget(runs: list[dict[str, Any]], budget_s: float) -> float:
    """The shortest run's budget: where final success is compared when runs had different budgets."""
    return min((r.get("budget_s", budget_s) for r in runs), default=budget_s)


def summarise(runs: list[dict[str, Any]], modes: list[str], target: float, budget_s: float) -> dict[str, Any]:
    """Per mode, over seeds. ``budget_s``: the budget of runs that do not record their own. Runs may
    have different budgets (``--merge`` of e.g. longer Sync+ runs): a time to a bar is taken over the
    whole run and a censored one is "> that run's budget", while final success (and the Sync+ final
    that ``s_to_sync_final`` times) is taken at the shortest run's budget, so finals compare alike."""
    by_mode = {m: [r for r in runs if r["mode"] == m] for m in modes}
    common = common_budget(runs, budget_s)
    sync_final = {r["seed"]: final_success(r["points"], until=common) for r in by_mode.get("sync", [])}
    rows: dict[str, Any] = {}
    for m, rs in by_mode.items():
        per_seed = []
        for r in rs:
            pts, sf, run_budget = r["points"], sync_final.get(r["seed"]), r.get("budget_s", budget_s)
            per_seed.append(
                {
                    "seed": r["seed"],
                    "budget_s": run_budget,
                    "s_to_target": first_reaching(pts, target),
                    "train_s_to_target": first_reaching(from_training_start(pts), target),
                    "train_budget_s": run_budget - training_start(pts),
                    "episodes_to_target": first_reaching(pts, target, "episodes"),
                    "s_to_sync_final": first_reaching(pts, sf) if sf is not None else None,
                    "final_success": final_success(pts, until=common),
                    "best_success": max(
                        (p["eval_success"] for p in pts if "eval_success" in p), default=None
                    ),
                    "steps_per_min": rate(pts, "step"),
                    "episodes_per_s": (x / 60) if (x := rate(pts, "episodes")) else None,
                    "cpu_busy": r["cpu_busy"],
                }
            )
        mode_budget = min((s["budget_s"] for s in per_seed), default=budget_s)
        rows[m] = {
            "per_seed": per_seed,
            **{
                k: spread([s[k] for s in per_seed], mode_budget if k.startswith("s_to") else None)
                for k in ("s_to_target", "s_to_sync_final", "final_success", "steps_per_min", "cpu_busy")
            },
            "train_s_to_target": spread(
                [s["train_s_to_target"] for s in per_seed], min(s["train_budget_s"] for s in per_seed)
            ),
        }
    if "sync" in rows:
        sync_by_seed = {s["seed"]: s for s in rows["sync"]["per_seed"]}
        for m in modes:
            ups = []
            for s in rows[m]["per_seed"]:
                ref = sync_by_seed.get(s["seed"])
                if ref is None:
                    continue
                up, bound = speedup(ref["s_to_target"], s["s_to_target"], ref["budget_s"])
                tup, tbound = speedup(ref["train_s_to_target"], s["train_s_to_target"], ref["train_budget_s"])
                ups.append(
                    {
                        "seed": s["seed"],
                        "speedup_to_target": up,
                        "lower_bound": bound,
                        "training_speedup_to_target": tup,
                        "training_lower_bound": tbound,
                    }
                )
            for key, flag in (
                ("speedup_to_target", "lower_bound"),
                ("training_speedup_to_target", "training_lower_bound"),
            ):
                known = [u[key] for u in ups if u[key] is not None]
                rows[m][key] = {
                    "per_seed": ups,
                    "median": statistics.median(known) if len(known) == len(ups) and known else None,
                    "any_lower_bound": any(u[flag] for u in ups),
                }
            finals = [
                (s["final_success"] - sync_by_seed[s["seed"]]["final_success"])
                for s in rows[m]["per_seed"]
                if s["final_success"] is not None
                and s["seed"] in sync_by_seed
                and sync_by_seed[s["seed"]]["final_success"] is not None
            ]
            rows[m]["final_minus_sync"] = spread(finals) if finals else None
    return rows


def _fmt(s: dict[str, Any] | None, unit: str = "") -> str:
    if not s:
        return "-"
    med = s["median"]
    if med is None:
        return f"> {s['budget']:.0f}{unit}" if s.get("budget") else "-"
    lo, hi = s["min"], s["max"]
    hi_txt = f"{hi:.2f}" if hi is not None else ("never" if s["censored"] else "-")
    return f"{med:.2f}{unit} [{lo:.2f}-{hi_txt}]"


def _fmt_up(r: dict[str, Any], key: str, flag: str) -> str:
    """Median speed-up over Sync+ of the seeds that reached the bar; ≥ when Sync+ never did in one."""
    up = r.get(key) or {}
    vals = [u[key] for u in up.get("per_seed", []) if u[key]]
    if not vals:
        return "-"
    return ("≥" if any(u[flag] for u in up["per_seed"]) else "") + f"{statistics.median(vals):.2f}x"


def print_table(rows: dict[str, Any], target: float) -> None:
    head = (
        f"{'mode':<9} {f's to {target}':>22} {'speed-up':>9} {'training s to ' + str(target):>24} "
        f"{'speed-up':>9} {'s to sync final':>22} {'final':>18} {'steps/min':>18} {'cpu busy':>16}"
    )
    print("\n" + head)
    for m, r in rows.items():
        print(
            f"{m:<9} {_fmt(r['s_to_target']):>22} {_fmt_up(r, 'speedup_to_target', 'lower_bound'):>9} "
            f"{_fmt(r['train_s_to_target']):>24} "
            f"{_fmt_up(r, 'training_speedup_to_target', 'training_lower_bound'):>9} "
            f"{_fmt(r['s_to_sync_final']):>22} {_fmt(r['final_success']):>18} "
            f"{_fmt(r['steps_per_min']):>18} {_fmt(r['cpu_busy']):>16}"
        )
    print(
        "s to the bar: from the command's start; training s: from the end of the step-0 evaluation "
        "(the pipeline's start-up and that evaluation excluded, the same in every mode). A speed-up "
        "counts only seeds that reached the bar; ≥: Sync+ did not within the budget in one of them."
    )


def plot(runs: list[dict[str, Any]], modes: list[str], budget_s: float, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def value_at(points: list[dict[str, Any]], x: float, key: str) -> float | None:
        v = None
        for p in points:
            if "eval_success" not in p:
                continue
            if p[key] > x:
                break
            v = p["eval_success"]
        return v

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for key, ax, scale, label in (
        ("wall_s", axes[0], 60.0, "wall time (min)"),
        ("episodes", axes[1], 1.0, "episodes trained on"),
    ):
        for m in modes:
            rs = [r for r in runs if r["mode"] == m]
            if not rs:
                continue
            end = max(max((p[key] for p in r["points"]), default=0) for r in rs)
            if end <= 0:
                continue
            xs = [end * i / 200 for i in range(201)]
            med, lo, hi, xk = [], [], [], []
            for x in xs:
                vals = [v for r in rs if (v := value_at(r["points"], x, key)) is not None]
                if len(vals) == len(rs):
                    xk.append(x / scale)
                    med.append(statistics.median(vals))
                    lo.append(min(vals))
                    hi.append(max(vals))
            (line,) = ax.plot(xk, med, label=f"{m} (median of {len(rs)})")
            ax.fill_between(xk, lo, hi, alpha=0.2, color=line.get_color())
        ax.set_xlabel(label)
        ax.set_ylabel("held-out success")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    sigterm_as_sigint()  # SIGTERM stops the runs as Ctrl-C does: engines and Ray shut down
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="examples/frozenlake_tiny.yaml")
    ap.add_argument("--minutes", type=float, default=12.0, help="wall-clock budget of every run")
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--out", default="runs/learning")
    ap.add_argument("--target", type=float, default=0.8, help="held-out success to time")
    ap.add_argument(
        "--modes", default="sync,async_a1,async_a2", help=f"comma-separated subset of {list(MODES)}"
    )
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated run seeds (the config's seed)")
    ap.add_argument("--env-latency", type=float, default=0.3, help="median env call latency in s (0: none)")
    ap.add_argument("--env-sigma", type=float, default=1.0, help="log-normal spread of the latency")
    ap.add_argument("--quick", action="store_true", help="a 2-minute smoke run per mode, one seed")
    ap.add_argument(
        "--merge",
        nargs="+",
        metavar="LEARNING_JSON",
        help="run nothing: summarise the runs of these learning.json files together (e.g. one file per "
        "seed and mode, each run on its own) into --out",
    )
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
        help="held-out evaluation temperature (0: greedy); default: the config's loop.eval_temperature",
    )
    ap.add_argument(
        "--trainer-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set a trainer option for every mode (VALUE read as YAML), e.g. --trainer-option "
        "loss=decoupled_ppo --trainer-option tis_cap=2; repeatable",
    )
    ap.add_argument(
        "--async-trainer-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set a trainer option for the async modes only, after --trainer-option (e.g. ppo_epochs=1, "
        "then mini_batches=4); "
        "repeatable",
    )
    ap.add_argument(
        "--task-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set a task field (TaskConfig) on every task for every mode, e.g. --task-option group_size=4; "
        "repeatable",
    )
    ap.add_argument(
        "--async-task-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set a task field on every task for the async modes only, after --task-option (e.g. "
        "group_size=4, then groups_per_step=16); repeatable",
    )
    args = ap.parse_args()
    args.trainer_options, args.async_trainer_options = {}, {}
    args.task_options, args.async_task_options = {}, {}
    for flag, items, into in (
        ("--trainer-option", args.trainer_option, args.trainer_options),
        ("--async-trainer-option", args.async_trainer_option, args.async_trainer_options),
        ("--task-option", args.task_option, args.task_options),
        ("--async-task-option", args.async_task_option, args.async_task_options),
    ):
        for item in items:
            key, sep, value = item.partition("=")
            if not sep or not key:
                ap.error(f"{flag} {item!r}: expected KEY=VALUE")
            into[key] = yaml.safe_load(value)
    if args.quick:
        args.minutes, args.eval_every, args.seeds = 2.0, 2, args.seeds.split(",")[0]
    modes = args.modes.split(",")
    if not modes or any(m not in MODES for m in modes):
        ap.error(f"--modes: a comma-separated subset of {list(MODES)}")
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        ap.error("--seeds: comma-separated integers")
    if not args.merge:  # a bad option stops here, not after the first run
        for recipe in sorted({MODES[m][0] for m in modes}):
            try:
                with_task_options(load_config(Path(args.config)), _task_options(args, recipe))
            except ValueError as exc:  # ConfigError and pydantic's ValidationError
                ap.error(f"{args.config} with --task-option / --async-task-option ({recipe}): {exc}")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    if args.merge:
        workloads: dict[str, tuple[Any, ...]] = {}
        for path in args.merge:
            merged = json.loads(Path(path).read_text())
            cmd = merged["command"]
            # the parsed options (a repeated key: the last wins); files before --task-option: none
            task_opts = json.dumps(cmd.get("task_options", {}), sort_keys=True)
            workloads[path] = (cmd["config"], cmd["env_latency"], cmd["env_sigma"], task_opts)
            runs.extend({"budget_s": cmd["minutes"] * 60, **r} for r in merged["runs"])
        if len(set(workloads.values())) != 1:
            ap.error(
                f"--merge: the files ran different workloads (config, env latency, sigma, task options): "
                f"{workloads}"
            )
        (args.config, args.env_latency, args.env_sigma, task_opts) = next(iter(workloads.values()))
        args.task_options = json.loads(task_opts)  # the merged file records what its runs had
        args.minutes = common_budget(runs, 0.0) / 60
        seeds = sorted({r["seed"] for r in runs})
        modes = [m for m in MODES if any(r["mode"] == m for r in runs)]
    else:
        for seed in seeds:  # seeds outside: the modes interleave
            for m in modes:
                runs.append(_run(args, m, seed, out))
                (out / "learning.partial.json").write_text(json.dumps(runs))
    budget_s = args.minutes * 60
    rows = summarise(runs, modes, args.target, budget_s)
    result = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "command": {k: v for k, v in vars(args).items()},
        "trainer": "in process"
        if args.in_process_trainer
        else f"spawned: all cores in sync, {args.async_train_cores} in async",
        "summary": rows,
        "runs": runs,
    }
    (out / "learning.json").write_text(json.dumps(result, indent=1))
    print_table(rows, args.target)
    budgets = {m: sorted({r.get("budget_s", budget_s) / 60 for r in runs if r["mode"] == m}) for m in modes}
    if len({b for bs in budgets.values() for b in bs}) > 1:
        per_mode = ", ".join(f"{m} {'/'.join(f'{b:g}' for b in bs)}" for m, bs in budgets.items())
        budget_txt = f"budgets (min) {per_mode}; final success at {args.minutes:g} min"
    else:
        budget_txt = f"budget {args.minutes:g} min per run"
    print(
        f"(median [min-max] over seeds {seeds}; {budget_txt}; "
        f"env latency {args.env_latency} s, sigma {args.env_sigma})"
    )
    try:
        plot(
            runs,
            modes,
            budget_s,
            out / "learning.png",
            f"{Path(args.config).stem}: env latency {args.env_latency}s (sigma {args.env_sigma}), "
            f"{len(seeds)} seeds",
        )
    except ImportError:
        print("matplotlib not installed: no PNG")
    print(f"wrote {out / 'learning.json'}")


if __name__ == "__main__":
    main()
