"""Chaos run: an async multi-task run on the real stack while faults are injected on a seeded schedule.

    uv run --no-sync python integration/bench/chaos.py --quick [--seed 0] [--out runs/bench/chaos.json] [--driver-kill]

The run: two built-in environments (FrozenLake and Sokoban), ``loop.mode: async``, alpha 1; two vLLM
CPU engines as Ray actors (``engines[].max_restarts``; engine core in the actor's process,
``VLLM_ENABLE_V1_MULTIPROCESSING=0``); the trainer as a worker group (``trainer.ranks``,
``loop.save_every: 1``, ``max_trainer_restarts``); environments in the EnvManager (``--quick``: four
Ray actors of four environments; else eight of four); rewards through ``reward_executor: serverless``
(a ``rollart-reward serve`` runtime per task, which the pipeline starts). The pipeline starts the
trainer group, the engines and the env actors side by side.

Faults, on a schedule drawn from ``--seed`` (each fires when the trainer reaches a version):

- ``engine``: one engine actor is SIGKILLed first of all, as soon as the run's first requests are out,
  so that Ray's restart and the proxy's recovery (start, then the served weights, then requests) fit
  in the run; the other engine serves meanwhile. Reported: the trainer version when it was back
  (``engine_back_at_version``), the version it was brought to, and the requests it served after;
- ``env``: 10% of the env actors (at least one) are SIGKILLed, one at a time, at drawn versions;
- ``reward``: the reward runtime's own fault injection (``runtime.faults``) answers 503 to 10% of
  calls and holds back 10% for longer than the client waits even while the runtime may be cold
  (``delay_s`` > ``cold_start_timeout_s``), for the whole run: 20% of calls fail, by 503 or by a
  client timeout, and are retried;
- ``trainer``: one trainer rank is SIGKILLed once, at a drawn version >= 2 (the group comes back
  from the newest checkpoint);
- ``elastic``: an engine is added through the run's admin endpoint at a drawn version, then one of the
  first engines is removed with a one-second drain (``chaos_elastic.py``).

Checked afterwards (the table, and ``--out`` as JSON): steps done / asked; launched vs the sum of
fates; trajectories trained twice (from the step rows' ``batch_traj_ids``); trajectories trained with
lag > alpha (``batch_start_versions`` against the step's version); the killed engine back and serving
before the run ended; seconds lost per fault (the steps around it against the median step); and
processes left behind: every process seen descending from this one during the run (sampled every
0.2 s), not alive before, still alive 15 s after the pipeline closed (but the driver's own watchdog,
which lives as long as the driver does). Wall time is split into the
pipeline's build (with its phases) and the run.

``--driver-kill`` then runs the driver's own death (``chaos_driver.py``): the same config as a
``rollart train`` process, SIGKILLed after a checkpoint; no process of it may be left 10 s later, and
``resume_from`` the newest checkpoint must complete its steps.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from rollart_core.resources import LOOPBACK_ENV

# -------------------------------------------------------------------------------------------- processes


def _stat(pid: int) -> tuple[int, str, int] | None:
    """(parent pid, state, start time in clock ticks) of ``pid``; None when it is gone."""
    try:
        rest = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(rest[1]), rest[0], int(rest[19])


def own_processes() -> dict[int, int]:
    """This user's processes: pid -> start time (a pid reused later has another start time)."""
    uid, out = os.getuid(), {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if d.stat().st_uid != uid:
                    continue
            except OSError:
                continue
            st = _stat(int(d.name))
            if st is not None and st[1] != "Z":
                out[int(d.name)] = st[2]
    return out


class DescendantWatch:
    """Samples the process tree below this process in a thread: every (pid, start time) ever seen."""

    def __init__(self, interval: float = 0.2) -> None:
        self.seen: dict[int, tuple[int, str]] = {}  # pid -> (start time, command)
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="chaos-descendants", daemon=True)

    def _sample(self) -> None:
        parents: dict[int, list[int]] = {}
        starts: dict[int, int] = {}
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                st = _stat(int(d.name))
                if st is not None and st[1] != "Z":
                    parents.setdefault(st[0], []).append(int(d.name))
                    starts[int(d.name)] = st[2]
        todo, me = [os.getpid()], os.getpid()
        while todo:
            pid = todo.pop()
            for child in parents.get(pid, []):
                todo.append(child)
                if child != me and child not in self.seen:
                    try:
                        cmd = (
                            Path(f"/proc/{child}/cmdline")
                            .read_bytes()
                            .replace(b"\0", b" ")[:160]
                            .decode(errors="replace")
                        )
                    except OSError:
                        cmd = "?"
                    self.seen[child] = (starts[child], cmd)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval)

    def __enter__(self) -> DescendantWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def alive(self, before: dict[int, int]) -> dict[int, str]:
        """Seen descendants still running (same start time) that were not running before the run."""
        out = {}
        for pid, (start, cmd) in self.seen.items():
            st = _stat(pid)
            if st is not None and st[1] != "Z" and st[2] == start and before.get(pid) != start:
                out[pid] = cmd
        return out


