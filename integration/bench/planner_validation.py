"""Does the simulator predict the bench? Sync+, One-off, async α=1 and α=2, measured vs simulated, on
two workloads; then what it predicts at the paper's scale.

1. **Measure.** Runs ``rollart bench`` itself (:func:`rollart_core.bench.harness.run_bench`, the
   four modes interleaved over rounds) on the quick workload and on a second one (``--set
   FIELD=VALUE``, default ``env_latency_s=0.1``); each run's bench reports go to ``OUT_DIR/<workload>/``.
2. **Profile.** From what each run measured, two workload profiles per mode for the simulator
   (:mod:`rollart_core.plan`); env calls follow the workload's definition (log-normal latency, the
   10 s timeout, crashes within the first two calls), the rest is measured:
   - *replay*: the mode's own per-turn generation latencies, turns, reward latencies, trainer step
     and weight-update pause: does the simulator's model of the loop (barriers, admission, staleness,
     redundancy) turn the mode's component times into its throughput?
   - *from Sync+*: Sync+'s latencies for every mode, generation slots from the saturated capacity
     probe (slots = turns/s at saturation × Sync+'s mean turn latency), the trainer's half-core step
     and the contention between generation and training on shared cores from the bench's capacity
     probe: a prediction of the overlapping modes from the one that overlaps nothing.
3. **Compare.** Prints predicted vs measured trained trajectories/s per mode with the ratio (goal:
   within 20%), and writes everything as JSON (``--out``).
4. **Cores instead of GPUs.** The planner's trainer model on this machine (:func:`cores_check`):
   the trainer step's 1/T scaling (all cores vs half), and each mode's throughput from the planner's
   closed form on the measured components with the cores split as the planner splits a budget.
5. **Extrapolate.** A paper-like multi-task workload (:func:`paper_profile`: the assumptions are
   spelled out there) planned — the trainer pool sized from 6·N·tokens, the GPUs split per mode —
   and simulated on 64 and 128 GPUs and on a 3,000-GPU cluster.

    uv run --no-sync python integration/bench/planner_validation.py --out runs/planval.json
    uv run --no-sync python integration/bench/planner_validation.py --small --out /tmp/planval.json
    uv run --no-sync python integration/bench/planner_validation.py --replay runs/planval.json   # simulate only

Run it under ``flock /tmp/rollart-heavy.lock`` on a shared machine (it starts vLLM and Ray).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

from rollart_core.bench.figures import spread
from rollart_core.bench.harness import parse_overrides, run_bench, sized
from rollart_core.bench.report import write_reports
from rollart_core.bench.workload import MODES
from rollart_core.plan.catalogue import DEFAULT_CATALOGUE
from rollart_core.plan.planner import make_plan, plan_pools, rollout_latency
from rollart_core.plan.simulate import simulate
from rollart_core.plan.trainer import TrainerSizing, best_split, step_seconds
from rollart_core.plan.workload import LatencyDist, ModelProfile, TaskProfile, TrainProfile, WorkloadProfile

VALIDATED = ["sync", "one_off", "async_a1", "async_a2"]
SOURCES = ("replay", "from_sync")
GOAL = 0.2
"""Predicted within this fraction of measured."""


# 1. measure ------------------------------------------------------------------------------------------


def measure(size_name: str, overrides: dict[str, Any], out_dir: Path, model: Path | None) -> dict[str, Any]:
    """One ``rollart bench`` run of the validated modes; its reports in ``out_dir``."""
    size = sized(size_name, overrides)
    res = asyncio.run(run_bench(size_name, size, VALIDATED, out_dir, model))
    write_reports(res, out_dir)
    for segs in res["segments"].values():  # the plot's raw intervals: not needed here
        for s in segs:
            s.pop("intervals", None)
    return res


# 2. profile ------------------------------------------------------------------------------------------


def env_latency(size: dict[str, Any]) -> LatencyDist:
    """The bench's env latency: log-normal around ``env_latency_s`` (its median) with ``env_sigma``."""
    median, sigma = size["env_latency_s"], size["env_sigma"]
    if median <= 0:
        return LatencyDist()
    if sigma <= 0:
        return LatencyDist(mean=median)
    return LatencyDist(mean=median * math.exp(sigma**2 / 2), dist="lognormal", sigma=sigma)


def _samples(res: dict[str, Any], mode: str, task: str, key: str) -> list[float]:
    return [x for s in res["segments"][mode] for x in s.get("samples", {}).get(task, {}).get(key, [])]


