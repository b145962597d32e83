"""Standalone capacity of each stage of the bench's pipeline, measured before the rounds: generation
alone on a saturating load, the trainer alone (all cores, and the half share the overlapping modes
give it), env calls alone, reward calls alone per executor kind. Each becomes trajectories/s of this
workload, and their minimum the compute bound. A stage of which nothing finished inside its probe
gets one probe four times as long, then is reported unmeasured with the reason
(``{"traj_per_s": None, "unmeasured": ...}``): a probe never stops the bench.

The env and reward probes also give the CPU seconds per call that the driver's thread spends on
them (``driver_cpu_s_per_call``): the bench's environments and in-process rewards run in the driver,
and the CPU-charged bound charges them off the driver's time with it.

:func:`idle_lifetimes` measures each task's *natural* group lifetime on an otherwise idle pipeline:
one group per task launched alone (a few times), from launch until its last member's fate, with the
mode's faults, redundancy and reward: the staleness window's bound from it does not depend on how
fast the trainer takes groups."""

from __future__ import annotations

import asyncio
import functools
import itertools
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any

from rollart_core.bench.workload import BenchSize, train_threads
from rollart_core.config import RunConfig
from rollart_core.errors import EnvError

__all__ = ["idle_lifetimes", "measure_capacity", "unmeasured"]

RETRY_FACTOR = 4
"""A probe of which nothing finished runs once more this many times as long."""


def unmeasured(reason: str) -> dict[str, Any]:
    """A stage whose capacity could not be measured, and why."""
    return {"traj_per_s": None, "unmeasured": reason}


async def measure_capacity(
    p: Any,
    free: RunConfig,
    faulty: RunConfig,
    size: BenchSize,
    inflight: int,
    rewards: Mapping[str, Any],
    use: Callable[[RunConfig, int], None],
) -> dict[str, Any]:
    """Standalone capacity of each stage, in its own unit and in trajectories/s of this workload.
    ``rewards``: the executor of each reward kind the modes use (probed as they will run: the same
    objects); ``use(cfg, threads)`` points the pipeline at a config."""
    from rollart_core.control.rollout import Rollout

    free = free.model_copy(deep=True)
    for t in free.tasks:
        t.redundancy = 0
    use(free, train_threads("all"))
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
        reason = f"none of {ro.launched} trajectories finished in {gen_s:.1f} s (check the engine logs)"
        partial = await _without_generation(p, faulty, inflight, size, reason)
        await _probe_rewards(partial, rewards, inflight, size.capacity_s)
        return partial
    gen_tokens = sum(t.num_generated() for t in done)
    ctx_tokens = sum(len(tu.context_ids) for t in done for tu in t.turns)
    turns = {task.name: [len(t.turns) for t in done if t.task == task.name] for task in free.tasks}
    cap: dict[str, Any] = {
        "generate": {
            "traj_per_s": len(done) / gen_s,
            "turns_per_s": sum(len(t.turns) for t in done) / gen_s,
            "gen_tok_per_s": gen_tokens / gen_s,
            "prompt_tok_per_s": ctx_tokens / gen_s,
            "trajectories": len(done),
            "seconds": gen_s,
        }
    }
    # trainer alone: one batch-sized step (after a warm-up step) on whole groups from the probe,
    # on all cores (Sync+) and on the half the overlapping modes give it
    groups: dict[str, list[Any]] = {}
    for traj in done:
        groups.setdefault(traj.group_id, []).append(traj)
    batch = [t for g in list(groups.values())[:num_groups] for t in g]
    await asyncio.to_thread(p.trainer.train_step, batch)
    train_s = await _timed(asyncio.to_thread(p.trainer.train_step, batch))
    p.trainer.set_num_threads(train_threads("half"))
    half_s = await _timed(asyncio.to_thread(p.trainer.train_step, batch))
    p.trainer.set_num_threads(train_threads("all"))
    tokens = sum(len(t.token_ids()) for t in batch)
    cap["train"] = {
        "traj_per_s": len(batch) / train_s,
        "tok_per_s": tokens / train_s,
        "batch": len(batch),
        "seconds": train_s,
        "half_cores_s": half_s,
    }
    cap["contention"] = await _contention(p, done, batch, concurrency=len(batch), train_alone_s=half_s)
    await asyncio.wrap_future(p.store.push(p.trainer.version, dict(p.trainer.named_weights())))
    await p.proxy.update_weights(p.trainer.version)
    # env calls alone (with the bench's latency and crashes), ``inflight`` episodes at once
    mean_turns = {k: max(1, round(sum(v) / len(v))) if v else 1 for k, v in turns.items()}
    cap["env"] = await _longer(lambda s: _env_capacity(p, faulty, mean_turns, inflight, s), size.capacity_s)
    await _probe_rewards(cap, rewards, inflight, size.capacity_s)
    cap["mean_turns"] = mean_turns
    cap["turns"] = turns
    cap["inflight"] = inflight
    return cap