# --------------------------------------------------------------------------------------------- config


def chaos_config(root: Path, *, quick: bool, seed: int) -> Any:
    from rollart_core.config import RunConfig

    # Enough steps that the killed engine is back and serving before the run ends: its restart (a new
    # actor process, vLLM imported twice: actor and engine core, the model loaded) competes with the
    # run for the same cores and took ~100 s, as long as ~35 median steps, on the 2-core machine.
    steps = 40 if quick else 60
    num_envs = 8 if quick else 16  # per task; four environments per actor: 4 (8) env actors
    reward_executor = {
        "impl": "serverless",
        "options": {
            "num_cpus": 0.1,
            "runtime": {
                "max_workers": 1,
                "idle_timeout_s": 30.0,
                # fault injection of the runtime itself: 10% 503 before running, 10% answers held
                # back past the client's timeout, warm or cold (20% of calls fail; the executor
                # retries them under the same idempotency key)
                "faults": {"seed": seed, "error_before": 0.1, "delay": 0.1, "delay_s": 8.0},
            },
            "http": {
                "fallback": "none",
                "timeout_s": 2.0,
                "cold_start_timeout_s": 6.0,  # < delay_s: a held-back answer times out in the cold window too
                "retries": 5,
                "backoff_base_s": 0.02,
                "backoff_max_s": 0.2,
                "breaker_failures": 16,
                "seed": seed,
            },
        },
    }
    task = {
        "reward": {"impl": "success"},
        "reward_executor": reward_executor,
        "sampling": {"max_tokens": 1, "temperature": 1.0},
        "group_size": 4,
        "groups_per_step": 1,
    }
    return RunConfig.model_validate(
        {
            "name": "chaos",
            "output_dir": str(root / "run"),
            "seed": seed,
            "model": {"path": str(root / "model"), "create_tiny": True, "dtype": "float32"},
            "engines": [
                {
                    "name": "gen",
                    "impl": "vllm",
                    "count": 2,
                    "num_cpus": 0.25,
                    "max_restarts": 2,
                    "options": {"max_model_len": 512, "dtype": "float32", "max_num_seqs": 32},
                }
            ],
            "tasks": [
                {
                    **task,
                    "name": "frozenlake",
                    "max_turns": 6,
                    "env": {"impl": "frozenlake", "options": {"size": 4, "hole_prob": 0.2, "max_steps": 6}},
                },
                {
                    **task,
                    "name": "sokoban",
                    "max_turns": 6,
                    "env": {
                        "impl": "sokoban",
                        "options": {"size": 5, "num_boxes": 1, "reverse_steps": 4, "max_steps": 6},
                    },
                },
            ],
            "trainer": {
                "impl": "torch",
                "ranks": 1 if quick else 2,
                "pool": "H800",
                "num_cpus": 0.25,
                "options": {"lr": 0.01, "num_threads": 1},
            },
            "weight_store": {"impl": "filesystem", "options": {"root": str(root / "weights")}},
            "loop": {
                "mode": "async",
                "alpha": 1,
                "steps": steps,
                "save_every": 1,
                "max_trainer_restarts": 2,
                "stall_timeout_s": 180,
            },
            "env_manager": {
                "num_envs": num_envs,
                "options": {
                    "envs_per_actor": 4,
                    "num_cpus_per_actor": 0.01,
                    "reset_timeout_s": 30,
                    "step_timeout_s": 30,
                },
            },
            "ray": {"num_cpus": 4, "resources": {"H800": 2, "env": 64}},
        }
    )