def _rows(res: dict[str, Any], mode: str, key: str) -> list[float]:
    return [x for s in res["segments"][mode] for x in s.get(key, [])]


def _mean(xs: list[float], default: float = 0.0) -> float:
    return statistics.fmean(xs) if xs else default


def _weights(res: dict[str, Any], mode: str) -> tuple[float, float]:
    """Weight update of ``mode``'s steps: (push the loop waits for, engines' pause)."""
    pause = _mean(_rows(res, mode, "update_pause_s"))
    return max(0.0, _mean(_rows(res, mode, "sync_s")) - pause), pause


def profile(res: dict[str, Any], mode: str, source: str) -> WorkloadProfile:
    """The simulator's profile of ``mode`` from ``res`` (a bench run): ``replay`` (the mode's own
    component times) or ``from_sync`` (Sync+'s, plus the capacity probe's contention)."""
    size, cap = res["size"], res["capacity"]
    spec = MODES[mode]
    timings_of = mode if source == "replay" else "sync"
    tasks = []
    for t in res["config"]["tasks"]:
        name = t["name"]
        gen = _samples(res, timings_of, name, "generate")
        if not gen:
            raise SystemExit(f"{mode}: no generation samples of task {name!r} in the bench run")
        turns = [int(x) for x in _samples(res, timings_of, name, "turns")] or [t["max_turns"]]
        tasks.append(
            TaskProfile(
                name=name,
                trajectories_per_step=t["groups_per_step"] * t["group_size"],
                group_size=t["group_size"],
                turns=_mean(turns),
                turns_samples=turns,
                generate_s=LatencyDist.of(gen),
                env_latency_s=env_latency(size),
                env_timeout_s=size["env_timeout_s"],
                fail_prob=size["crash_prob"],
                fail_within_calls=2,  # the bench's fault_within_calls
                reward_s=LatencyDist.of(_samples(res, timings_of, name, "reward")),
                redundancy=size["redundancy"] if spec.redundancy is None else spec.redundancy,
            )
        )
    push_s, pause_s = _weights(res, "sync")
    if source == "replay":
        train = TrainProfile(
            train_s=_mean(_rows(res, mode, "train_s")), sync_s=_weights(res, mode)[1], push_s=push_s
        )
        if spec.mode != "async":  # the loop waits for the push: the mode's own figure
            train.push_s = _weights(res, mode)[0]
        return WorkloadProfile(tasks=tasks, train=train)
    contention = cap.get("contention", {})
    overlaps = spec.mode != "sync"
    train = TrainProfile(
        train_s=cap["train"]["half_cores_s"] if overlaps else _mean(_rows(res, "sync", "train_s")),
        sync_s=pause_s,
        push_s=push_s,
        colocated_slowdown=contention.get("gen_slowdown", 0.0) if overlaps else 0.0,
        train_colocated_slowdown=contention.get("train_slowdown", 0.0) if overlaps else 0.0,
    )
    gen_turn_s = _mean([x for t in tasks for x in _samples(res, "sync", t.name, "generate")])
    turns_per_s = cap["generate"].get("turns_per_s") or cap["generate"]["traj_per_s"] * _mean(
        [t.turns for t in tasks], 1.0
    )
    return WorkloadProfile(tasks=tasks, train=train, gen_slots=max(1, round(turns_per_s * gen_turn_s)))


def predict(
    prof: WorkloadProfile, res: dict[str, Any], mode: str, steps: int | None, seeds: int
) -> dict[str, Any]:
    """Mean simulated throughput of ``mode`` over ``seeds`` runs. ``steps`` None: the bench's own
    protocol (a segment from an empty pipeline: its warm-up steps, then its measured steps, throughput
    over the measured ones, or over all when the size has no warm-up); else ``steps`` steps after the
    mode's pipeline depth (the long-run steady state)."""
    cfg = res["mode_configs"][mode]
    warmup = None
    if steps is None:
        steps = cfg["steps"]
        warmup = MODES[mode].warmup_steps() if res["size"]["warmup"] else 0
    runs = [
        simulate(
            prof,
            mode=cfg["mode"],
            alpha=cfg["alpha"],
            steps=steps,
            warmup_steps=warmup,
            max_pending_steps=cfg.get("max_pending_steps"),
            update_on_arrival=cfg.get("update_on_arrival", True),
            abort_stale=cfg.get("abort_stale", True),
            seed=seed,
        )
        for seed in range(seeds)
    ]
    rates = [r.traj_per_s for r in runs]
    return {
        "traj_per_s": statistics.fmean(rates),
        "seeds": spread(rates),
        "step_s": statistics.fmean(r.step_s for r in runs),
        "fates": runs[0].fates,
    }


