"""The training loop, top to bottom.

One step (mode ``sync``, the strengthened synchronous baseline "Sync+"):

1. **Rollout** — launch every group's trajectories at once; each runs env ↔ proxy ↔ reward on
   its own (no batch barrier inside rollout, continuous batching in the engines).
2. **Get Batch** — wait until the SampleBuffer holds the step's groups within the staleness bound.
3. **Train** — one policy update on the batch (the trainer bumps the policy version).
4. **Push** — the trainer's weights go into the weight store as the new version.
5. **Update** — every engine pulls that version and loads it (pause-keep → load → re-prefill
   running requests → resume); the next trajectories carry the new version.

The ``one_off`` and ``async`` modes (Suspend / Update / Resume / Recompute KV while training
overlaps rollout) reuse these same pieces.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from typing import Any

from rollart_core.config import RunConfig
from rollart_core.metrics import ConsoleSink, JsonlSink, MetricsSink, MultiSink
from rollart_core.pipeline import Pipeline
from rollart_core.runner import run_trajectory
from rollart_core.types import Trajectory, fate_counts

__all__ = ["evaluate", "rollout_step", "train"]

log = logging.getLogger(__name__)
CONSOLE_KEYS = ["reward_mean", "success_rate", "eval_success", "traj_per_s", "gen_tok_per_s", "rollout_s",
                "train_s", "sync_s", "loss", "version", "fates"]


def _seed(*parts: object) -> int:
    return random.Random(":".join(map(str, parts))).randrange(2**31)


async def rollout_step(p: Pipeline, step: int, *, launch_tag: str = "s") -> list[Trajectory]:
    """Launch all groups of every task for ``step``; return when every trajectory has a fate."""
    cfg = p.config
    version = p.trainer.version
    jobs = []
    for ti, task in enumerate(cfg.tasks):
        for gi in range(task.groups_per_step):
            group_id = f"{launch_tag}{step}-{task.name}-g{gi}"
            seed = _seed(cfg.seed, launch_tag, step, ti, gi)
            p.buffer.expect(group_id, task.group_size)
            for k in range(task.group_size):
                traj = Trajectory(f"{group_id}-{k}", task.name, f"{task.env.impl}", group_id, seed, version)
                jobs.append(run_trajectory(traj, env=p.make_env(task, ti), generator=p.proxy, chat=p.chat,
                                           scorer=p.rewards[task.name], sampling=task.sampling,
                                           max_turns=task.max_turns, on_done=p.buffer.put))
    return list(await asyncio.gather(*jobs))


async def evaluate(p: Pipeline, episodes: int, *, tag: str = "eval") -> dict[str, float]:
    """Success rate and mean reward on held-out seeds (never used for training)."""
    cfg = p.config
    jobs = []
    for ti, task in enumerate(cfg.tasks):
        for e in range(episodes):
            traj = Trajectory(f"{tag}-{task.name}-{e}", task.name, task.env.impl, f"{tag}-{e}",
                              _seed("heldout", ti, e), p.trainer.version)
            jobs.append(run_trajectory(traj, env=p.make_env(task, ti), generator=p.proxy, chat=p.chat,
                                       scorer=p.rewards[task.name], sampling=task.sampling, max_turns=task.max_turns))
    done = await asyncio.gather(*jobs)
    ok = [t for t in done if t.fate is not None and t.fate.value == "finished"]
    return {
        "eval_success": sum(bool(t.info.get("success")) for t in ok) / max(len(done), 1),
        "eval_reward": sum(t.reward for t in ok) / max(len(ok), 1),
    }


async def train(cfg: RunConfig, sink: MetricsSink | None = None) -> dict[str, Any]:
    """Run ``cfg.train.steps`` steps; returns a summary (per-step metrics are sent to ``sink``)."""
    out_dir = cfg.output_dir
    sink = sink or MultiSink(JsonlSink(out_dir / "metrics.jsonl"), ConsoleSink(CONSOLE_KEYS))
    history: list[dict[str, Any]] = []
    fates: Counter[str] = Counter()
    async with Pipeline(cfg) as p:
        if cfg.train.eval_every:
            sink.log(0, {**await evaluate(p, cfg.train.eval_episodes), "version": p.trainer.version})
        for step in range(1, cfg.train.steps + 1):
            t_step = time.perf_counter()
            # 1. Rollout
            trajs = await rollout_step(p, step)
            rollout_s = time.perf_counter() - t_step
            fates.update(fate_counts(trajs))
            # 2. Get Batch (behind the staleness gate)
            num_groups = sum(t.groups_per_step for t in cfg.tasks)
            batch = await p.buffer.get_batch(num_groups, version=p.trainer.version)
            if not batch:
                log.warning("step %d: no finished trajectory to train on (fates %s)", step, fate_counts(trajs))
                continue
            # 3. Train
            m = await asyncio.to_thread(p.trainer.train_step, batch)
            # 4. Push, 5. Update
            t_sync = time.perf_counter()
            await asyncio.wrap_future(p.store.push(p.trainer.version, dict(p.trainer.named_weights())))
            pauses = await p.proxy.update_weights(p.trainer.version)
            sync_s = time.perf_counter() - t_sync
            gen_tokens = sum(t.num_generated() for t in trajs)
            metrics = {
                **m,
                "version": p.trainer.version,
                "success_rate": sum(bool(t.info.get("success")) for t in trajs) / len(trajs),
                "traj_per_s": len(trajs) / rollout_s,
                "gen_tok_per_s": gen_tokens / rollout_s,
                "rollout_s": rollout_s,
                "sync_s": sync_s,
                "update_pause_s": max(pauses.values()),
                "step_s": time.perf_counter() - t_step,
                "fates": dict(fate_counts(trajs)),
            }
            if cfg.train.eval_every and step % cfg.train.eval_every == 0:
                metrics.update(await evaluate(p, cfg.train.eval_episodes))
            if cfg.train.save_every and step % cfg.train.save_every == 0:
                await asyncio.to_thread(p.trainer.save, str(out_dir / f"checkpoint-{step}"))
            sink.log(step, metrics)
            history.append(metrics)
        summary = {"steps": len(history), "final_version": p.trainer.version, "fates": dict(fates),
                   "history": history, **p.timings}
    sink.close()
    return summary
