"""Redundant rollouts: for a group of G trajectories launch G + k; once G have *finished*, cancel
the rest.

Cancelling a trajectory cancels its asyncio task: the core runner then aborts the in-flight
generation request through the generator (the LLMProxy) and closes the environment, and the
trajectory gets fate ``cancelled_redundant``. The surplus is cancelled synchronously in the
completion callback of the G-th finished trajectory, so no further trajectory can slip in as
finished after it: exactly G come back as ``kept`` whenever G finish. Trajectories that fail
(``env_failed``, ``timed_out``, ...) do not count towards G: the extra k also mask failures.

``redundancy = 0`` disables it: the group is just its G trajectories.

The same idea one level up (:func:`run_batch`): a training batch needs B complete groups; launch
B + m groups and cancel the slowest m once B are complete, so one group whose environments all
straggle does not hold the batch either.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from rollart_core.types import Fate, Trajectory, fate_counts

__all__ = ["BatchOutcome", "GroupOutcome", "RedundancyConfig", "run_batch", "run_group"]

log = logging.getLogger(__name__)


class RedundancyConfig(BaseModel):
    """Per task."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    redundancy: int = Field(0, ge=0)
    """Extra trajectories launched per group (k); 0 disables redundant rollouts."""
    redundant_groups: int = Field(0, ge=0)
    """Extra groups launched per batch (m, :func:`run_batch`); 0 disables."""


@dataclass
class GroupOutcome:
    kept: list[Trajectory]
    """The first ``group_size`` finished trajectories, in finishing order (fewer if not enough finished)."""
    trajectories: list[Trajectory]
    """All launched trajectories (G + k), each with its fate."""
    cancelled: list[Trajectory] = field(default_factory=list)
    """Those cancelled as surplus (fate ``cancelled_redundant``)."""
    group_size: int = 0

    @property
    def complete(self) -> bool:
        """True if ``group_size`` trajectories finished."""
        return len(self.kept) == self.group_size

    def fates(self) -> dict[str, int]:
        return fate_counts(self.trajectories)


async def run_group(
    trajectories: Sequence[Trajectory],
    run: Callable[[Trajectory], Awaitable[Any]],
    group_size: int,
) -> GroupOutcome:
    """Run all ``trajectories`` (G + k of them) with ``run`` until ``group_size`` have finished.

    ``run(traj)`` drives one trajectory to its end and sets its fate (e.g. ``functools.partial(
    manager.run_trajectory, generator=..., chat=..., ...)``); it must let CancelledError through.
    Returns once every task has ended, cancelled ones included, so their generation requests are
    aborted and their environments closed before this returns.
    """
    if group_size < 1 or len(trajectories) < group_size:
        raise ValueError(
            f"need group_size >= 1 and at least group_size trajectories, got {group_size} "
            f"and {len(trajectories)}"
        )
    kept: list[Trajectory] = []
    tasks: list[asyncio.Task[Any]] = []
    surplus: list[int] = []

    def on_done(i: int, task: asyncio.Task[Any]) -> None:
        traj = trajectories[i]
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            log.warning("trajectory %s: run raised %r", traj.traj_id, exc)
            traj.fate, traj.error = traj.fate or Fate.ENV_FAILED, traj.error or repr(exc)
        if traj.fate is Fate.FINISHED and len(kept) < group_size:
            kept.append(traj)
            if len(kept) == group_size:
                for j, other in enumerate(tasks):
                    if not other.done():
                        surplus.append(j)
                        other.cancel()

    for i, traj in enumerate(trajectories):
        task = asyncio.ensure_future(run(traj))
        task.add_done_callback(functools.partial(on_done, i))
        tasks.append(task)
    try:
        await asyncio.gather(*tasks, return_exceptions=True)
    except asyncio.CancelledError:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for traj in trajectories:
            traj.fate = traj.fate or Fate.CANCELLED_REDUNDANT
        raise
    cancelled = []
    for j in surplus:
        traj = trajectories[j]
        if traj.fate is None or traj.fate is Fate.CANCELLED_REDUNDANT:
            # cancelled before its first step ran: the runner never saw it
            traj.fate = Fate.CANCELLED_REDUNDANT
            cancelled.append(traj)
    for traj in trajectories:
        if traj.fate is None:  # run() returned without setting a fate: a bug in run, still counted
            traj.fate, traj.error = Fate.ENV_FAILED, traj.error or "run() ended without a fate"
    return GroupOutcome(kept, list(trajectories), cancelled, group_size=group_size)


@dataclass
class BatchOutcome:
    complete: list[GroupOutcome]
    """The first ``needed`` groups to complete, in completion order (fewer if not enough did)."""
    trajectories: list[Trajectory]
    """Every launched trajectory of every group, each with its fate."""
    cancelled_groups: int = 0
    """Groups cancelled as surplus once ``needed`` were complete. Every trajectory outside the kept
    groups' ``kept`` ends ``cancelled_redundant`` or failed: ``finished`` counts exactly the batch."""

    def fates(self) -> dict[str, int]:
        return fate_counts(self.trajectories)


async def run_batch(
    groups: Sequence[Sequence[Trajectory]],
    run: Callable[[Trajectory], Awaitable[Any]],
    group_size: int,
    needed: int,
) -> BatchOutcome:
    """Run every group (each with :func:`run_group`) until ``needed`` groups are complete, then
    cancel the others: their unfinished trajectories get fate ``cancelled_redundant`` (generation
    aborted, environment closed by the runner). Returns once every task has ended."""
    if needed < 1 or len(groups) < needed:
        raise ValueError(f"need needed >= 1 and at least that many groups, got {needed} and {len(groups)}")
    done: list[GroupOutcome] = []
    tasks: list[asyncio.Task[GroupOutcome]] = []
    cancelled = 0

    def on_done(task: asyncio.Task[GroupOutcome]) -> None:
        nonlocal cancelled
        if task.cancelled() or task.exception() is not None:
            return
        out = task.result()
        if out.complete and len(done) < needed:
            done.append(out)
            if len(done) == needed:
                for other in tasks:
                    if not other.done():
                        cancelled += 1
                        other.cancel()

    for g in groups:
        task = asyncio.ensure_future(run_group(g, run, group_size))
        task.add_done_callback(on_done)
        tasks.append(task)
    try:
        results = await asyncio.gather(*tasks, return_exceptions=True)
    except asyncio.CancelledError:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    for r in results:
        if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError):
            log.warning("a group of the batch raised %r", r)
    kept = {id(t) for g in done for t in g.kept}
    trajs = [t for g in groups for t in g]
    for traj in trajs:
        if traj.fate is None or (traj.fate is Fate.FINISHED and id(traj) not in kept):
            traj.fate = Fate.CANCELLED_REDUNDANT  # surplus: finished in a group the batch did not take
    return BatchOutcome(done, trajs, cancelled)
