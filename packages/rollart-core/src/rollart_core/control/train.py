"""``train(cfg)``: build (or borrow) a pipeline, pick the mode's recipe, run it step by step.

The recipes (:mod:`.sync`, :mod:`.one_off`, :mod:`.asynchronous`) say what a step does; this
driver does what every mode does around them: resume, held-out evaluation, checkpoints, metrics,
the summary, and stopping everything that runs beside the loop however the run ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import Counter
from collections.abc import AsyncGenerator, Callable
from typing import Any

from rollart_core.config import RunConfig
from rollart_core.control.asynchronous import run_async
from rollart_core.control.checkpoint import resume, save_checkpoint, set_aside_earlier_run
from rollart_core.control.one_off import run_one_off
from rollart_core.control.pipeline import Pipeline
from rollart_core.control.rollout import derive_seed
from rollart_core.control.runner import run_trajectory
from rollart_core.control.steps import Run, StepRecord, step_metrics
from rollart_core.control.sync import run_sync
from rollart_core.errors import RollartError
from rollart_core.metrics import MetricsSink, default_sinks, since_process_start
from rollart_core.protocols import SupportsRestarts
from rollart_core.trajectories import TrajectoryLog
from rollart_core.types import Fate, Trajectory

__all__ = ["RECIPES", "evaluate", "train"]
log = logging.getLogger(__name__)

RECIPES: dict[str, Callable[[Run], AsyncGenerator[StepRecord, None]]] = {
    "sync": run_sync,
    "one_off": run_one_off,
    "async": run_async,
}
CONSOLE_KEYS = [
    "reward_mean",
    "success_rate",
    "eval_success",
    "traj_per_s",
    "gen_tok_per_s",
    "wait_s",
    "train_s",
    "sync_s",
    "lag_max",
    "loss",
    "version",
    "fates",
]


async def train(
    cfg: RunConfig,
    sink: MetricsSink | None = None,
    pipeline: Pipeline | None = None,
    *,
    summary: dict[str, Any] | None = None,
    set_aside_earlier: bool = True,
) -> dict[str, Any]:
    """Run ``cfg.loop.steps`` steps in ``cfg.loop.mode``; returns a summary. ``pipeline``: run on
    an already built one (its engines serving the trainer's version) instead of building one.
    ``summary``: a dict filled with the summary (and returned) however the run ends: a run stopped
    (Ctrl-C, SIGTERM) or failed after its loop began still records the steps it made and the fate of
    every trajectory it launched, with ``completed`` False. ``set_aside_earlier``: move an earlier
    run out of ``cfg.output_dir`` first (the CLI does it itself, before its log opens there)."""
    loop = cfg.loop
    summary = {} if summary is None else summary
    history: list[dict[str, Any]] = []
    if (
        set_aside_earlier
        and pipeline is None
        and (moved := set_aside_earlier_run(cfg.output_dir, loop.resume_from))
    ):
        log.info("the earlier run in %s was moved to %s", cfg.output_dir, moved)
    async with contextlib.nullcontext(pipeline) if pipeline is not None else Pipeline(cfg) as p:
        run = Run(p, cfg)
        if loop.resume_from:
            run.first_step = await resume(p, run, loop.resume_from)
        sink = sink or default_sinks(
            cfg.output_dir,
            CONSOLE_KEYS,
            run.first_step if loop.resume_from else None,
            total_steps=loop.steps,
            config=cfg,
        )
        saved = (
            TrajectoryLog(cfg.output_dir, p.chat.decode, run.first_step) if loop.export_trajectories else None
        )
        held_out = functools.partial(evaluate, p, loop.eval_episodes, temperature=loop.eval_temperature)
        if loop.eval_every and run.first_step == 1:
            t_eval = time.perf_counter()
            sink.log(0, {**await held_out(), "version": p.trainer.version})
            p.timings["eval0_s"] = time.perf_counter() - t_eval
        recipe = RECIPES[loop.mode](run)
        completed = False
        try:
            async for rec in recipe:
                metrics = step_metrics(run, rec)
                if saved is not None:
                    await saved.write(rec.step, rec.ended, rec.batch)
                if loop.eval_every and rec.step % loop.eval_every == 0:
                    metrics.update(await held_out())
                if loop.save_every and rec.step % loop.save_every == 0:
                    await save_checkpoint(p, run, rec.step, cfg.output_dir / f"checkpoint-{rec.step}")
                sink.log(rec.step, metrics)
                if "first_step_s" not in p.timings and (age := since_process_start()) is not None:
                    p.timings["first_step_s"] = age  # from the command's start: what a user waits for
                history.append(metrics)
            completed = True
        finally:  # also when cancelled or failed mid-step: stop what runs beside the loop
            try:
                await recipe.aclose()
                await run.stop()
            finally:  # however it ended: the steps made and every launched trajectory's fate
                summary.update(_summary(p, run, history, completed))
    sink.close()
    return summary


def _summary(p: Pipeline, run: Run, history: list[dict[str, Any]], completed: bool) -> dict[str, Any]:
    return {
        "mode": run.cfg.loop.mode,
        "alpha": run.cfg.loop.alpha,
        "completed": completed,
        "steps": len(history),
        "final_version": p.trainer.version,
        "served_version": run.clock.served,
        "launched": run.state.launched,
        "fates": dict(run.state.fates),
        "stale_tokens": run.state.stale_tokens,
        "wall_s": time.perf_counter() - run.t_start,
        "dropped_groups": sorted(run.state.buffer.dropped_groups),
        "relaunched_groups": run.relaunches,
        "trainer_restarts": p.trainer.restarts if isinstance(p.trainer, SupportsRestarts) else 0,
        "history": history,
        **p.timings,
    }


async def evaluate(
    p: Pipeline, episodes: int, *, tag: str = "eval", temperature: float | None = None
) -> dict[str, Any]:
    """Success rate and mean reward on held-out seeds (never used for training), also per task when
    there are several; held-out episodes use each task's ``eval_env`` when it has one; ``temperature``
    replaces the tasks' sampling temperature (0: greedy)."""
    jobs = []
    for ti, task in enumerate(p.config.tasks):
        sampling = (
            task.sampling
            if temperature is None
            else task.sampling.model_copy(update={"temperature": temperature})
        )
        for e in range(episodes):
            traj = Trajectory(
                f"{tag}-{task.name}-{e}",
                task.name,
                task.env.impl,
                f"{tag}-{e}",
                derive_seed("heldout", ti, e),
                p.trainer.version,
            )
            jobs.append(
                run_trajectory(
                    traj,
                    env=p.make_env(task, ti, held_out=True),
                    generator=p.proxy,
                    chat=p.chat,
                    scorer=p.rewards[task.name],
                    sampling=sampling,
                    max_turns=task.max_turns,
                    context=task.context,
                    env_timeout_s=task.env_timeout_s,
                )
            )
    done = await asyncio.gather(*jobs)
    if done and not any(t.fate is Fate.FINISHED for t in done):
        # an evaluation the infrastructure failed says nothing about the policy: never report it as 0
        fates = Counter(t.fate.value if t.fate else "none" for t in done)
        first = next((t.error for t in done if t.error), "no error recorded")
        raise RollartError(
            f"held-out evaluation ({tag}): none of its {len(done)} episodes finished "
            f"(fates {dict(fates)}); first error: {first}"
        )
    result: dict[str, Any] = _success_and_reward(done, "eval")
    if result["eval_failed"]:
        log.warning(
            "held-out evaluation (%s): %d of %d episodes failed", tag, result["eval_failed"], len(done)
        )
    if len(p.config.tasks) > 1:  # per task too: a mix can hide one task that does not learn
        by_task = {
            task.name: _success_and_reward([t for t in done if t.task == task.name], "eval")
            for task in p.config.tasks
        }
        result["eval_success_by_task"] = {k: v["eval_success"] for k, v in by_task.items()}
        result["eval_reward_by_task"] = {k: v["eval_reward"] for k, v in by_task.items()}
    return result


def _success_and_reward(done: list[Trajectory], prefix: str) -> dict[str, float]:
    """Success and mean reward over the finished episodes (a model-caused failure is a finished
    episode with the task's failure reward); ``<prefix>_failed`` counts the episodes the
    infrastructure ended (engine, environment host, reward service), which say nothing of the policy."""
    ok = [t for t in done if t.fate is Fate.FINISHED]
    return {
        f"{prefix}_success": sum(bool(t.info.get("success")) for t in ok) / max(len(ok), 1),
        f"{prefix}_reward": sum(t.reward for t in ok) / max(len(ok), 1),
        f"{prefix}_failed": len(done) - len(ok),
    }
