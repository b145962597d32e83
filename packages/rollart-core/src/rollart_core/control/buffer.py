"""SampleBuffer: the groups of a run, from their launch until they are taken, behind the staleness gate.

A group is announced when it is launched and is *ready* once every trajectory launched for it has a
fate. A trajectory started at policy version ``v`` may be handed to the trainer at version ``t`` only
if ``t - v <= alpha`` (:meth:`SampleBuffer.fresh`).

With a batch ``mix`` (groups per task), a batch holds exactly that many groups of each task, the
oldest ready ones: without it a fast task (short episodes) would fill the batches while a slow
task's groups wait and go stale, and the run would train mostly on the fast task.

This is plain data with its rules and no waiting: :class:`~rollart_core.control.state.RunState`
owns the run's buffer, changes it, counts the fates and wakes whoever waits on it.

Every group's life is recorded on the active :class:`~rollart_core.timeline.Timeline` (lane: its
task) when it leaves: ``group`` from its announcement (launch) until it is taken (trained or dropped),
``group_rollout`` until its last trajectory got a fate; ``rollart bench`` turns them into the
staleness window's bound (Little's law over the groups in flight).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rollart_core.errors import ConfigError
from rollart_core.timeline import record
from rollart_core.types import Fate, Trajectory

__all__ = ["Group", "SampleBuffer"]


@dataclass
class Group:
    """One announced group: its members as they get their fates."""

    task: str | None
    launched: int
    """Trajectories launched for it: it is ready once that many have a fate."""
    needed: int
    """Finished members it needs (``group_size``; fewer than ``launched`` with redundancy)."""
    arrived: list[Trajectory] = field(default_factory=list)
    finished: int = 0
    announced_at: float = field(default_factory=time.perf_counter)
    last_fate_at: float = 0.0

    def ready(self) -> bool:
        return len(self.arrived) >= self.launched


class SampleBuffer:
    def __init__(self, alpha: int = 0) -> None:
        if alpha < 0:
            raise ConfigError(f"alpha must be >= 0, got {alpha}")
        self.alpha = alpha
        self.groups: dict[str, Group] = {}
        """Announced groups not yet taken, in launch order."""
        self.consumed = 0
        self.dropped_groups: list[str] = []
        """Groups removed with nothing trainable (all failed or stale)."""

    def announce(self, group_id: str, n: int, task: str | None = None, needed: int | None = None) -> Group:
        if group_id in self.groups:
            raise ValueError(f"group {group_id!r} already announced")
        if n < 1:
            raise ValueError(f"group {group_id!r}: {n} trajectories launched")
        group = Group(task, n, n if needed is None else needed)
        group.last_fate_at = group.announced_at
        self.groups[group_id] = group
        return group

    def group_of(self, traj: Trajectory) -> Group:
        """The group ``traj`` joins now; refuses a trajectory without a fate, of a group never
        announced, or one the group already holds all of its launched members without."""
        if traj.fate is None:
            raise ValueError(f"trajectory {traj.traj_id} has no fate")
        group = self.groups.get(traj.group_id)
        if group is None:
            raise ValueError(f"trajectory {traj.traj_id}: group {traj.group_id!r} was never announced")
        if group.ready() or any(t.traj_id == traj.traj_id for t in group.arrived):
            raise ValueError(
                f"trajectory {traj.traj_id}: a fate beyond the {group.launched} launched for its group, "
                "or its second"
            )
        return group

    def add(self, traj: Trajectory) -> Group:
        group = self.group_of(traj)
        group.arrived.append(traj)
        group.last_fate_at = time.perf_counter()
        return group

    def fresh(self, traj: Trajectory, version: int) -> bool:
        return version - traj.min_version() <= self.alpha

    def trainable(self, group_id: str, version: int) -> bool:
        return any(t.fate is Fate.FINISHED and self.fresh(t, version) for t in self.groups[group_id].arrived)

    def ready(self) -> list[str]:
        return [g for g, group in self.groups.items() if group.ready()]

    def untrainable(self, version: int) -> list[str]:
        """Ready groups with nothing to train at ``version`` (all failed or stale)."""
        return [g for g in self.ready() if not self.trainable(g, version)]

    def choose(self, num_groups: int, version: int, mix: Mapping[str, int] | None = None) -> list[str] | None:
        """The ``num_groups`` oldest ready groups trainable at ``version`` (with ``mix``: that many of
        each task, in launch order), or None while there are not enough."""
        if mix is not None and sum(mix.values()) != num_groups:
            raise ValueError(f"batch mix {dict(mix)} does not sum to {num_groups} groups")
        useful = [g for g in self.ready() if self.trainable(g, version)]
        if mix is None:
            return useful[:num_groups] if len(useful) >= num_groups else None
        chosen: set[str] = set()
        for task, quota in mix.items():
            of_task = [g for g in useful if self.groups[g].task == task][:quota]
            if len(of_task) < quota:
                return None
            chosen.update(of_task)
        return [g for g in useful if g in chosen]

    def remove(self, group_id: str, version: int) -> tuple[list[Trajectory], list[Trajectory]]:
        """Remove a ready group; return its finished trajectories fresh at ``version`` and the
        finished ones too old for it (their fates are the caller's to change)."""
        group = self.groups.pop(group_id)
        done = [t for t in group.arrived if t.fate is Fate.FINISHED]
        fresh = [t for t in done if self.fresh(t, version)]
        stale = [t for t in done if not self.fresh(t, version)]
        lane = group.task or ""
        record("group", group.announced_at, time.perf_counter(), lane)
        record("group_rollout", group.announced_at, group.last_fate_at, lane)
        return fresh, stale

    def pending_by_task(self) -> Counter[str | None]:
        """Announced groups not yet consumed, per task (admission control balances the mix with it)."""
        return Counter(group.task for group in self.groups.values())

    def pending_groups(self) -> int:
        return len(self.groups)

    def state_dict(self) -> dict[str, Any]:
        """Persistable content: every finished trajectory not yet consumed, by group. Members still
        in flight cannot be saved; a group is restored with the members it had."""
        groups = []
        for g, group in self.groups.items():
            done = [t for t in group.arrived if t.fate is Fate.FINISHED]
            if done:
                groups.append(
                    {"group_id": g, "task": group.task, "trajectories": [t.to_dict() for t in done]}
                )
        return {"alpha": self.alpha, "groups": groups, "consumed": self.consumed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s groups (their fates were counted by the run that saved them)."""
        for g in state["groups"]:
            trajs = [Trajectory.from_dict(d) for d in g["trajectories"]]
            group = self.announce(g["group_id"], len(trajs), g.get("task", trajs[0].task if trajs else None))
            group.arrived.extend(trajs)
            group.finished = len(trajs)
        self.consumed = state.get("consumed", 0)