ENGINE_KILL_VERSION = 0
"""The engine dies first, as soon as the run's first requests are out: its restart (a new actor
process, vLLM's start, the served weights) is the longest of all recoveries, and it must be back and
serving before the run ends."""


def schedule(seed: int, steps: int, env_actors: int) -> list[dict[str, Any]]:
    """The faults and the trainer version at which each fires (a pure function of the seed)."""
    rng = random.Random(seed)
    last = max(2, steps - 2)  # leave steps after every fault to see the recovery
    # distinct versions while there are enough, so each fault's cost shows
    free = list(range(1, last + 1))
    rng.shuffle(free)
    trainer_at = rng.choice([v for v in free if v >= 2])  # checkpoint-1 exists by then
    free.remove(trainer_at)
    envs = max(1, math.ceil(0.1 * env_actors))
    faults = [{"kind": "engine", "at_version": ENGINE_KILL_VERSION, "pick": rng.random()}]
    faults += [
        {"kind": "env", "at_version": free[i % len(free)] if free else trainer_at, "pick": rng.random()}
        for i in range(envs)
    ]
    faults.append({"kind": "trainer", "at_version": trainer_at, "pick": rng.random()})
    return sorted(faults, key=lambda f: (f["at_version"], f["kind"]))


# ------------------------------------------------------------------------------------------------ faults


async def _actor_pid(handle: Any) -> int:
    return await handle.__ray_call__.remote(lambda self: os.getpid())


async def runtime_counters(executor: Any) -> dict[str, Any]:
    """The reward runtime's own ``/stats`` (its injected-fault counters), over its loopback URL."""
    import httpx

    try:
        async with httpx.AsyncClient(trust_env=False, timeout=10) as client:
            r = await client.get(
                executor.url.rstrip("/") + "/stats", headers={"Authorization": f"Bearer {executor.api_key}"}
            )
            return dict(r.json())
    except Exception as exc:  # a report without the counters, not a failed run
        return {"error": repr(exc)}


async def inject(p: Any, fault: dict[str, Any]) -> dict[str, Any]:
    """Fire one fault now: SIGKILL the picked process. Returns what was killed."""
    kind = fault["kind"]
    if kind == "env":
        live = sorted((a for a in p.env_manager.actors if a.alive), key=lambda a: a.name)
        actor = live[int(fault["pick"] * len(live))]
        pid = await _actor_pid(actor.handle)
        target = f"env actor {actor.name} ({len(actor.envs)} envs)"
    elif kind == "engine":
        actor = p.actors[int(fault["pick"] * len(p.actors))]
        worker = next(w for w in p.proxy.workers.values() if w.engine.handle is actor)
        pid = await actor.pid.remote()
        target = f"engine actor {worker.name}"
        os.kill(pid, signal.SIGKILL)  # a process of the Ray cluster this run started
        return {"target": target, "pid": pid, "worker": worker.name, "served_before": worker.served}
    else:
        pids = list(p.trainer.pids)
        pid = pids[int(fault["pick"] * len(pids))]
        target = f"trainer rank {pids.index(pid)} of {len(pids)}"
    os.kill(pid, signal.SIGKILL)  # a process of the Ray cluster this run started
    return {"target": target, "pid": pid}


# --------------------------------------------------------------------------------------------- the run


