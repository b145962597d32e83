"""Sync+ (``loop.mode: sync``): launch a step's groups, wait for all of them, train, push, update.

Rollout itself is trajectory-level parallel (every trajectory runs on its own and the engines batch
continuously); only the step boundary is a barrier. With ``alpha = 0`` this is on-policy training.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator

from rollart_core.control.steps import Run, StepRecord, get_batch, landed, push, sync_weights, train_step

__all__ = ["run_sync"]


async def run_sync(run: Run) -> AsyncGenerator[StepRecord, None]:
    for rec in run.steps():
        run.rollout.launch_step()
        batch = await get_batch(run, rec, relaunch=True)  # 1. Get Batch: the whole step's groups
        await train_step(run, rec, batch)  # 6. Train (nothing else runs meanwhile)
        await landed(run, rec, push(run, update=False))  # push the new weights, wait until committed
        await sync_weights(run, rec, run.clock.trained)  # 2-5. the engines move to them
        yield rec
