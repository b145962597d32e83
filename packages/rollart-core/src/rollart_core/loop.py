"""The training loop, top to bottom. Three modes share every piece; only the ordering differs.

``async`` (RollArt), per step:

1. **Get Batch** — wait until the SampleBuffer holds the step's groups within the staleness bound
   (rollout never stops: a producer keeps launching groups under admission control, each only if
   it can still be trained within ``alpha``: :func:`on_time`).
2. **Suspend** → 3. **Update** → 4. **Resume** → 5. **Recompute KV** — every engine pauses with its
   in-flight requests kept, swaps in the newest weights, re-prefills the running requests under them
   and resumes (``proxy.update_weights``; nothing is aborted).
6. **Train** — one policy update on the batch while rollout continues; then push the new weights
   to the store asynchronously (once they land, the engines pull and stage them while generating:
   ``proxy.prefetch_weights``), and abort in-flight trajectories that can no longer meet ``alpha``.

With ``train.update_on_arrival`` (the default) steps 2-5 of the next step do not wait for its Get
Batch: they run in the background as soon as the pushed weights are staged, so rollout moves to the
newest policy while the loop waits for the batch; the next step only makes sure they are done.

``sync`` (Sync+): launch a step's groups, wait for all of them, train, push, update.
``one_off``: like sync, but the next step's groups are launched before training on this one.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import Counter
from collections.abc import Mapping
from typing import Any

from rollart_core.checkpoint import resume, save_checkpoint
from rollart_core.config import RunConfig, TaskConfig
from rollart_core.metrics import MetricsSink, default_sinks
from rollart_core.pipeline import Pipeline
from rollart_core.protocols import SupportsWeightPrefetch
from rollart_core.rollout import Rollout, derive_seed
from rollart_core.runner import run_trajectory
from rollart_core.timeline import record
from rollart_core.types import Trajectory, fate_counts

__all__ = ["evaluate", "next_task", "on_time", "rollout_step", "train"]

log = logging.getLogger(__name__)
CONSOLE_KEYS = ["reward_mean", "success_rate", "eval_success", "traj_per_s", "gen_tok_per_s", "wait_s",
                "train_s", "sync_s", "lag_max", "loss", "version", "fates"]


async def train(cfg: RunConfig, sink: MetricsSink | None = None, pipeline: Pipeline | None = None) -> dict[str, Any]:
    """Run ``cfg.train.steps`` steps in ``cfg.train.mode``; returns a summary. ``pipeline``: run on
    an already built one (its engines serving the trainer's version) instead of building one."""
    sink = sink or default_sinks(cfg.output_dir, CONSOLE_KEYS)
    mode, alpha = cfg.train.mode, cfg.train.alpha
    mix = {t.name: t.groups_per_step for t in cfg.tasks}  # every batch holds this many groups of each task
    num_groups = sum(mix.values())
    history: list[dict[str, Any]] = []
    async with contextlib.nullcontext(pipeline) if pipeline is not None else Pipeline(cfg) as p:
        ro = Rollout(p)
        ro.served_version = p.trainer.version
        producer = None
        first = await resume(p, ro, cfg.train.resume_from) if cfg.train.resume_from else 1
        held_out = functools.partial(evaluate, p, cfg.train.eval_episodes, temperature=cfg.train.eval_temperature)
        if cfg.train.eval_every and first == 1:
            sink.log(first - 1, {**await held_out(), "version": p.trainer.version})
        t_start = time.perf_counter()
        if mode == "async":
            producer = asyncio.create_task(_produce(ro, num_groups * (cfg.train.max_pending_steps or alpha + 1), alpha))
        elif mode == "one_off":
            ro.launch_step()
        background_sync = mode == "async" and cfg.train.async_weight_sync
        on_arrival = background_sync and cfg.train.update_on_arrival
        pushed: asyncio.Task[dict[str, float]] | None = None
        try:
            for step in range(first, cfg.train.steps + 1):
                t_step = time.perf_counter()
                if mode == "sync":
                    ro.launch_step()
                # 1. Get Batch (behind the staleness gate)
                batch = await p.buffer.get_batch(num_groups, version=p.trainer.version, mix=mix)
                wait_s = time.perf_counter() - t_step
                if mode == "one_off":
                    ro.launch_step()  # the next step's rollout overlaps this step's training
                # 2-5. Suspend, Update, Resume, Recompute KV (sync/one_off already updated after training)
                t_sync = time.perf_counter()
                pauses = {}
                if pushed is not None:
                    landed = await pushed  # pushed and staged while rollout went on (on arrival: swapped in too)
                    pauses = landed if on_arrival else await _update(p, ro, p.trainer.version)
                    pushed = None
                sync_s = time.perf_counter() - t_sync
                if not batch:
                    log.warning("step %d: no trainable trajectory in the batch (fates %s)", step, dict(ro.fates))
                    continue
                if on_arrival:  # training this batch makes the next version, served as soon as it lands:
                    ro.coming_version = p.trainer.version + 1  # groups may be admitted on it now
                    await p.buffer.notify()
                # 6. Train (rollout goes on meanwhile), push the new weights asynchronously
                await asyncio.sleep(0)  # the producer refills the groups just taken before the step starts
                inflight_at_train = len(ro.inflight)
                t_train = time.perf_counter()
                m = await asyncio.to_thread(p.trainer.train_step, batch)
                record("train", t_train, time.perf_counter())
                pushed = asyncio.create_task(_push_and_prefetch(p, ro, p.trainer.version, dict(p.trainer.named_weights()),
                                                                update=on_arrival))
                aborted = ro.abort_stale(p.trainer.version, alpha) if mode != "sync" and cfg.train.abort_stale else 0
                if not background_sync:  # Sync+ / One-off update right after training
                    t_sync = time.perf_counter()
                    await pushed
                    pauses = await _update(p, ro, p.trainer.version)
                    pushed = None
                    sync_s += time.perf_counter() - t_sync
                metrics = _step_metrics(ro, batch, m, step_s=time.perf_counter() - t_step, wait_s=wait_s, sync_s=sync_s,
                                        pauses=pauses, aborted=aborted, elapsed=time.perf_counter() - t_start,
                                        inflight_at_train=inflight_at_train)
                if cfg.train.eval_every and step % cfg.train.eval_every == 0:
                    metrics.update(await held_out())
                if cfg.train.save_every and step % cfg.train.save_every == 0:
                    await save_checkpoint(p, ro, step, cfg.output_dir / f"checkpoint-{step}")
                sink.log(step, metrics)
                history.append(metrics)
            if pushed is not None:  # the last push lands before returning (a borrowed pipeline goes on)
                await pushed
        finally:  # also when cancelled or failed mid-step: stop what runs beside the loop
            beside = [t for t in (pushed, producer) if t is not None]
            for t in beside:
                t.cancel()
            await asyncio.gather(*beside, return_exceptions=True)
            await ro.cancel_all()
        summary = {"mode": mode, "alpha": alpha, "steps": len(history), "final_version": p.trainer.version,
                   "served_version": ro.served_version,
                   "launched": ro.launched, "fates": dict(ro.fates), "wall_s": time.perf_counter() - t_start,
                   "dropped_groups": sorted(p.buffer.dropped_groups),
                   "history": history, **p.timings}
    sink.close()
    return summary


async def _push_and_prefetch(p: Pipeline, ro: Rollout, version: int, weights: dict[str, Any], *,
                             update: bool) -> dict[str, float]:
    """Push the trainer's weights (in the store's thread); once they land, the engines pull and stage
    them while generating, so the update pauses generation only for the swap. ``update``: also run
    that update now (returns its pauses)."""
    t0 = time.perf_counter()
    await asyncio.wrap_future(p.store.push(version, weights))
    if isinstance(p.proxy, SupportsWeightPrefetch):
        await p.proxy.prefetch_weights(version)
    record("weight_sync", t0, time.perf_counter())
    return await _update(p, ro, version) if update else {}


async def _update(p: Pipeline, ro: Rollout, version: int) -> dict[str, float]:
    """Steps 2-5 (Suspend, Update, Resume, Recompute KV) on every engine; new launches start on ``version``."""
    t0 = time.perf_counter()
    pauses = await p.proxy.update_weights(version)
    ro.served_version = version
    await p.buffer.notify()  # admission control: groups launched from now on start on this version
    record("weight_sync", t0, time.perf_counter())
    return pauses


async def _produce(ro: Rollout, max_pending_groups: int, alpha: int) -> None:
    """Async mode's producer: keep launching groups under admission control. A group is admitted
    only if it can still be trained within ``alpha`` of the version it starts on (:func:`on_time`,
    per task): the version served, or else the coming one (:attr:`Rollout.coming_version`: the
    group then waits for it before its first generation). At most ``max_pending_groups`` are
    pending; among the tasks that admit one, the
    task with the fewest pending groups for its share of the batch goes first (a slow task's groups
    stay in flight longer, so it gets launched as often as it is consumed, not crowded out by a fast one)."""
    buf, tasks = ro.p.buffer, ro.p.config.tasks

    def choose() -> tuple[int, int] | None:
        if buf.pending_groups() >= max_pending_groups:
            return None
        pending = buf.pending_by_task()
        next_version = max(ro.served_version, (buf.last_batch_version if buf.last_batch_version is not None else -1) + 1)
        versions = [ro.served_version]  # on the weights served, else ahead on the coming ones
        if ro.coming_version is not None and ro.coming_version > ro.served_version:
            versions.append(ro.coming_version)
        start: dict[int, int] = {}
        for i, t in enumerate(tasks):
            v = next((v for v in versions if on_time(pending.get(t.name, 0), t.groups_per_step, next_version, v, alpha)), None)
            if v is not None:
                start[i] = v
        if not start:
            return None
        i = next_task(tasks, pending, among=list(start))
        return i, start[i]

    while True:
        task_index, version = await buf.wait_for(choose)
        ro.launch_group(task_index, start_version=version)


def on_time(pending: int, groups_per_step: int, next_version: int, served_version: int, alpha: int) -> bool:
    """Staleness-aware admission (AReaL's rule, per task): a group launched now starts on
    ``served_version`` and, queued behind the task's ``pending`` groups, is trained at the earliest
    in batch ceil((pending + 1) / groups_per_step) from the next one, i.e. at version
    ``next_version`` + that - 1. Admit it only if that is within ``alpha``: launching it earlier
    would only produce work that goes stale (the engines still serve an old version, or the task
    already has enough groups queued)."""
    return next_version + -(-(pending + 1) // groups_per_step) - 1 - served_version <= alpha


def next_task(tasks: list[TaskConfig], pending: Mapping[str | None, int], among: list[int] | None = None) -> int:
    """Index of the task (of ``among``, default all) with the fewest pending groups per group of its
    batch share (ties: the first)."""
    return min(among if among is not None else range(len(tasks)),
               key=lambda i: (pending.get(tasks[i].name, 0) / tasks[i].groups_per_step, i))


def _step_metrics(ro: Rollout, batch: list[Trajectory], m: dict[str, float], **extra: Any) -> dict[str, Any]:
    done = ro.drain_finished()
    pauses = extra.pop("pauses")
    step_s = extra["step_s"]
    lags = [m["version"] - 1 - t.min_version() for t in batch]
    finished = [t for t in done if t.fate is not None and t.fate.value == "finished"]
    episodes: dict[str, list[float]] = {}
    for t in finished:
        episodes.setdefault(t.task, []).append(t.timings.get("episode", 0.0))
    return {
        **m,
        **extra,
        "version": int(m["version"]),
        "success_rate": sum(bool(t.info.get("success")) for t in batch) / len(batch),
        "traj_per_s": len(finished) / step_s,
        "gen_tok_per_s": sum(t.num_generated() for t in done) / step_s,
        "trained_gen_tokens": sum(t.num_generated() for t in batch),
        "wasted_gen_tokens": sum(t.num_generated() for t in done) - sum(t.num_generated() for t in finished),
        "episode_s_by_task": {k: sum(v) / len(v) for k, v in episodes.items()},
        "finished_by_task": {k: len(v) for k, v in episodes.items()},
        "update_pause_s": max(pauses.values(), default=0.0),
        "lag_max": max(lags, default=0),
        "lag_mean": sum(lags) / max(len(lags), 1),
        "batch_size": len(batch),
        "batch_groups": sorted({t.group_id for t in batch}),
        "batch_tasks": dict(Counter(t.task for t in batch)),
        "fates": dict(fate_counts(done)),
    }


async def rollout_step(p: Pipeline, step: int, *, launch_tag: str = "s") -> list[Trajectory]:
    """Launch one step's groups of every task and wait for all of them (used by tests and tools)."""
    ro = Rollout(p)
    ro.served_version = p.trainer.version
    for ti, task in enumerate(p.config.tasks):
        for _ in range(task.groups_per_step):
            ro.launch_group(ti, tag=f"{launch_tag}{step}-g")
    await ro.wait_all()
    return ro.drain_finished()


async def evaluate(p: Pipeline, episodes: int, *, tag: str = "eval", temperature: float | None = None) -> dict[str, float]:
    """Success rate and mean reward on held-out seeds (never used for training); ``temperature``
    replaces the tasks' sampling temperature (0: greedy)."""
    jobs = []
    for ti, task in enumerate(p.config.tasks):
        sampling = task.sampling if temperature is None else task.sampling.model_copy(update={"temperature": temperature})
        for e in range(episodes):
            traj = Trajectory(f"{tag}-{task.name}-{e}", task.name, task.env.impl, f"{tag}-{e}",
                              derive_seed("heldout", ti, e), p.trainer.version)
            jobs.append(run_trajectory(traj, env=p.make_env(task, ti), generator=p.proxy, chat=p.chat,
                                       scorer=p.rewards[task.name], sampling=sampling, max_turns=task.max_turns,
                                       context=task.context, env_timeout_s=task.env_timeout_s))
    done = await asyncio.gather(*jobs)
    ok = [t for t in done if t.fate is not None and t.fate.value == "finished"]
    return {
        "eval_success": sum(bool(t.info.get("success")) for t in ok) / max(len(done), 1),
        "eval_reward": sum(t.reward for t in ok) / max(len(ok), 1),
    }
