"""Reward offload benchmark: the same bursty reward workload, colocated vs offloaded, in one run.

    uv run --no-sync python integration/bench/reward_bench.py [--quick] [--out reward_bench.json]

Each RL step: trajectories finish generation at bursty, heavy-tailed times; each needs a reward call
(``synthetic`` reward, ``sleep`` mode: an I/O-bound reward such as a sandbox or a remote judge, so
that 2 CPU cores do not cap concurrency); then a training phase in which no rewards are requested.
Every variant runs the reference function runtime (``rollart-reward serve``, real processes, real
HTTP on 127.0.0.1) and the HTTP executor, so only the provisioning policy differs:

- ``colocated_peak``: a fixed dedicated pool sized for the peak (min = max = peak workers, never
  scales); what the brief calls colocated.
- ``colocated_avg``: a fixed pool sized for the average concurrency over a step (cost-conscious
  dedicated deployment).
- ``offloaded``: the elastic runtime, scale from zero on demand, idle workers stopped after
  ``--idle-timeout``.

Reported per variant: utilisation = busy / provisioned worker-seconds (from the runtime's /stats),
rollout time per step (step start → last reward of the step), cold starts, peak workers. Ratios are
against ``colocated_peak`` measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import subprocess
import sys
import time
from typing import Any

import httpx

from rollart_core.types import Trajectory
from rollart_reward.http_executor import HttpExecutor, HttpExecutorConfig


def workload(steps: int, n: int, seed: int) -> list[list[tuple[float, float]]]:
    """Per step: (finish offset s, reward work s) per trajectory."""
    rng = random.Random(seed)
    out = []
    for _ in range(steps):
        step = []
        for _ in range(n):
            finish = rng.uniform(0, 0.15) if rng.random() < 0.75 else rng.uniform(0.15, 1.0)  # burst + tail
            work = min(1.5, rng.lognormvariate(math.log(0.25), 0.5))
            step.append((finish, work))
        out.append(step)
    return out


def serve(args: list[str]) -> tuple[subprocess.Popen[str], str]:
    exe = os.path.join(os.path.dirname(sys.executable), "rollart-reward")
    cmd = [exe] if os.path.exists(exe) else [sys.executable, "-m", "rollart_reward.cli"]
    proc = subprocess.Popen([*cmd, "serve", "--function", "synthetic", "--admin", *args],
                            stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()  # type: ignore[union-attr]
    if not line.startswith("serving"):
        proc.kill()
        raise SystemExit(f"runtime failed to start: {line!r}")
    return proc, line.split()[-1]


async def run_variant(name: str, url: str, load: list[list[tuple[float, float]]], train_s: float) -> dict[str, Any]:
    ex = HttpExecutor(HttpExecutorConfig(url=url, function="synthetic", timeout_s=30, cold_start_timeout_s=30,
                                         max_concurrency=256))
    async with httpx.AsyncClient() as c:
        await c.post(f"{url}/admin/reset")
    step_times = []
    t_run = time.monotonic()
    try:
        for s, step in enumerate(load):
            t0 = time.monotonic()

            async def one(i: int, finish: float, work: float, s: int = s) -> None:
                await asyncio.sleep(finish)  # generation of this trajectory ends
                await ex.score(Trajectory(traj_id=f"{name}-s{s}-{i}", task="t", env_id="e", group_id=f"s{s}",
                                          seed=i, start_version=s, info={"work_s": work}))

            await asyncio.gather(*(one(i, f, w) for i, (f, w) in enumerate(step)))
            step_times.append(time.monotonic() - t0)
            await asyncio.sleep(train_s)  # training: no reward calls
    finally:
        await ex.aclose()
    async with httpx.AsyncClient() as c:
        st = (await c.get(f"{url}/stats")).json()
    return {
        "variant": name,
        "utilisation": st["utilisation"],
        "busy_s": st["busy_s"],
        "provisioned_s": st["provisioned_s"],
        "rollout_s_per_step": sum(step_times) / len(step_times),
        "step_times_s": step_times,
        "cold_starts": st["cold_starts"],
        "cold_start_s_mean": st["cold_start_s_mean"],
        "peak_workers": st["peak_workers"],
        "queue_delay_s_mean": st["queue_delay_s_mean"],
        "wall_s": time.monotonic() - t_run,
        "client_retries": ex.stats()["retries"],
    }


def peak_concurrency(load: list[list[tuple[float, float]]]) -> tuple[int, float]:
    """Peak and average number of rewards running at once with unlimited workers."""
    peak, avg = 0, []
    for step in load:
        events = sorted([(f, 1) for f, _ in step] + [(f + w, -1) for f, w in step])
        cur = 0
        for _, d in events:
            cur += d
            peak = max(peak, cur)
        span = max(f + w for f, w in step)
        avg.append(sum(w for _, w in step) / span)
    return peak, sum(avg) / len(avg)


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="3 steps of 24 trajectories")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--per-step", type=int, default=48)
    p.add_argument("--train-s", type=float, default=1.5, help="training phase per step (no rewards)")
    p.add_argument("--idle-timeout", type=float, default=0.02, help="offloaded: idle worker lifetime")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="reward_bench.json")
    a = p.parse_args()
    if a.quick:
        a.steps, a.per_step = 3, 24
    load = workload(a.steps, a.per_step, a.seed)
    peak, avg = peak_concurrency(load)
    avg_workers = max(1, math.ceil(avg))
    variants = [
        ("colocated_peak", ["--min-workers", str(peak), "--max-workers", str(peak), "--idle-timeout", "3600"]),
        ("colocated_avg", ["--min-workers", str(avg_workers), "--max-workers", str(avg_workers),
                           "--idle-timeout", "3600"]),
        ("offloaded", ["--min-workers", "0", "--max-workers", str(peak * 2), "--idle-timeout", str(a.idle_timeout)]),
    ]
    rows = []
    for name, args in variants:
        proc, url = serve(args)
        try:
            if name.startswith("colocated"):  # a dedicated pool is up before the run starts
                deadline = time.monotonic() + 60
                while httpx.get(f"{url}/stats").json()["workers"] < int(args[1]) and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
            rows.append(await run_variant(name, url, load, a.train_s))
        finally:
            proc.terminate()
            proc.wait(30)
    base = rows[0]
    for r in rows:
        r["rollout_ratio_vs_peak"] = r["rollout_s_per_step"] / base["rollout_s_per_step"]
    print(f"workload: {a.steps} steps x {a.per_step} trajectories, peak concurrency {peak}, "
          f"average {avg:.1f}, training phase {a.train_s}s/step")
    print(f"{'variant':<16}{'workers':>9}{'util':>8}{'busy_s':>9}{'prov_s':>9}{'rollout_s/step':>16}"
          f"{'ratio':>7}{'cold':>6}{'queue_s':>9}")
    for r in rows:
        print(f"{r['variant']:<16}{r['peak_workers']:>9}{r['utilisation']:>8.1%}{r['busy_s']:>9.1f}"
              f"{r['provisioned_s']:>9.1f}{r['rollout_s_per_step']:>16.3f}{r['rollout_ratio_vs_peak']:>7.2f}"
              f"{r['cold_starts']:>6}{r['queue_delay_s_mean']:>9.3f}")
    result = {"config": vars(a), "peak_concurrency": peak, "avg_concurrency": avg, "variants": rows}
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    asyncio.run(main())