async def chaos(quick: bool, seed: int, root: Path) -> dict[str, Any]:
    from chaos_elastic import ElasticPhase

    from rollart_core.control.pipeline import Pipeline
    from rollart_core.control.train import train
    from rollart_core.metrics import MemorySink
    from rollart_core.watchdog import watchdog_pid

    cfg = chaos_config(root, quick=quick, seed=seed)
    phase = ElasticPhase(seed)
    before = own_processes()
    fired: list[dict[str, Any]] = []
    t_wall = time.perf_counter()
    with DescendantWatch() as watch:
        async with Pipeline(cfg) as p:
            t_built = time.perf_counter()
            n_env_actors = sum(a.alive for a in p.env_manager.actors)
            plan = schedule(seed, cfg.loop.steps, n_env_actors)
            t0 = time.perf_counter()
            run = asyncio.create_task(train(cfg, sink=MemorySink(), pipeline=p))
            pending = list(plan)
            engine: dict[str, Any] = {}  # the killed engine: when it was back, and on which version
            while not run.done():  # faults, the killed engine's return, the elastic change, the rates
                await phase.tick(p, t0, engine.get("worker"))
                started = any(w.inflight or w.served for w in p.proxy.workers.values())
                due = [
                    f
                    for f in pending
                    if p.trainer.version >= f["at_version"] and (started or f["kind"] != "engine")
                ]
                for f in due:
                    pending.remove(f)
                    try:
                        what = await inject(p, f)
                    except Exception as exc:  # e.g. the picked actor died already: say so, go on
                        what = {"target": f"{f['kind']}: not injected ({exc!r})", "pid": None}
                    fired.append({**f, **what, "t": time.perf_counter() - t0, "version": p.trainer.version})
                    if what.get("worker"):
                        engine = {"worker": what["worker"], "killed_at_s": fired[-1]["t"]}
                    print(
                        f"[chaos] t={fired[-1]['t']:.1f}s v{p.trainer.version}: SIGKILL {what['target']}",
                        flush=True,
                    )
                if engine and "back_at_version" not in engine:
                    w = p.proxy.workers[engine["worker"]]
                    if w.healthy and w.metrics.recovered >= 1:
                        engine.update(
                            back_at_version=p.trainer.version,
                            back_at_s=time.perf_counter() - t0,
                            versions_at_back=await p.proxy.weight_versions(),
                            served_at_back=w.served,
                        )
                        print(
                            f"[chaos] t={engine['back_at_s']:.1f}s v{p.trainer.version}: engine {w.name} "
                            f"back, versions {engine['versions_at_back']}",
                            flush=True,
                        )
                await asyncio.sleep(0.05)
            error = None
            try:
                summary = await run
            except Exception as exc:
                summary, error = {}, f"{type(exc).__name__}: {exc}"
            reward_stats = {name: ex.stats() for name, ex in p.rewards.items()}
            runtime_stats = {name: await runtime_counters(ex) for name, ex in p.rewards.items()}
            env_stats = p.env_manager.snapshot()
            proxy_metrics = await p.proxy.metrics(engine_stats=False)
            if "served_at_back" in engine:
                engine["served_after_back"] = (
                    p.proxy.workers[engine["worker"]].served - engine["served_at_back"]
                )
            session_tables = p.proxy.session_counts()
            elastic = phase.result(p)
            build_phases = {k: v for k, v in p.timings.items() if k.endswith("start_s") or k == "model_s"}
        t_closed = time.perf_counter()
        deadline = time.monotonic() + 15
        while watch.alive(before) and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
    leftover = watch.alive(before)
    leftover.pop(watchdog_pid() or -1, None)  # the driver's own watchdog lives as long as the driver
    return report(
        cfg,
        summary,
        error,
        fired,
        reward_stats,
        runtime_stats,
        env_stats,
        proxy_metrics,
        leftover,
        len(watch.seen),
        {"build_s": t_built - t_wall, "run_s": t_closed - t0, "total_s": time.perf_counter() - t_wall},
        engine,
        session_tables,
        build_phases,
        elastic,
    )