def unmeasured(res: dict[str, Any]) -> dict[str, str]:
    """Validated modes the bench has no figure for, with its reason (a failed segment's error)."""
    out = {}
    for mode in VALIDATED:
        if (res.get("results", {}).get(mode) or {}).get("traj_per_s") is None:
            why = res.get("missing", {}).get(mode) or {}
            out[mode] = "; ".join(f"round {k}: {v}" for k, v in why.items())[:300] or "no figure"
    return out


def compare(res: dict[str, Any], steady_steps: int, seeds: int) -> dict[str, Any]:
    """Per mode: measured, and simulated from each profile as the bench measures (segments of the
    bench's length from an empty pipeline, ``seeds`` of them) and in the long run (``steady``)."""
    out: dict[str, Any] = {"modes": {}, "profiles": {}, "unmeasured": unmeasured(res)}
    for mode in VALIDATED:
        if mode in out["unmeasured"] or (mode != "sync" and "sync" in out["unmeasured"]):
            continue  # (the *from Sync+* profile needs Sync+'s samples)
        measured = res["results"][mode]
        row: dict[str, Any] = {
            "measured": measured["traj_per_s"],
            "measured_rounds": measured["rounds"]["traj_per_s"],
        }
        for source in SOURCES:
            prof = profile(res, mode, source)
            pred = predict(prof, res, mode, None, seeds)
            row[source] = {**pred, "ratio": pred["traj_per_s"] / measured["traj_per_s"]}
            row[source]["steady"] = predict(prof, res, mode, steady_steps, max(1, seeds // 4))
            out["profiles"][f"{mode}/{source}"] = prof.model_dump()
        out["modes"][mode] = row
    return out


# 3. report -------------------------------------------------------------------------------------------


def print_comparison(name: str, overrides: dict[str, Any], cmp: dict[str, Any]) -> None:
    what = " ".join(f"{k}={v}" for k, v in overrides.items()) or "the size's defaults"
    print(
        f"\nworkload {name} ({what}): trained trajectories/s, measured (all rounds) vs simulated as the bench "
        "measures (segments of its length and warm-up)"
    )
    head = (
        f"{'mode':<12}{'measured':>10}  {'rounds':<13}{'replay':>8}{'ratio':>7}{'from Sync+':>12}{'ratio':>7}"
    )
    print(head)
    for mode, row in cmp["modes"].items():
        rounds = row["measured_rounds"]
        rng = "-" if rounds is None else f"{rounds['min']:.2f}–{rounds['max']:.2f}"
        cells = []
        for source in SOURCES:
            r = row[source]["ratio"]
            cells.append(f"{row[source]['traj_per_s']:>8.2f}{r:>6.2f}{'' if abs(r - 1) <= GOAL else '!'}")
        print(f"{MODES[mode].label:<12}{row['measured']:>10.2f}  {rng:<13}{cells[0]}{cells[1]:>20}")
    for mode, why in cmp["unmeasured"].items():
        print(f"{MODES[mode].label:<12}no figure: {why}")
    print(f"('!': off by more than {GOAL:.0%})")


# 4. extrapolate --------------------------------------------------------------------------------------

PAPER_MODEL = ModelProfile(params=32e9, num_layers=64, num_kv_heads=8, head_dim=128)
"""A 32B dense model (Qwen3-32B-like shapes) stands in for the paper's models."""


def paper_profile(batch: int) -> WorkloadProfile:
    """A paper-like multi-task agentic step of ``batch`` trajectories (ASSUMED figures, not measured):
    half SWE-style tool use (long prompts, 10 turns, sandbox calls of 2 s mean with a heavy tail and a
    60 s timeout, tests as a 5 s reward, 2 spare rollouts per group of 8), a quarter prefill-heavy
    game (16 short turns over a growing context) and a quarter decode-heavy single-turn reasoning.
    Training runs at 40% MFU (6 · params · tokens FLOPs) on a trainer pool the planner sizes; an
    update pauses the engines 10 s, the push takes 5 s."""
    swe = TaskProfile(
        name="swe",
        trajectories_per_step=batch // 2,
        group_size=8,
        redundancy=2,
        prompt_tokens=4000,
        context_tokens_per_turn=600,
        output_tokens_per_turn=300,
        turns=10,
        env_latency_s=LatencyDist(mean=2.0, dist="lognormal", sigma=1.5),
        env_timeout_s=60.0,
        reward_s=LatencyDist(mean=5.0, dist="lognormal", sigma=1.0),
    )
    game = TaskProfile(
        name="game",
        trajectories_per_step=batch // 4,
        group_size=8,
        prompt_tokens=1500,
        context_tokens_per_turn=150,
        output_tokens_per_turn=30,
        turns=16,
        env_latency_s=LatencyDist(mean=0.3, dist="lognormal", sigma=1.0),
        env_timeout_s=10.0,
    )
    math_task = TaskProfile(
        name="math",
        trajectories_per_step=batch // 4,
        group_size=8,
        prompt_tokens=400,
        output_tokens_per_turn=3000,
        turns=1,
        env_latency_s=LatencyDist(mean=0.05),
        reward_s=LatencyDist(mean=0.5),
    )
    return WorkloadProfile(
        model=PAPER_MODEL,
        tasks=[swe, game, math_task],
        train=TrainProfile(mfu=0.4, sync_s=10.0, push_s=5.0),
    )


SETTINGS = [  # (name, GPUs, trajectories per step): the planner splits them per mode
    ("64 GPUs", 64, 512),
    ("128 GPUs", 128, 512),
    ("3,000-GPU cluster", 3000, 8192),
]
EXTRAPOLATED = [
    ("Sync+", "sync", 0),
    ("One-off", "one_off", 1),
    ("async α=1", "async", 1),
    ("async α=2", "async", 2),
]


def extrapolate(steps: int) -> list[dict[str, Any]]:
    """Per setting and mode: the planner's split of the GPUs (trainer vs rollout), its closed-form
    throughput, and the simulation of that split."""
    rows = []
    for name, gpus, batch in SETTINGS:
        prof = paper_profile(batch)
        t0 = time.perf_counter()
        modes: dict[str, Any] = {}
        for label, mode, alpha in EXTRAPOLATED:
            plan = make_plan(prof, DEFAULT_CATALOGUE, gpus=gpus, mode=mode, alpha=max(alpha, 1))
            split = plan.split
            sim_prof = prof.model_copy(deep=True)
            sim_prof.train.train_s = split.train_s
            pools = plan_pools(prof, plan, DEFAULT_CATALOGUE)
            r = simulate(sim_prof, mode=mode, alpha=alpha, steps=steps, **pools)  # type: ignore[arg-type]
            modes[label] = {
                "trainer_gpus": split.trainer_gpus,
                "rollout_gpus": split.rollout_gpus,
                "trainer_share": split.trainer_gpus / gpus,
                "rollout_pools": plan.pools,
                "train_s": split.train_s,
                "predicted_traj_per_s": split.traj_per_s,
                "bottleneck": plan.bottleneck,
                "traj_per_s": r.traj_per_s,
                "step_s": r.step_s,
                "gen_busy": r.gen_busy,
                "train_busy": r.train_busy,
                "aborted": r.aborted,
            }
        sync = modes["Sync+"]["traj_per_s"]
        for m in modes.values():
            m["vs_sync"] = m["traj_per_s"] / sync if sync else None
        rows.append(
            {
                "setting": name,
                "gpus": gpus,
                "trajectories_per_step": batch,
                "trainer": f"{plan.trainer.hw} (at least {plan.trainer.min_gpus}), MFU {plan.trainer.mfu:g}",
                "modes": modes,
                "simulated_in_s": time.perf_counter() - t0,
            }
        )
        print_extrapolation(rows[-1:])
    return rows


def print_extrapolation(rows: list[dict[str, Any]]) -> None:
    for row in rows:
        print(
            f"\n{row['setting']}: {row['trajectories_per_step']} trajectories per step, trainer {row['trainer']} "
            f"(planned and simulated in {row['simulated_in_s']:.0f} s)"
        )
        print(
            f"{'mode':<12}{'trainer':>8}{'rollout':>8}{'train s':>9}{'planned':>9}{'traj/s':>9}{'step s':>9}"
            f"{'vs Sync+':>10}{'gen busy':>10}{'train busy':>11}"
        )
        for label, m in row["modes"].items():
            print(
                f"{label:<12}{m['trainer_gpus']:>8}{m['rollout_gpus']:>8}{m['train_s']:>9.1f}"
                f"{m['predicted_traj_per_s']:>9.2f}{m['traj_per_s']:>9.2f}{m['step_s']:>9.1f}"
                f"{m['vs_sync']:>9.2f}x{m['gen_busy']:>10.0%}{m['train_busy']:>11.0%}"
            )


# 5. cores instead of GPUs ----------------------------------------------------------------------------


def cores_check(res: dict[str, Any], cores: int = 2) -> dict[str, Any]:
    """The planner's trainer model against a bench run on this machine's cores: (a) train_s ∝ 1/T:
    the all-cores step scaled to the half share vs the measured half-core step; (b) each mode's
    throughput from the planner's closed form (:func:`~rollart_core.plan.trainer.step_seconds`) on
    the measured components — generation capacity and trainer step (all cores, scaled linearly to a
    share), the latency term the planner uses (:func:`~rollart_core.plan.planner.rollout_latency`: a
    step's slowest group, drawn from the run's distributions), the weight push and pause — with the
    cores split as the planner
    splits a budget (the overlapping modes: the best split of ``cores``; Sync+ on a shared machine
    gives every stage all cores in turn), vs the mode's measured throughput; (c) the trainer's MFU
    implied by 6 · N · tokens if the model's parameter count is known."""
    cap, size = res.get("capacity") or {}, res["size"]
    if not {"train", "generate"} <= set(cap) or "half_cores_s" not in cap["train"]:
        return {"skipped": "the bench's capacity probe measured no trainer or generation figure"}
    n_step = sum(t["groups_per_step"] * t["group_size"] for t in res["config"]["tasks"])
    train_all = cap["train"]["seconds"] * n_step / cap["train"]["batch"]  # one step's batch, all cores
    gen_all = n_step / cap["generate"]["traj_per_s"]  # one step's batch, all cores, saturated
    env = env_latency(size).mean
    mean_latency = 0.0
    for t in res["config"]["tasks"]:
        turns = _mean([float(x) for x in _samples(res, "sync", t["name"], "turns")], float(t["max_turns"]))
        gen_turn = _mean(_samples(res, "sync", t["name"], "generate"))
        reward = _mean(_samples(res, "sync", t["name"], "reward"))
        mean_latency = max(mean_latency, turns * gen_turn + (turns + 1) * env + reward)
    # the planner's latency term (make_plan): a step's slowest group, drawn from the distributions
    latency = rollout_latency(profile(res, "sync", "from_sync"))[1]
    sizing = TrainerSizing("core", 1, 0.0, 0.0, 1.0, 1.0, measured_s=train_all, measured_gpus=cores)
    scaling = {
        "all_cores_s": cap["train"]["seconds"],
        "half_cores_s": cap["train"]["half_cores_s"],
        "predicted_half_s": sizing.seconds(max(1, cores // 2)) * cap["train"]["batch"] / n_step,
    }
    scaling["ratio"] = scaling["predicted_half_s"] / scaling["half_cores_s"]
    modes: dict[str, Any] = {}
    for mode in VALIDATED:
        if mode in unmeasured(res):
            continue
        cfg = res["mode_configs"][mode]
        push_s, pause_s = _weights(res, mode)
        depth = (cfg.get("max_pending_steps") or cfg["alpha"] + 1) if cfg["mode"] == "async" else 1
        if cfg["mode"] == "sync":
            t_cores, r_cores = cores, cores
            step = step_seconds("sync", gen_all, latency, train_all, push_s, pause_s)
            rate = n_step / step
        else:
            sp = best_split(
                cfg["mode"],
                cores,
                min_trainer=1,
                min_rollout=1,
                gen_compute=lambda r: gen_all * cores / r,
                latency_s=latency,
                depth=depth,
                trainer=sizing,
                push_s=push_s,
                sync_s=pause_s,
                trajectories_per_step=n_step,
            )
            t_cores, r_cores, rate = sp.trainer_gpus, sp.rollout_gpus, sp.traj_per_s
        measured = res["results"][mode]["traj_per_s"]
        modes[mode] = {
            "trainer_cores": t_cores,
            "rollout_cores": r_cores,
            "predicted": rate,
            "measured": measured,
            "ratio": rate / measured if measured else None,
        }
    out: dict[str, Any] = {
        "scaling": scaling,
        "latency_s": latency,
        "mean_latency_s": mean_latency,
        "modes": modes,
    }
    params = _model_params(res)
    if params:
        tokens = cap["train"]["tok_per_s"] * cap["train"]["seconds"]
        out["train_flop_per_s"] = 6 * params * tokens / cap["train"]["seconds"]
        out["params"] = params
    return out


def _model_params(res: dict[str, Any]) -> float | None:
    path = Path(str(res["config"].get("model", {}).get("path") or "")) / "config.json"
    if not path.is_file():
        return None
    return ModelProfile.from_hf_config(json.loads(path.read_text())).params


def print_cores_check(name: str, chk: dict[str, Any]) -> None:
    if "skipped" in chk:
        print(f"\nworkload {name}, cores instead of GPUs: skipped ({chk['skipped']})")
        return
    sc = chk["scaling"]
    print(
        f"\nworkload {name}, cores instead of GPUs: trainer step on all cores {sc['all_cores_s']:.2f} s, "
        f"half {sc['half_cores_s']:.2f} s; 1/T predicts {sc['predicted_half_s']:.2f} s ({sc['ratio']:.2f}×)"
        + (
            f"; 6·N·tokens runs at {chk['train_flop_per_s'] / 1e9:.1f} GFLOP/s (N = {chk['params']:.3g})"
            if "train_flop_per_s" in chk
            else ""
        )
    )
    print(f"{'mode':<12}{'trainer':>8}{'rollout':>8}{'planned':>9}{'measured':>10}{'ratio':>7}")
    for mode, m in chk["modes"].items():
        r = m["ratio"]
        flag = "" if r is not None and abs(r - 1) <= GOAL else "!"
        print(
            f"{MODES[mode].label:<12}{m['trainer_cores']:>8}{m['rollout_cores']:>8}{m['predicted']:>9.2f}"
            f"{m['measured']:>10.2f}{'-' if r is None else f'{r:.2f}':>7}{flag}"
        )


# main ------------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--small", "--quick", action="store_true", help="the bench's micro size: a check that it runs"
    )
    ap.add_argument(
        "--set",
        nargs="+",
        default=["env_latency_s=0.1"],
        metavar="FIELD=VALUE",
        help="the second workload (bench size fields; default env_latency_s=0.1)",
    )
    ap.add_argument("--no-second", action="store_true", help="only the default workload")
    ap.add_argument("--rounds", type=int, help="override the bench size's rounds")
    ap.add_argument("--steps", type=int, help="override the bench size's measured steps per segment")
    ap.add_argument("--sim-steps", type=int, default=40, help="steps of the long-run simulation (default 40)")
    ap.add_argument("--seeds", type=int, default=40, help="simulated bench segments per mode (default 40)")
    ap.add_argument(
        "--extrapolate-steps", type=int, default=8, help="simulated steps at paper scale (0: skip)"
    )
    ap.add_argument("--out", default="planner_validation.json")
    ap.add_argument(
        "--model", help="model directory (default: the tiny model, created under the output directory)"
    )
    ap.add_argument(
        "--replay", help="a JSON written earlier: simulate its measured runs again, measure nothing"
    )
    args = ap.parse_args()
    out = Path(args.out).resolve()
    if args.replay:
        old = json.loads(Path(args.replay).read_text())
        runs = {name: (w["overrides"], w["bench"]) for name, w in old["workloads"].items()}
    else:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # as rollart bench
        size_name = "micro" if args.small else "quick"
        base: dict[str, Any] = {k: v for k in ("rounds", "steps") if (v := getattr(args, k)) is not None}
        workloads = {"default": base}
        if not args.no_second:
            workloads["second"] = {**base, **parse_overrides(args.set)}
        runs = {}
        model = Path(args.model).resolve() if args.model else out.parent / f"{out.stem}-model"
        for name, overrides in workloads.items():
            t0 = time.perf_counter()
            res = measure(size_name, overrides, out.parent / f"{out.stem}-{name}", model)
            print(f"measured workload {name} in {time.perf_counter() - t0:.0f} s", flush=True)
            runs[name] = (overrides, res)
        # what was measured is kept before anything is simulated: --replay can start from it
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(
            json.dumps(
                {"workloads": {n: {"overrides": o, "bench": r} for n, (o, r) in runs.items()}}, default=str
            )
        )
    result: dict[str, Any] = {"sim_steps": args.sim_steps, "seeds": args.seeds, "workloads": {}}
    for name, (overrides, res) in runs.items():
        cmp = compare(res, args.sim_steps, args.seeds)
        print_comparison(name, overrides, cmp)
        chk = cores_check(res)
        print_cores_check(name, chk)
        result["workloads"][name] = {"overrides": overrides, **cmp, "cores": chk, "bench": res}
    if args.extrapolate_steps:
        print("\nextrapolation (simulated, paper-like workload: ASSUMED figures, see paper_profile)")
        result["extrapolation"] = extrapolate(args.extrapolate_steps)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
