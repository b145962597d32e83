"""Rollout: launch groups of trajectories, track them in flight, abort the ones that went stale.

Each trajectory is its own asyncio task (R2): it drives env ↔ proxy ↔ reward through
:func:`run_trajectory` and lands in the SampleBuffer with a fate, whatever happens. The training
loop decides *when* to launch (all at once for a step, or continuously under admission control)
and tells this object the trainer's version so that in-flight work that can no longer meet the
staleness bound is aborted early (fate ``aborted_stale``) instead of being finished and dropped.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import time
from collections import Counter
from typing import TYPE_CHECKING

from rollart_core.control.clock import VersionClock
from rollart_core.control.ledger import FateLedger
from rollart_core.control.runner import FATAL, run_trajectory
from rollart_core.errors import ConfigError, EnvError, EnvTimeoutError, RollartError
from rollart_core.types import Fate, Trajectory

if TYPE_CHECKING:
    from rollart_core.control.pipeline import Pipeline

__all__ = ["Rollout", "derive_seed"]

log = logging.getLogger(__name__)


def derive_seed(*parts: object) -> int:
    return random.Random(":".join(map(str, parts))).randrange(2**31)


class Rollout:
    def __init__(self, p: Pipeline, clock: VersionClock | None = None) -> None:
        self.p = p
        self.clock = clock or VersionClock(p.trainer.version)
        """The run's versions: trajectories start on ``clock.served`` (or ahead on ``clock.coming``)."""
        self.ledger = FateLedger()
        """Every trajectory's fate, counted once (the buffer reports stale relabels to it)."""
        p.buffer.on_relabel = self.ledger.relabel
        self.inflight: dict[str, tuple[Trajectory, asyncio.Task[None]]] = {}
        self.launched = 0
        self.finished: list[Trajectory] = []
        """Trajectories that got a fate since the last :meth:`drain_finished`."""
        self.groups_launched = 0
        self._group_finished: dict[str, int] = {}
        self.cancelled_redundant = 0
        self.fatal: RollartError | None = None
        """A user's mistake a trajectory hit (a ConfigError building or running its environment):
        every trajectory would hit it, so the loop stops on it (naming the stage) at its next wait."""
        self._task_index = {t.name: i for i, t in enumerate(p.config.tasks)}

    @property
    def fates(self) -> Counter[str]:
        """Fates of every trajectory that ended (the ledger's counts)."""
        return self.ledger.counts

    def launch_group(self, task_index: int, tag: str = "g", start_version: int | None = None) -> str:
        """Start ``group_size`` trajectories of one task on a fresh seed; returns the group id.
        ``start_version`` newer than the served one: the trajectories reset their environments now
        and generate their first turn only once the engines serve that version."""
        cfg = self.p.config
        task = cfg.tasks[task_index]
        n = self.groups_launched
        self.groups_launched += 1
        group_id = f"{tag}{n}-{task.name}"
        seed = derive_seed(cfg.seed, tag, n, task_index)
        n_launch = task.group_size + task.redundancy
        self.p.buffer.expect(group_id, n_launch, task.name)
        self._group_finished[group_id] = 0
        for k in range(n_launch):
            traj = Trajectory(
                f"{group_id}-{k}",
                task.name,
                task.env.impl,
                group_id,
                seed,
                max(self.clock.served, start_version or 0),
            )
            self.inflight[traj.traj_id] = (traj, asyncio.create_task(self._run(traj, task_index)))
            self.launched += 1
        return group_id

    def relaunch(self, task: str | None) -> str:
        """A fresh group of ``task`` in place of one that ended with nothing trainable."""
        if task not in self._task_index:
            raise ValueError(f"no task {task!r} in this run")
        return self.launch_group(self._task_index[task], tag="r")

    def launch_step(self) -> list[str]:
        """One training step's worth of groups for every task."""
        return [
            self.launch_group(ti)
            for ti, t in enumerate(self.p.config.tasks)
            for _ in range(t.groups_per_step)
        ]

    async def _run(self, traj: Trajectory, task_index: int) -> None:
        p = self.p
        task = p.config.tasks[task_index]
        t0 = time.perf_counter()
        try:
            try:
                env = await p.acquire_env(task, task_index)
            except EnvTimeoutError as exc:
                traj.fate, traj.error = Fate.TIMED_OUT, f"no environment: {exc}"
            except EnvError as exc:
                traj.fate, traj.error = Fate.ENV_FAILED, f"no environment: {exc}"
            except FATAL as exc:
                traj.fate, traj.error = Fate.ENV_FAILED, f"no environment: {exc}"
                self._stop(task.name, "building the environment", exc)
            else:
                ahead = traj.start_version > self.clock.served
                await run_trajectory(
                    traj,
                    env=env,
                    generator=p.proxy,
                    chat=p.chat,
                    scorer=p.rewards[task.name],
                    sampling=task.sampling,
                    max_turns=task.max_turns,
                    context=task.context,
                    env_timeout_s=task.env_timeout_s,
                    before_first_turn=functools.partial(self.wait_served, traj.start_version)
                    if ahead
                    else None,
                )
        except asyncio.CancelledError:
            pass  # cancelled by us (stale or shutting down); the fate is already set
        except FATAL as exc:  # the runner recorded the fate, then raised it: the run stops
            self._stop(task.name, "running an episode", exc)
        except Exception as exc:  # the runner records every fate itself; this is a bug guard
            log.exception("trajectory %s: runner crashed", traj.traj_id)
            traj.fate, traj.error = Fate.ENV_FAILED, repr(exc)
        finally:
            if traj.fate is None:
                traj.fate = Fate.CANCELLED_REDUNDANT
            traj.add_timing("episode", time.perf_counter() - t0)  # wall time from launch to fate
            self.inflight.pop(traj.traj_id, None)
            if traj.fate is Fate.FINISHED:
                if traj.group_id in self._group_finished:
                    self._group_finished[traj.group_id] += 1
                    if self._group_finished[traj.group_id] >= task.group_size:
                        self._cancel_surplus(traj.group_id)
                elif task.redundancy:  # finished after its group was already complete: surplus
                    traj.fate = Fate.CANCELLED_REDUNDANT
                    self.cancelled_redundant += 1
            self.ledger.record(traj)
            self.finished.append(traj)
            await p.buffer.put(traj)

    def _stop(self, task: str, doing: str, exc: Exception) -> None:
        if self.fatal is None:
            log.error("task %s: %s failed: %s", task, doing, exc)
            self.fatal = ConfigError(f"env: task {task!r}, {doing}: {exc}")
            self.fatal.__cause__ = exc

    async def wait_served(self, version: int) -> None:
        """Until the engines serve ``version`` or newer (the loop's update notifies the buffer)."""
        await self.p.buffer.wait_for(lambda: True if self.clock.served >= version else None)

    def _cancel_surplus(self, group_id: str) -> None:
        """The group has its ``group_size`` finished trajectories: cancel the stragglers now
        (synchronously, so none of them can still slip in as finished)."""
        del self._group_finished[group_id]
        for traj, task in list(self.inflight.values()):
            if traj.group_id == group_id and traj.fate is None and not task.done():
                traj.fate = Fate.CANCELLED_REDUNDANT
                task.cancel()
                self.cancelled_redundant += 1

    def abort_stale(self, trainer_version: int, alpha: int) -> int:
        """Cancel in-flight trajectories that can no longer be trained within ``alpha``."""
        n = 0
        for traj, task in list(self.inflight.values()):
            if traj.fate is None and trainer_version - traj.min_version() > alpha and not task.done():
                traj.fate = Fate.ABORTED_STALE
                task.cancel()
                n += 1
        return n

    async def wait_all(self) -> None:
        tasks = [t for _, t in self.inflight.values()]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def cancel_all(self) -> None:
        """End the run's rollout: every trajectory still in flight gets ``cancelled_at_stop``."""
        for traj, task in self.inflight.values():
            traj.fate = traj.fate or Fate.CANCELLED_AT_STOP
            task.cancel()
        await self.wait_all()

    def drain_finished(self) -> list[Trajectory]:
        out, self.finished = self.finished, []
        return out
