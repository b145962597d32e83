"""One-off (``loop.mode: one_off``): one-step off-policy, batch-level overlap.

Like Sync+, but the next step's groups are launched as soon as this step's batch is taken, so their
rollout overlaps this step's training; they start on weights one version old (needs ``alpha >= 1``).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator

from rollart_core.control.steps import (
    Run,
    StepRecord,
    abort_stale,
    get_batch,
    landed,
    push,
    sync_weights,
    train_step,
)

__all__ = ["run_one_off"]


async def run_one_off(run: Run) -> AsyncGenerator[StepRecord, None]:
    run.rollout.launch_step()
    for rec in run.steps():
        batch = await get_batch(run, rec, relaunch=True)  # 1. Get Batch
        run.rollout.launch_step()  # the next step's rollout overlaps this step's training
        await train_step(run, rec, batch)  # 6. Train
        pushed = push(run, update=False)
        if run.cfg.loop.abort_stale:
            abort_stale(run, rec)
        await landed(run, rec, pushed)
        await sync_weights(run, rec, run.clock.trained)  # 2-5. Suspend, Update, Resume, Recompute KV
        yield rec