async def _without_generation(
    p: Any, faulty: RunConfig, inflight: int, size: BenchSize, reason: str
) -> dict[str, Any]:
    """The probes that need no trajectory, when generation finished none: generation and the
    trainer (which trains on the probe's trajectories) unmeasured, the env probe at one turn."""
    turns = {t.name: 1 for t in faulty.tasks}
    return {
        "generate": unmeasured(reason),
        "train": unmeasured(f"no trajectory to train on ({reason})"),
        "env": await _longer(lambda s: _env_capacity(p, faulty, turns, inflight, s), size.capacity_s),
        "mean_turns": turns,
        "turns": {},
        "inflight": inflight,
    }


async def _probe_rewards(
    cap: dict[str, Any], rewards: Mapping[str, Any], inflight: int, seconds: float
) -> None:
    """Reward calls alone, per executor kind, ``inflight`` callers at once; first one call that starts
    a function runtime the executor runs (a call cancelled half-way would stop it again), then a
    window of the same load to scale its workers out: start-up is not the steady capacity."""
    for kind, ex in rewards.items():
        try:
            await ex.score(_probe_trajectory(f"start-{kind}"))
        except Exception as exc:  # the reason is reported; the rounds still run
            cap[f"reward_{kind}"] = unmeasured(f"the first call failed: {exc!r}")
            continue
        await _reward_capacity(ex, inflight, seconds)
        cap[f"reward_{kind}"] = await _longer(functools.partial(_reward_capacity, ex, inflight), seconds)


async def _longer(probe: Callable[[float], Awaitable[dict[str, Any]]], seconds: float) -> dict[str, Any]:
    """``probe(seconds)``; where nothing finished inside it, once more ``RETRY_FACTOR`` times as
    long; then the stage is unmeasured, with the reason."""
    out = await probe(seconds)
    if out["traj_per_s"]:
        return out
    longer = await probe(seconds * RETRY_FACTOR)
    if longer["traj_per_s"]:
        return {**longer, "retried_after_s": seconds}
    return {
        **longer,
        **unmeasured(
            f"nothing finished within {seconds:g} s, nor within {seconds * RETRY_FACTOR:g} s "
            f"({longer.get('concurrency', '?')} callers at once)"
        ),
    }


async def _contention(
    p: Any, done: list[Any], batch: list[Any], concurrency: int, train_alone_s: float
) -> dict[str, float]:
    """How much generation and training slow each other down when they overlap on this machine's
    cores (the trainer on its half share, as in the modes that overlap them): the probe's turns
    replayed by ``concurrency`` callers, alone and beside one training step."""
    from rollart_core.types import GenerateRequest, SamplingParams

    turns: list[tuple[list[int], int]] = []
    for t in done:
        prefix: list[int] = []
        for u in t.turns:
            prefix = prefix + list(u.context_ids)
            turns.append((prefix, max(1, len(u.output_ids))))
            prefix = prefix + list(u.output_ids)
    latencies: list[tuple[float, float]] = []  # (end, seconds)
    stop = asyncio.Event()

    async def caller(w: int) -> None:
        for k in itertools.count(w, concurrency):
            if stop.is_set():
                return
            prompt, max_tokens = turns[k % len(turns)]
            t0 = time.perf_counter()
            await p.proxy.generate(
                GenerateRequest(f"contention-{w}-{k}", prompt, SamplingParams(max_tokens=max_tokens))
            )
            latencies.append((time.perf_counter(), time.perf_counter() - t0))

    def mean(t0: float, t1: float) -> float:
        xs = [x for end, x in latencies if t0 <= end <= t1]
        return sum(xs) / len(xs) if xs else float("nan")

    p.trainer.set_num_threads(train_threads("half"))
    callers = asyncio.gather(*(caller(w) for w in range(concurrency)))
    try:
        while len(latencies) < concurrency:  # every caller's first turn: warm
            await asyncio.sleep(0.05)
        a0 = time.perf_counter()
        while time.perf_counter() - a0 < max(1.0, train_alone_s) or len(latencies) < 3 * concurrency:
            await asyncio.sleep(0.05)
        a1 = time.perf_counter()
        beside_s = await _timed(asyncio.to_thread(p.trainer.train_step, batch))
        a2 = time.perf_counter()
    finally:
        stop.set()
        await callers
        p.trainer.set_num_threads(train_threads("all"))
    alone, beside = mean(a0, a1), mean(a1, a2)
    return {
        "gen_latency_alone_s": alone,
        "gen_latency_beside_train_s": beside,
        "train_alone_s": train_alone_s,
        "train_beside_gen_s": beside_s,
        "concurrency": concurrency,
        "gen_slowdown": max(0.0, beside / alone - 1) if alone > 0 else 0.0,
        "train_slowdown": max(0.0, beside_s / train_alone_s - 1),
    }


