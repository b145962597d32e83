"""SampleBuffer: finished trajectories wait here, by group, behind the staleness gate.

A group is ready once every trajectory launched for it is accounted for (any fate). A trajectory
started at policy version ``v`` may be handed to the trainer at version ``t`` only if
``t - v <= alpha``; older ones are dropped with fate ``aborted_stale`` and counted.
"""

from __future__ import annotations

import asyncio
from collections import Counter

from rollart_core.errors import ConfigError
from rollart_core.types import Fate, Trajectory

__all__ = ["SampleBuffer"]


class SampleBuffer:
    def __init__(self, alpha: int = 0) -> None:
        if alpha < 0:
            raise ConfigError(f"alpha must be >= 0, got {alpha}")
        self.alpha = alpha
        self._expected: dict[str, int] = {}
        self._groups: dict[str, list[Trajectory]] = {}
        self._order: list[str] = []
        self._changed = asyncio.Condition()
        self.fates: Counter[str] = Counter()
        self.consumed = 0

    def expect(self, group_id: str, n: int) -> None:
        """Announce that ``n`` trajectories were launched for ``group_id``."""
        if group_id in self._expected:
            raise ValueError(f"group {group_id!r} already announced")
        self._expected[group_id] = n
        self._groups[group_id] = []
        self._order.append(group_id)

    async def put(self, traj: Trajectory) -> None:
        if traj.fate is None:
            raise ValueError(f"trajectory {traj.traj_id} has no fate")
        if traj.group_id not in self._expected:
            raise ValueError(f"trajectory {traj.traj_id}: group {traj.group_id!r} was never announced")
        self.fates[traj.fate.value] += 1
        async with self._changed:
            self._groups[traj.group_id].append(traj)
            self._changed.notify_all()

    def _ready(self) -> list[str]:
        return [g for g in self._order if len(self._groups[g]) >= self._expected[g]]

    def fresh(self, traj: Trajectory, version: int) -> bool:
        return version - traj.min_version() <= self.alpha

    async def get_batch(self, num_groups: int, version: int) -> list[Trajectory]:
        """Wait for ``num_groups`` ready groups; return their fresh finished trajectories."""
        async with self._changed:
            await self._changed.wait_for(lambda: len(self._ready()) >= num_groups)
            batch: list[Trajectory] = []
            for g in self._ready()[:num_groups]:
                for t in self._groups.pop(g):
                    if t.fate is not Fate.FINISHED:
                        continue
                    if not self.fresh(t, version):
                        t.fate = Fate.ABORTED_STALE
                        self.fates[Fate.FINISHED.value] -= 1
                        self.fates[Fate.ABORTED_STALE.value] += 1
                        continue
                    batch.append(t)
                self._order.remove(g)
                del self._expected[g]
            self.consumed += len(batch)
            return batch

    def pending_groups(self) -> int:
        return len(self._order)
