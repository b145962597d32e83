"""Async (``loop.mode: async``, RollArt): rollout never stops; training runs beside it.

A producer keeps launching groups under staleness-aware admission (:mod:`.admission`). Each step:

1. **Get Batch** — wait for the step's groups within the staleness bound;
2-5. **Suspend → Update → Resume → Recompute KV** — the engines move to the weights of the last
   step (pushed and staged while rollout went on). With ``loop.update_on_arrival`` (default) this
   already ran as soon as they were staged, while this step's batch was awaited;
6. **Train** on the batch while rollout continues, then **push** the new weights in the background
   and abort in-flight trajectories that can no longer meet ``alpha``.

``loop.async_weight_sync: false`` (an ablation) waits for the push and updates right after training.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator

from rollart_core.control.admission import produce
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

__all__ = ["run_async"]


async def run_async(run: Run) -> AsyncGenerator[StepRecord, None]:
    loop = run.cfg.loop
    on_arrival = loop.async_weight_sync and loop.update_on_arrival
    depth = loop.max_pending_steps or loop.alpha + 1  # steps' worth of groups launched ahead of training
    run.beside(produce(run.rollout, run.num_groups * depth, loop.alpha), "the async producer")
    pushed = None
    for rec in run.steps():
        batch = await get_batch(run, rec)  # 1. Get Batch
        await landed(run, rec, pushed)  # the last push landed (on arrival: and was swapped in)
        if pushed is not None and not on_arrival:
            await sync_weights(run, rec, run.clock.trained)  # 2-5. Suspend, Update, Resume, Recompute KV
        if on_arrival:  # the version this batch trains is served as soon as it lands: admit groups on it
            run.state.will_serve(run.clock.trained + 1)
        await train_step(run, rec, batch)  # 6. Train, rollout goes on
        pushed = push(run, update=on_arrival)  # in the background
        if loop.abort_stale:
            abort_stale(run, rec)
        if not loop.async_weight_sync:  # the synchronous ablation: update right after training
            await landed(run, rec, pushed)
            await sync_weights(run, rec, run.clock.trained)
            pushed = None
        yield rec
    await landed(run, StepRecord(0), pushed)  # the last push lands before returning
