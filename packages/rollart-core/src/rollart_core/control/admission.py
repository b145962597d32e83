"""Async admission: which group to launch next, and whether it can still be trained in time.

A group is admitted only if it can be trained within ``alpha`` of the version it starts on
(:func:`on_time`, AReaL's rule, per task), on the version served or else on the coming one (its
first generation then waits for it). Among the tasks that admit one, the task with the fewest
pending groups for its share of the batch goes first (:func:`next_task`): a slow task's groups stay
in flight longer, so it is launched as often as it is consumed, not crowded out by a fast one.
"""

from __future__ import annotations

from collections.abc import Mapping

from rollart_core.config import TaskConfig
from rollart_core.control.rollout import Rollout

__all__ = ["next_task", "on_time", "produce"]


def on_time(pending: int, groups_per_step: int, next_version: int, served_version: int, alpha: int) -> bool:
    """A group launched now starts on ``served_version`` and, queued behind the task's ``pending``
    groups, is trained at the earliest in batch ceil((pending + 1) / groups_per_step) from the next
    one, i.e. at version ``next_version`` + that - 1. Admit it only if that is within ``alpha``:
    launching it earlier would only produce work that goes stale."""
    return next_version + -(-(pending + 1) // groups_per_step) - 1 - served_version <= alpha


def next_task(
    tasks: list[TaskConfig], pending: Mapping[str | None, int], among: list[int] | None = None
) -> int:
    """Index of the task (of ``among``, default all) with the fewest pending groups per group of its
    batch share (ties: the first)."""
    return min(
        among if among is not None else range(len(tasks)),
        key=lambda i: (pending.get(tasks[i].name, 0) / tasks[i].groups_per_step, i),
    )


def choose(rollout: Rollout, max_pending_groups: int, alpha: int) -> tuple[int, int] | None:
    """The next group to launch as (task index, start version), or None while none may be."""
    state, tasks = rollout.state, rollout.p.config.tasks
    if state.buffer.pending_groups() >= max_pending_groups:
        return None
    pending = state.buffer.pending_by_task()
    next_version = state.clock.next_batch_version()
    start: dict[int, int] = {}
    for i, t in enumerate(tasks):
        v = next(
            (
                v
                for v in state.clock.start_versions()
                if on_time(pending.get(t.name, 0), t.groups_per_step, next_version, v, alpha)
            ),
            None,
        )
        if v is not None:
            start[i] = v
    if not start:
        return None
    i = next_task(tasks, pending, among=list(start))
    return i, start[i]


async def produce(rollout: Rollout, max_pending_groups: int, alpha: int) -> None:
    """Keep launching groups under admission control (re-evaluated on every change of the run's
    state), at most ``max_pending_groups`` launched but not yet trained on; ends with the run's
    failure."""
    while True:
        task_index, version = await rollout.state.wait_for(lambda: choose(rollout, max_pending_groups, alpha))
        rollout.launch_group(task_index, start_version=version)
