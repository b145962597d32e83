"""Rollout: launch groups of trajectories, track them in flight, abort the ones that went stale.

Each trajectory is its own asyncio task (R2): it drives env ↔ proxy ↔ reward through
:func:`run_trajectory` and is settled in the run's :class:`~rollart_core.control.state.RunState` with
a fate, whatever happens. The training loop decides *when* to launch (all at once for a step, or
continuously under admission control) and when in-flight work can no longer meet the staleness bound:
it is aborted early (fate ``aborted_stale``) instead of being finished and dropped.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import time
from collections import Counter
from typing import TYPE_CHECKING

from rollart_core.control.runner import FATAL, run_trajectory
from rollart_core.control.state import RunState, decide
from rollart_core.errors import ConfigError, EnvError
from rollart_core.types import Fate, Trajectory

if TYPE_CHECKING:
    from rollart_core.control.pipeline import Pipeline

__all__ = ["Rollout", "derive_seed"]

log = logging.getLogger(__name__)


def derive_seed(*parts: object) -> int:
    return random.Random(":".join(map(str, parts))).randrange(2**31)


class Rollout:
    def __init__(self, p: Pipeline, state: RunState | None = None) -> None:
        self.p = p
        self.state = state or RunState(p.config.loop.alpha, p.trainer.version)
        """The run's state: trajectories start on its served version (or ahead, on the coming one)
        and are settled there with their fates."""
        self.inflight: dict[str, tuple[Trajectory, asyncio.Task[None]]] = {}
        self.finished: list[Trajectory] = []
        """Trajectories that got a fate since the last :meth:`drain_finished`."""
        self.groups_launched = 0
        self._task_index = {t.name: i for i, t in enumerate(p.config.tasks)}

    @property
    def launched(self) -> int:
        return self.state.launched

    @property
    def fates(self) -> Counter[str]:
        """Fates of every trajectory that ended (the run state's one count)."""
        return self.state.fates

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
        self.state.announce(group_id, n_launch, task.name, needed=task.group_size)
        for k in range(n_launch):
            traj = Trajectory(
                f"{group_id}-{k}",
                task.name,
                task.env.impl,
                group_id,
                seed,
                max(self.state.clock.served, start_version or 0),
            )
            self.inflight[traj.traj_id] = (traj, asyncio.create_task(self._run(traj, task_index)))
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
            except (EnvError, *FATAL) as exc:
                decide(traj, exc, f"no environment: {exc}")
                if isinstance(exc, FATAL):
                    self._stop(task.name, "building the environment", exc)
            else:
                ahead = traj.start_version > self.state.clock.served
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
                    before_first_turn=functools.partial(self.state.until_served, traj.start_version)
                    if ahead
                    else None,
                )
        except asyncio.CancelledError:
            pass  # cancelled by us (stale or shutting down); the fate is already set
        except FATAL as exc:  # the runner recorded the fate, then raised it: the run stops
            self._stop(task.name, "running an episode", exc)
        except Exception as exc:  # the runner records every fate itself; this is a bug guard
            log.exception("trajectory %s: runner crashed", traj.traj_id)
            decide(traj, Fate.ENV_FAILED, repr(exc))
        finally:
            decide(traj, traj.fate or Fate.CANCELLED_REDUNDANT)
            traj.add_timing("episode", time.perf_counter() - t0)  # wall time from launch to fate
            self.inflight.pop(traj.traj_id, None)
            if self.state.settle(traj):
                self._cancel_surplus(traj.group_id)
            self.finished.append(traj)

    def _stop(self, task: str, doing: str, exc: Exception) -> None:
        """A user's mistake a trajectory hit (a ConfigError building or running its environment):
        every trajectory would hit it, so the run stops on it, naming the stage."""
        error = ConfigError(f"env: task {task!r}, {doing}: {exc}")
        error.__cause__ = exc
        if self.state.fail(error):
            log.error("task %s: %s failed: %s", task, doing, exc)

    def _cancel_surplus(self, group_id: str) -> None:
        """The group has its ``group_size`` finished trajectories: cancel the stragglers now
        (synchronously, so none of them can still slip in as finished)."""
        for traj, task in list(self.inflight.values()):
            if traj.group_id == group_id and traj.fate is None and not task.done():
                decide(traj, Fate.CANCELLED_REDUNDANT)
                task.cancel()

    def abort_stale(self, trainer_version: int, alpha: int) -> int:
        """Cancel in-flight trajectories that can no longer be trained within ``alpha``."""
        n = 0
        for traj, task in list(self.inflight.values()):
            if traj.fate is None and trainer_version - traj.min_version() > alpha and not task.done():
                decide(traj, Fate.ABORTED_STALE)
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
            decide(traj, traj.fate or Fate.CANCELLED_AT_STOP)
            task.cancel()
        await self.wait_all()

    def drain_finished(self) -> list[Trajectory]:
        out, self.finished = self.finished, []
        return out