async def _timed(work: Awaitable[Any]) -> float:
    t0 = time.perf_counter()
    await work
    return time.perf_counter() - t0


async def _for(duration: float, workers: int, work: Callable[[int], Coroutine[Any, Any, None]]) -> float:
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

    cpu0 = time.thread_time()  # the driver's loop thread, where every env coroutine runs
    s = await _for(duration, workers, worker)
    cpu = time.thread_time() - cpu0
    mean_calls = sum(per_episode.values()) / len(per_episode)
    return {
        "traj_per_s": calls[0] / s / mean_calls,
        "driver_cpu_s_per_call": cpu / calls[0] if calls[0] else None,
        "calls_per_s": calls[0] / s,
        "calls_per_traj": mean_calls,
        "crashes": crashes[0],
        "concurrency": workers,
        "seconds": s,
    }


def _probe_trajectory(name: str) -> Any:
    from rollart_core.types import Trajectory

    return Trajectory(name, "t", "e", "g", 0, 0)


async def _reward_capacity(ex: Any, workers: int, duration: float) -> dict[str, Any]:
    """Reward calls/s with ``workers`` callers for ``duration`` seconds; only calls that completed
    inside the window count. Calls still running at the end are given another ``duration`` to finish
    before they are cancelled: a cancelled call drops its connection to a function runtime, while a
    fixed pool's queue would take long to drain."""
    n = [0]
    t0 = time.perf_counter()
    deadline = t0 + duration

    async def worker(w: int) -> None:
        for k in itertools.count(1):
            if time.perf_counter() >= deadline:
                return
            await ex.score(_probe_trajectory(f"cap-{w}-{k}-{t0}"))
            n[0] += time.perf_counter() <= deadline

    cpu0 = time.thread_time()  # the driver's loop thread: an in-process reward, or the HTTP client
    tasks = [asyncio.create_task(worker(w)) for w in range(workers)]
    await asyncio.wait(tasks, timeout=2 * duration)
    for t in tasks:
        t.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    cpu = time.thread_time() - cpu0
    errors = [r for r in results if isinstance(r, Exception)]
    if errors and not n[0]:
        return unmeasured(f"no call finished within {duration:.1f} s: {errors[0]!r}") | {
            "concurrency": workers
        }
    return {
        "traj_per_s": n[0] / duration,
        "driver_cpu_s_per_call": cpu / n[0] if n[0] else None,
        "errors": len(errors),
        "calls_per_s": n[0] / duration,
        "calls": n[0],
        "concurrency": workers,
        "seconds": duration,
    }


async def idle_lifetimes(
    p: Any, cfg: RunConfig, repeats: int, use: Callable[[RunConfig, int], None]
) -> dict[str, Any]:
    """Each task's natural group lifetime on an otherwise idle pipeline, under ``cfg`` (a mode's
    config: its faults, redundancy, env replicas and reward executor): ``repeats`` times, one group
    of every task launched alone (the tasks side by side), from launch until its last member's fate
    (a redundant member's is its cancellation, once the group has its ``group_size``). Per task: the
    mean lifetime (``lifetime_s``), every sample, and the trajectories each group could train
    (``trained_per_group``: finished members, at most ``group_size``). Nothing waits for a trainer."""
    from rollart_core.control.rollout import Rollout

    use(cfg, train_threads("half"))
    samples: dict[str, list[float]] = {t.name: [] for t in cfg.tasks}
    yields: dict[str, list[int]] = {t.name: [] for t in cfg.tasks}
    t0 = time.perf_counter()
    for _ in range(repeats):
        ro = Rollout(p)
        groups = {ro.launch_group(ti, tag="idle"): t for ti, t in enumerate(cfg.tasks)}
        await ro.wait_all()
        members: dict[str, list[Any]] = {}
        for traj in ro.drain_finished():
            members.setdefault(traj.group_id, []).append(traj)
        for gid, task in groups.items():
            trajs = members.get(gid, [])
            if not trajs:
                continue
            samples[task.name].append(max(t.timings.get("episode", 0.0) for t in trajs))
            done = sum(1 for t in trajs if t.fate is not None and t.fate.value == "finished")
            yields[task.name].append(min(task.group_size, done))
    return {
        "lifetime_s": {k: sum(v) / len(v) for k, v in samples.items() if v},
        "trained_per_group": {k: sum(v) / len(v) for k, v in yields.items() if v},
        "samples": samples,
        "groups": repeats,
        "seconds": time.perf_counter() - t0,
    }
