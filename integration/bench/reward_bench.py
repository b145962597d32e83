"""Reward offload benchmark: the same bursty reward workload, colocated vs offloaded, in one run.

    uv run --no-sync python integration/bench/reward_bench.py [--quick] [--out reward_bench.json]

Workload (per RL step; the same draws for every variant): ``--per-step`` trajectories finish
generation at bursty, heavy-tailed times over ``--gen-span`` seconds (75% in the first 15%, the rest
spread over the span; generation itself is NOT run: these are synthetic finish times), each then
needs one reward call costing ``work`` seconds of compute (log-normal, median 0.25 s, capped at
1.5 s); then a training phase (``--train-s``) in which no rewards are requested. By default the
training phase is derived so that the dedicated worker's duty cycle is the RollArt paper's
colocated value (``--duty`` 6.5%): train = mean reward work per step x f_cal x (1/duty - 1), capped
by ``--max-train-s`` (f_cal: see below; the cap makes the duty higher on a loaded machine and in
``--quick``).

Variants, interleaved within every step (same finish times; the colocated burst first, then each
offloaded variant's burst in an order that rotates from step to step, each alone on the machine,
then the training phase), each behind its own
reference function runtime (``rollart-reward serve``: real processes, real HTTP on 127.0.0.1, the
HTTP executor as client):

- ``colocated``: ONE fixed dedicated worker with fixed compute (one process = one core of this
  machine) that runs the ``synthetic`` reward in ``cpu`` mode (burns ``work`` s of CPU time: real
  work). It is sized for the peak in memory/concurrency (the runtime admits the whole burst and
  queues it), not in compute, so a burst really contends on it. Provisioned = the worker, the whole
  run (training phases included).
- ``offloaded*``: the elastic runtime (scale from zero, a worker process per concurrent call, idle
  workers stopped after the keep-alive). **FAKE cloud platform:** a real serverless platform gives
  every instance its own compute, which this 2-core machine cannot, so each instance runs the
  ``synthetic`` reward in ``sleep`` mode for the *measured* single-call service time of the same
  work on the dedicated worker: work x f, f = that step's colocated busy time / CPU work (the
  dedicated worker runs calls one at a time, so each is a solo call; f = 1 on an idle core, more when
  other jobs share the core). Cold starts (a real fork of a warm template), scale-to-zero, instance
  reuse and per-instance provisioning are real.
  The variants sweep the keep-alive: ``offloaded`` is the runtime's default policy (``learned``: the
  keep-alive that minimised provisioned time over the recent idle periods, at most the ski-rental
  value); ``offloaded_ski`` keeps an idle instance max(--idle-timeout, moving average of the cold
  start) (ski rental); ``offloaded_ka<k>`` keep idle instances exactly k seconds.

Reported per variant: utilisation = busy / provisioned, provisioned = every instance's lifetime
(cold start and keep-alive included; the conservative count); ``util_billed`` = busy / a per-request
bill (Lambda / FC on-demand: invocation duration rounded up to 1 ms plus the cold-start init; idle
keep-alive is not billed); rollout time per step = step start -> last reward of the step for that
variant; ratio = against ``colocated`` in the same run. Goal (issue 5): ``offloaded`` utilisation
>= 85% and rollout ratio <= 0.6. Results depend on the machine's load: the load average and the
calibration factor (wall/CPU of a solo call on the dedicated worker, before and during the run) are
printed and written to the JSON. With the default 5 steps x 16 trajectories a run takes ~7 min on an
idle machine (up to ~12 min on a loaded one); ``--quick`` (3 x 8, training phase capped at 25 s) ~2 min.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from typing import Any

import httpx

from rollart_core.types import Trajectory
from rollart_reward.http_executor import HttpExecutor, HttpExecutorConfig

FAKE_NOTE = (
    "offloaded*: FAKE cloud platform - each instance's compute is emulated by sleeping for the "
    "measured single-call service time on the dedicated worker (work x f); cold starts, scale-to-zero, instance "
    "reuse and lifetimes are real processes"
)

Load = list[list[tuple[float, float]]]


def workload(steps: int, n: int, seed: int, gen_span: float) -> Load:
    """Per step: (generation finish offset s, reward work s) per trajectory."""
    rng = random.Random(seed)
    out = []
    for _ in range(steps):
        step = []
        for _ in range(n):
            u = rng.uniform(0, 0.15) if rng.random() < 0.75 else rng.uniform(0.15, 1.0)  # burst + tail
            work = min(1.5, rng.lognormvariate(math.log(0.25), 0.5))
            step.append((u * gen_span, work))
        out.append(step)
    return out


def peak_concurrency(load: Load) -> int:
    """Peak number of rewards running at once if every call had its own compute."""
    peak = 0
    for step in load:
        cur = 0
        for _, d in sorted([(f, 1) for f, _ in step] + [(f + w, -1) for f, w in step]):
            cur += d
            peak = max(peak, cur)
    return peak


def serve(args: list[str]) -> tuple[subprocess.Popen[str], str]:
    exe = os.path.join(os.path.dirname(sys.executable), "rollart-reward")
    cmd = [exe] if os.path.exists(exe) else [sys.executable, "-m", "rollart_reward.cli"]
    proc = subprocess.Popen(
        [*cmd, "serve", "--function", "synthetic", "--admin", *args], stdout=subprocess.PIPE, text=True
    )
    line = proc.stdout.readline()  # type: ignore[union-attr]
    if not line.startswith("serving"):
        proc.kill()
        proc.wait()
        raise SystemExit(f"runtime failed to start: {line!r}")
    return proc, line.split()[-1]


def traj(tid: str, s: int, i: int, work: float) -> Trajectory:
    return Trajectory(
        traj_id=tid, task="t", env_id="e", group_id=f"s{s}", seed=i, start_version=s, info={"work_s": work}
    )


def executor(url: str) -> HttpExecutor:
    return HttpExecutor(
        HttpExecutorConfig(
            url=url,
            function="synthetic",
            timeout_s=600,
            cold_start_timeout_s=600,
            max_concurrency=1024,
            fallback="none",
        )
    )


async def stats(c: httpx.AsyncClient, url: str) -> dict[str, Any]:
    return (await c.get(f"{url}/stats")).json()


async def calibrate(
    c: httpx.AsyncClient, url: str, ex: HttpExecutor, work: float, n: int, tag: str
) -> list[float]:
    """Solo calls on the dedicated worker: measured service time / CPU work (1.0 on an idle core)."""
    out = []
    for i in range(n):
        before = (await stats(c, url))["busy_s"]
        await ex.score(traj(f"cal-{tag}-{i}", -1, i, work))
        out.append(((await stats(c, url))["busy_s"] - before) / work)
    return out


async def burst(ex: HttpExecutor, name: str, s: int, step: list[tuple[float, float]], f: float) -> float:
    """One step's rewards for one variant: each call sent when its trajectory finishes generation, work
    scaled by ``f`` (offloaded: the measured service time); returns step start -> last reward."""
    t0 = time.monotonic()

    async def one(i: int, finish: float, work: float) -> float:
        await asyncio.sleep(max(0.0, t0 + finish - time.monotonic()))  # generation of this trajectory ends
        await ex.score(traj(f"{name}-s{s}-{i}", s, i, work * f))
        return time.monotonic() - t0

    return max(await asyncio.gather(*(one(i, fin, w) for i, (fin, w) in enumerate(step))))


async def until(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not await cond():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--quick", action="store_true", help="3 steps of 8 trajectories, training phase capped at 25 s"
    )
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--per-step", type=int, default=16)
    p.add_argument("--gen-span", type=float, default=1.0, help="generation finish times span (s)")
    p.add_argument(
        "--duty", type=float, default=0.065, help="colocated duty cycle the training phase is derived from"
    )
    p.add_argument(
        "--train-s", type=float, default=None, help="training phase per step (default: from --duty)"
    )
    p.add_argument("--max-train-s", type=float, default=120.0)
    p.add_argument(
        "--idle-timeout",
        type=float,
        default=0.02,
        help="offloaded: ski-rental floor (learned: ceiling = max(this, cold start))",
    )
    p.add_argument(
        "--keep-alive", default="0.01,0.1,0.5,2.0", help="fixed keep-alive sweep (s), comma-separated"
    )
    p.add_argument("--calibration-calls", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="reward_bench.json")
    a = p.parse_args()
    if a.quick:
        a.steps, a.per_step, a.max_train_s = 3, 8, 25.0
    load = workload(a.steps, a.per_step, a.seed, a.gen_span)
    peak = peak_concurrency(load)
    work_per_step = statistics.mean(sum(w for _, w in step) for step in load)
    keep_alives = [float(k) for k in a.keep_alive.split(",") if k.strip()]
    load_before = os.getloadavg()

    specs: list[tuple[str, list[str]]] = [
        (
            "colocated",
            [
                "--options",
                json.dumps({"mode": "cpu"}),
                "--min-workers",
                "1",
                "--max-workers",
                "1",
                "--idle-timeout",
                "3600",
            ],
        ),
        (
            "offloaded",
            [
                "--options",
                json.dumps({"mode": "sleep"}),
                "--min-workers",
                "0",
                "--max-workers",
                str(a.per_step),
                "--idle-timeout",
                str(a.idle_timeout),
            ],
        ),
        (
            "offloaded_ski",
            [
                "--options",
                json.dumps({"mode": "sleep"}),
                "--min-workers",
                "0",
                "--max-workers",
                str(a.per_step),
                "--idle-timeout",
                str(a.idle_timeout),
                "--idle-policy",
                "ski_rental",
            ],
        ),
    ] + [
        (
            f"offloaded_ka{k:g}",
            [
                "--options",
                json.dumps({"mode": "sleep"}),
                "--min-workers",
                "0",
                "--max-workers",
                str(a.per_step),
                "--idle-timeout",
                str(k),
                "--idle-policy",
                "fixed",
            ],
        )
        for k in keep_alives
    ]
    procs: dict[str, tuple[subprocess.Popen[str], str]] = {}
    try:
        for name, args in specs:
            procs[name] = serve(args)
        urls = {name: url for name, (_, url) in procs.items()}
        exs = {name: executor(url) for name, url in urls.items()}
        async with httpx.AsyncClient(timeout=60) as c:
            cu = urls["colocated"]
            await until(lambda: _workers_at_least(c, cu, 1), 60, "the dedicated worker")
            cal = await calibrate(c, cu, exs["colocated"], 0.1, a.calibration_calls, "start")
            f_cal = statistics.median(cal)
            train_s = (
                a.train_s
                if a.train_s is not None
                else min(a.max_train_s, work_per_step * f_cal * (1 / a.duty - 1))
            )
            for url in urls.values():
                await c.post(f"{url}/admin/reset")
            step_times: dict[str, list[float]] = {name: [] for name in urls}
            f_steps: list[float] = []
            t_run = time.monotonic()
            for s, step in enumerate(load):
                # colocated first, then each offloaded variant, each burst alone on the machine; the
                # offloaded order rotates every step (the first one after the colocated burst had up to
                # 2.5x slower cold starts than the others in full runs: no variant always takes that place)
                busy0 = (await stats(c, cu))["busy_s"]
                offl = [n for n in urls if n != "colocated"]
                for name in ["colocated", *offl[s % len(offl) :], *offl[: s % len(offl)]]:
                    f = 1.0 if name == "colocated" else f_steps[-1]
                    step_times[name].append(await burst(exs[name], name, s, step, f))
                    if name == "colocated":  # FIFO on one worker: every call's service time is a solo one
                        f_steps.append(((await stats(c, cu))["busy_s"] - busy0) / sum(w for _, w in step))
                print(
                    f"step {s}: f={f_steps[-1]:.2f} "
                    + "  ".join(f"{n}={v[-1]:.2f}s" for n, v in step_times.items()),
                    flush=True,
                )
                await asyncio.sleep(train_s)  # training: no reward calls
            wall = time.monotonic() - t_run
            st = {name: await stats(c, url) for name, url in urls.items()}
            f_run = statistics.mean(f_steps)
            cal_end = await calibrate(c, cu, exs["colocated"], 0.1, a.calibration_calls, "end")
        for ex in exs.values():
            await ex.aclose()
    finally:
        for proc, _ in procs.values():
            proc.terminate()
        for proc, _ in procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    rows = []
    for name, s in st.items():
        rows.append(
            {
                "variant": name,
                "platform": "local dedicated worker (1 core, real CPU work)"
                if name == "colocated"
                else "FAKE cloud platform (emulated instance compute, real instances)",
                "keep_alive": "fixed (dedicated)"
                if name == "colocated"
                else (
                    "learned (runtime default)"
                    if name == "offloaded"
                    else f"ski rental max({a.idle_timeout:g}s, cold-start EWMA)"
                    if name == "offloaded_ski"
                    else name.split("_ka")[1]
                ),
                "utilisation": s[
                    "utilisation"
                ],  # a dedicated worker is paid for all the time: no per-request bill
                "utilisation_billed": None if name == "colocated" else s["utilisation_billed"],
                "busy_s": s["busy_s"],
                "provisioned_s": s["provisioned_s"],
                "billed_s": None if name == "colocated" else s["billed_s"],
                "rollout_s_per_step": statistics.mean(step_times[name]),
                "step_times_s": step_times[name],
                "peak_workers": s["peak_workers"],
                "cold_starts": s["cold_starts"],
                "cold_start_s_mean": s["cold_start_s_mean"],
                "queue_delay_s_mean": s["queue_delay_s_mean"],
                "calls": s["calls"],
                "failures": s["failures"],
                "client_retries": exs[name].stats()["retries"],
            }
        )
    base = rows[0]["rollout_s_per_step"]
    for r in rows:
        r["rollout_ratio"] = r["rollout_s_per_step"] / base
    head = next(r for r in rows if r["variant"] == "offloaded")
    met = head["utilisation"] >= 0.85 and head["rollout_ratio"] <= 0.6
    load_after = os.getloadavg()

    print(
        f"\nworkload: {a.steps} steps x {a.per_step} trajectories, generation span {a.gen_span:g}s "
        f"(synthetic finish times), reward work/step {work_per_step:.2f} CPU-s (median call 0.25 s), "
        f"peak concurrency {peak}, training phase {train_s:.1f}s/step (duty {a.duty:.1%}), run {wall:.0f}s"
    )
    print(
        f"f = service time / CPU work on the dedicated worker: calibration {f_cal:.2f}, per step "
        f"{' '.join(f'{x:.2f}' for x in f_steps)}, "
        f"end {statistics.median(cal_end):.2f}; load average before {load_before[0]:.1f}, after {load_after[0]:.1f}"
    )
    print(FAKE_NOTE)
    print(
        f"{'variant':<24}{'keep-alive':>12}{'inst':>6}{'util':>8}{'util_bill':>10}{'busy_s':>8}{'prov_s':>8}"
        f"{'rollout_s/step':>16}{'ratio':>7}{'cold':>6}{'cold_s':>8}{'queue_s':>9}"
    )
    for r in rows:
        ka = {"colocated": "dedicated", "offloaded": "learned", "offloaded_ski": "ski rental"}.get(
            r["variant"], r["keep_alive"] + "s"
        )
        tag = "" if r["variant"] == "colocated" else " [FAKE]"
        print(
            f"{r['variant'] + tag:<24}{ka:>12}{r['peak_workers']:>6}{r['utilisation']:>8.1%}"
            f"{'-' if r['utilisation_billed'] is None else format(r['utilisation_billed'], '.1%'):>10}{r['busy_s']:>8.1f}{r['provisioned_s']:>8.1f}"
            f"{r['rollout_s_per_step']:>16.3f}{r['rollout_ratio']:>7.2f}{r['cold_starts']:>6}"
            f"{r['cold_start_s_mean']:>8.3f}{r['queue_delay_s_mean']:>9.3f}"
        )
    print(
        f"goal (offloaded util >= 85% and rollout ratio <= 0.6): {'MET' if met else 'NOT MET'} "
        f"(util {head['utilisation']:.1%}, ratio {head['rollout_ratio']:.2f})"
    )
    result = {
        "config": vars(a),
        "fake": FAKE_NOTE,
        "train_s": train_s,
        "peak_concurrency": peak,
        "reward_work_per_step_s": work_per_step,
        "wall_s": wall,
        "service_factor": {
            "calibration_start": cal,
            "f_cal": f_cal,
            "per_step": f_steps,
            "mean": f_run,
            "calibration_end": cal_end,
        },
        "loadavg_before": load_before,
        "loadavg_after": load_after,
        "goal": {
            "offloaded_utilisation": head["utilisation"],
            "rollout_ratio": head["rollout_ratio"],
            "met": met,
        },
        "variants": rows,
    }
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {a.out}")


async def _workers_at_least(c: httpx.AsyncClient, url: str, n: int) -> bool:
    return (await stats(c, url))["workers"] >= n


if __name__ == "__main__":
    asyncio.run(main())
