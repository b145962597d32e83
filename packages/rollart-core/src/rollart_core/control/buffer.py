"""SampleBuffer: finished trajectories wait here, by group, behind the staleness gate.

A group is ready once every trajectory launched for it is accounted for (any fate). A trajectory
started at policy version ``v`` may be handed to the trainer at version ``t`` only if
``t - v <= alpha``; older ones are dropped with fate ``aborted_stale`` and counted.

With a batch ``mix`` (groups per task), a batch holds exactly that many groups of each task, the
oldest ready ones: without it a fast task (short episodes) would fill the batches while a slow
task's groups wait and go stale, and the run would train mostly on the fast task.

Every group's life is recorded on the active :class:`~rollart_core.timeline.Timeline` (lane: its
task) when it leaves: ``group`` from its announcement (launch) until it is taken (trained or dropped),
``group_rollout`` until its last trajectory got a fate; ``rollart bench`` turns them into the
staleness window's bound (Little's law over the groups in flight).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from rollart_core.errors import ConfigError
from rollart_core.timeline import record
from rollart_core.types import Fate, Trajectory

__all__ = ["SampleBuffer"]

T = TypeVar("T")


class SampleBuffer:
    def __init__(self, alpha: int = 0) -> None:
        if alpha < 0:
            raise ConfigError(f"alpha must be >= 0, got {alpha}")
        self.alpha = alpha
        self._expected: dict[str, int] = {}
        self._groups: dict[str, list[Trajectory]] = {}
        self._task: dict[str, str | None] = {}
        self._order: list[str] = []
        self._life: dict[str, list[float]] = {}
        """Per pending group: [announced at, last trajectory's fate at] (``time.perf_counter``)."""
        self._changed = asyncio.Condition()
        self.fates: Counter[str] = Counter()
        self.consumed = 0
        self.stale_tokens = 0
        """Generated tokens of finished trajectories dropped here as stale."""
        self.dropped_groups: list[str] = []
        """Groups removed with nothing trainable (all failed or stale)."""
        self.on_relabel: Callable[[Fate, Fate], None] | None = None
        """Told when a finished trajectory is relabelled ``aborted_stale`` (the run's fate ledger)."""

    def expect(self, group_id: str, n: int, task: str | None = None) -> None:
        """Announce that ``n`` trajectories were launched for ``group_id`` (of ``task``)."""
        if group_id in self._expected:
            raise ValueError(f"group {group_id!r} already announced")
        self._expected[group_id] = n
        self._groups[group_id] = []
        self._task[group_id] = task
        self._order.append(group_id)
        now = time.perf_counter()
        self._life[group_id] = [now, now]

    async def put(self, traj: Trajectory) -> None:
        if traj.fate is None:
            raise ValueError(f"trajectory {traj.traj_id} has no fate")
        if traj.group_id not in self._expected:
            raise ValueError(f"trajectory {traj.traj_id}: group {traj.group_id!r} was never announced")
        self.fates[traj.fate.value] += 1
        async with self._changed:
            self._groups[traj.group_id].append(traj)
            self._life[traj.group_id][1] = time.perf_counter()
            self._changed.notify_all()

    def _ready(self) -> list[str]:
        return [g for g in self._order if len(self._groups[g]) >= self._expected[g]]

    def fresh(self, traj: Trajectory, version: int) -> bool:
        return version - traj.min_version() <= self.alpha

    def _trainable(self, group: str, version: int) -> bool:
        return any(t.fate is Fate.FINISHED and self.fresh(t, version) for t in self._groups[group])

    async def get_batch(
        self,
        num_groups: int,
        version: int,
        mix: Mapping[str, int] | None = None,
        on_drop: Callable[[str, str | None], Any] | None = None,
        on_taken: Callable[[], Any] | None = None,
    ) -> list[Trajectory]:
        """Wait for ``num_groups`` ready groups that hold a fresh finished trajectory (with ``mix``:
        that many of each task, summing to ``num_groups``); return those trajectories, oldest groups
        first. Ready groups with nothing trainable (all failed or stale) are dropped, counted, and
        reported to ``on_drop(group_id, task)`` (which may launch a replacement). ``on_taken()`` runs
        once the batch is taken, before any waiter wakes (the version clock moves there)."""
        if mix is not None and sum(mix.values()) != num_groups:
            raise ValueError(f"batch mix {dict(mix)} does not sum to {num_groups} groups")
        async with self._changed:
            while True:
                await self._changed.wait_for(lambda: len(self._ready()) >= 1)
                dropped = [g for g in self._ready() if not self._trainable(g, version)]
                for g in dropped:
                    task = self._task[g]
                    self._take(g, version)
                    self.dropped_groups.append(g)
                    if on_drop is not None:
                        on_drop(g, task)
                if dropped:
                    self._changed.notify_all()  # admission control may launch replacements now
                chosen = self._choose(
                    [g for g in self._ready() if self._trainable(g, version)], num_groups, mix
                )
                if chosen is not None:
                    break
                await self._changed.wait()
            batch = [t for g in chosen for t in self._take(g, version)]
            self.consumed += len(batch)
            if on_taken is not None:
                on_taken()
            self._changed.notify_all()
            return batch

    def _choose(self, useful: list[str], num_groups: int, mix: Mapping[str, int] | None) -> list[str] | None:
        if mix is None:
            return useful[:num_groups] if len(useful) >= num_groups else None
        chosen = []
        for task, quota in mix.items():
            of_task = [g for g in useful if self._task[g] == task][:quota]
            if len(of_task) < quota:
                return None
            chosen += of_task
        return sorted(chosen, key=self._order.index)

    def pending_by_task(self) -> Counter[str | None]:
        """Announced groups not yet consumed, per task (admission control balances the mix with it)."""
        return Counter(self._task[g] for g in self._order)

    def _take(self, group: str, version: int) -> list[Trajectory]:
        """Remove a ready group; return its fresh finished trajectories, marking stale ones."""
        out = []
        for t in self._groups.pop(group):
            if t.fate is not Fate.FINISHED:
                continue
            if not self.fresh(t, version):
                t.fate = Fate.ABORTED_STALE
                self.stale_tokens += t.num_generated()
                self.fates[Fate.FINISHED.value] -= 1
                self.fates[Fate.ABORTED_STALE.value] += 1
                if self.on_relabel is not None:
                    self.on_relabel(Fate.FINISHED, Fate.ABORTED_STALE)
                continue
            out.append(t)
        self._order.remove(group)
        del self._expected[group]
        task = self._task.pop(group)
        launched, complete = self._life.pop(group)
        record("group", launched, time.perf_counter(), task or "")
        record("group_rollout", launched, complete, task or "")
        return out

    async def wait_for(self, choose: Callable[[], T | None]) -> T:
        """Wait until ``choose()`` returns something other than None (re-evaluated whenever the
        buffer changes or :meth:`notify` is called) and return it."""
        async with self._changed:
            while (out := choose()) is None:
                await self._changed.wait()
            return out

    async def notify(self) -> None:
        """Wake the waiters: something they depend on outside the buffer changed (the served version)."""
        async with self._changed:
            self._changed.notify_all()

    def state_dict(self) -> dict[str, Any]:
        """Persistable content: every finished trajectory not yet consumed, by group. Members still
        in flight cannot be saved; a group is restored with the members it had."""
        groups = []
        for g in self._order:
            done = [t for t in self._groups[g] if t.fate is Fate.FINISHED]
            if done:
                groups.append(
                    {"group_id": g, "task": self._task[g], "trajectories": [t.to_dict() for t in done]}
                )
        return {"alpha": self.alpha, "groups": groups, "fates": dict(self.fates), "consumed": self.consumed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for g in state["groups"]:
            trajs = [Trajectory.from_dict(d) for d in g["trajectories"]]
            self.expect(g["group_id"], len(trajs), g.get("task", trajs[0].task if trajs else None))
            self._groups[g["group_id"]].extend(trajs)
        self.fates.update(state.get("fates", {}))
        self.consumed = state.get("consumed", 0)

    def pending_groups(self) -> int:
        return len(self._order)