def report(
    cfg: Any,
    summary: dict[str, Any],
    error: str | None,
    fired: list[dict[str, Any]],
    reward_stats: dict[str, Any],
    runtime_stats: dict[str, Any],
    env_stats: dict[str, Any],
    proxy_metrics: dict[str, Any],
    leftover: dict[int, str],
    processes_seen: int,
    times: dict[str, float],
    engine: dict[str, Any],
    session_tables: dict[str, int],
    build_phases: dict[str, float],
    elastic: dict[str, Any],
) -> dict[str, Any]:
    hist = summary.get("history", [])
    alpha = cfg.loop.alpha
    trained = Counter(tid for h in hist for tid in h["batch_traj_ids"])
    lags = [h["version"] - 1 - v for h in hist for v in h["batch_start_versions"]]
    fates = summary.get("fates", {})
    steps_s = [h["step_s"] for h in hist]
    median = statistics.median(steps_s) if steps_s else 0.0
    for f in fired:  # the step that was running when the fault fired, and the next one
        ends = [h["elapsed"] for h in hist]
        hit = next((i for i, e in enumerate(ends) if e >= f["t"]), None)
        around = [] if hit is None else steps_s[hit : hit + 2]
        f["steps_after_s"] = around
        f["lost_s"] = max(0.0, sum(around) - median * len(around))
    faults_by_kind = Counter(f["kind"] for f in fired if f["pid"] is not None)
    runtime_faults = {
        name: {k: v for k, v in s.items() if k.startswith("fault_")} for name, s in runtime_stats.items()
    }
    return {
        "error": error,
        "steps": len(hist),
        "steps_asked": cfg.loop.steps,
        "launched": summary.get("launched"),
        "fates_total": sum(fates.values()),
        "fates": fates,
        "trained": sum(trained.values()),
        "trained_twice": sum(1 for n in trained.values() if n > 1),
        "lag_violations": sum(lag > alpha for lag in lags),
        "lag_max": max(lags, default=0),
        "alpha": alpha,
        "lost": (summary.get("launched") or 0) - sum(fates.values()),
        "median_step_s": median,
        "faults": fired,
        "faults_by_kind": dict(faults_by_kind),
        "trainer_restarts": sum(h.get("trainer_restarts", 0) for h in hist),
        "engine_recovered": {n: m.get("recovered") for n, m in proxy_metrics.items() if isinstance(m, dict)},
        "engine_killed": engine.get("worker"),
        "engine_back_at_version": engine.get("back_at_version"),
        "engine_back_after_s": engine["back_at_s"] - engine["killed_at_s"] if "back_at_s" in engine else None,
        "engine_versions_at_back": engine.get("versions_at_back"),
        "engine_served_after_back": engine.get("served_after_back"),
        "proxy_session_tables": session_tables,
        "env_manager": {
            k: v
            for k, v in env_stats.items()
            if k in ("actor_deaths", "actors_started", "replacements", "retired_actor_died", "actors_alive")
        },
        "reward_runtime_faults": runtime_faults,
        "reward": {
            name: {
                k: v
                for k, v in s.items()
                if k.startswith("http_")
                or k
                in (
                    "calls",
                    "failures",
                    "fallbacks",
                    "runtime_calls",
                    "runtime_cold_starts",
                    "runtime_restarts",
                )
            }
            for name, s in reward_stats.items()
        },
        "leftover_processes": leftover,
        "processes_seen": processes_seen,
        "final_version": summary.get("final_version"),
        "served_version": summary.get("served_version"),
        "build_phases": build_phases,
        "elastic": elastic,
        **times,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="40 steps, 1 trainer rank, 4 env actors (< 5 min)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("runs/bench/chaos.json"))
    ap.add_argument(
        "--driver-kill",
        action="store_true",
        help="then SIGKILL a rollart train of this config mid-run and resume it (chaos_driver.py)",
    )
    args = ap.parse_args(argv)
    for k, v in {**LOOPBACK_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}.items():
        os.environ.setdefault(k, v)  # engines start in seconds and live and die with their actor
    with tempfile.TemporaryDirectory(prefix="rollart-chaos-") as tmp:
        result = asyncio.run(chaos(args.quick, args.seed, Path(tmp)))
    result["seed"], result["quick"] = args.seed, args.quick
    from chaos_report import invariants, table

    result["violations"] = invariants(result)
    print(table(result))
    if args.driver_kill:  # the driver's own death: a process of its own, killed, then resumed
        from chaos_driver import driver_kill
        from chaos_driver import table as driver_table

        with tempfile.TemporaryDirectory(prefix="rollart-chaos-driver-") as tmp:
            result["driver_kill"] = driver_kill(args.seed, Path(tmp))
        print(driver_table(result["driver_kill"]))
        result["violations"] += result["driver_kill"]["violations"]
    for v in result["violations"]:
        print(f"VIOLATION: {v}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, default=str))
    print(f"wrote {args.out}")
    return 1 if result["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
