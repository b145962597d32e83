"""RunState: a run's changing state, with one owner and one signal.

Everything that changes while a run goes on lives here, and only the methods here change it:

- the version clock: trained / served / coming / last-batch versions (:class:`VersionClock`'s rules);
- the groups announced and not yet taken, in flight or complete (:class:`SampleBuffer`);
- every trajectory's fate, counted once (:class:`FateLedger`), and the trajectories launched;
- the run's failure: set once, by whichever part hit it first.

Each change checks its rule (a broken one is a bug in the caller: ``ClockError`` or ``ValueError``,
and nothing changes), makes the change and wakes every waiter. Nobody else signals anybody: the
buffer, admission, the rollout and the recipes call these methods and read ``clock``, ``buffer`` and
``ledger``; they never call back into each other.

==========================  ========================================================================
primitive                   who calls it
==========================  ========================================================================
``trained_to``              the train step: the trainer produced a version
``serve``                   the weight sync: the engines serve a version (admission, waiting
                            trajectories wake)
``will_serve``              the async recipe: a version will be served without waiting for rollout
``announce``                the rollout: a group was launched
``settle``                  the rollout: a trajectory ended; its fate is counted here
``drop_untrainable``        the loop's Get Batch: ready groups with nothing trainable leave
``take_batch``              the loop's Get Batch: the batch leaves (stale members are relabelled)
``fail``                    anything that hit an error the run must stop on (set once)
``wait_for``                the loop and admission: until a choice over this state is possible;
                            raises the run's failure in every such waiter as soon as it is set
``until_served``            a trajectory admitted ahead of a version, before its first generation
``restore``, ``resume_at``  resuming from a checkpoint: its groups and counts, then its version
==========================  ========================================================================

Fates are assigned in this module only: :func:`decide` gives a trajectory its fate (an outcome, or
the exception that ended it mapped to the stage that failed), and :class:`RunState` relabels the
finished ones that turn out surplus (``cancelled_redundant``) or too old (``aborted_stale``).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from rollart_core.control.buffer import SampleBuffer
from rollart_core.control.clock import VersionClock
from rollart_core.control.ledger import FateLedger
from rollart_core.errors import EngineError, EnvError, EnvTimeoutError, RewardError
from rollart_core.types import Fate, Trajectory

__all__ = ["RunState", "decide", "fate_of"]

T = TypeVar("T")


def fate_of(exc: BaseException) -> Fate:
    """The fate of a trajectory that ``exc`` ended: the engine's failure, the reward's, a timeout, or
    else the environment's (an environment that could not be had or built included)."""
    if isinstance(exc, EngineError):
        return Fate.GENERATION_FAILED
    if isinstance(exc, RewardError):
        return Fate.REWARD_FAILED
    if isinstance(exc, (TimeoutError, EnvTimeoutError)):
        return Fate.TIMED_OUT
    return Fate.ENV_FAILED


def decide(traj: Trajectory, outcome: Fate | BaseException, error: str | None = None) -> None:
    """Give ``traj`` its fate: ``outcome`` itself, or the fate of the exception that ended it. Its
    error: ``error``, else the exception's text (its repr where the text says too little)."""
    if isinstance(outcome, Fate):
        traj.fate = outcome
    else:
        traj.fate = fate_of(outcome)
        if error is None and traj.fate is Fate.TIMED_OUT:
            error = str(outcome) or repr(outcome)
        elif error is None:
            error = (
                str(outcome) if isinstance(outcome, (EngineError, RewardError, EnvError)) else repr(outcome)
            )
    if error is not None:
        traj.error = error


class RunState:
    """One run's changing state (see the module): ``alpha`` is the staleness bound, ``trained`` the
    trainer's version (and the engines') when the run starts."""

    def __init__(self, alpha: int = 0, trained: int = 0) -> None:
        self.alpha = alpha
        self.clock = VersionClock(trained)
        """Read it; it moves through :meth:`trained_to`, :meth:`serve`, :meth:`will_serve`."""
        self.buffer = SampleBuffer(alpha)
        """Read it; groups come and go through :meth:`announce`, :meth:`settle`, :meth:`take_batch`."""
        self.ledger = FateLedger()
        """Read it; fates are counted by :meth:`settle` and :meth:`take_batch`."""
        self.launched = 0
        """Trajectories launched: once all have ended, the sum over the ledger's fates."""
        self.stale_tokens = 0
        """Generated tokens of finished trajectories dropped as stale when their group was taken."""
        self.failure: BaseException | None = None
        """The error the run stops on, the first one :meth:`fail` was given."""
        self.changes = 0
        """Changes so far (each woke the waiters once)."""
        self._changed = asyncio.Event()
        """Set (and replaced by a fresh one) on every change: the one signal."""

    @property
    def fates(self) -> Counter[str]:
        """How many trajectories ended with each fate: the one count of it."""
        return self.ledger.counts

    def _wake(self) -> None:
        self.changes += 1
        self._changed.set()
        self._changed = asyncio.Event()

    # the version clock ------------------------------------------------------------------------------

    def trained_to(self, version: int) -> None:
        """The trainer produced ``version``."""
        self.clock.trained_to(version)
        self._wake()

    def serve(self, version: int) -> None:
        """The engines serve ``version``: groups launched from now on start on it."""
        self.clock.serve(version)
        self._wake()

    def will_serve(self, version: int) -> None:
        """``version`` will be served without waiting for the rollout: groups may be admitted on it."""
        self.clock.expect(version)
        self._wake()

    def resume_at(self, version: int) -> None:
        """A run resumed from a checkpoint: trainer and engines are at ``version``."""
        self.clock.resume_at(version)
        self._wake()

    # groups and fates --------------------------------------------------------------------------------

    def announce(self, group_id: str, n: int, task: str | None = None, needed: int | None = None) -> None:
        """``n`` trajectories were launched for ``group_id`` (of ``task``); ``needed`` of them must
        finish (default all: more are surplus, ``cancelled_redundant``)."""
        self.buffer.announce(group_id, n, task, needed)
        self.launched += n
        self._wake()

    def settle(self, traj: Trajectory) -> bool:
        """``traj`` ended with its fate: count it, once, and add it to its group. A finished one its
        group no longer needs becomes ``cancelled_redundant``. Returns whether it was the last
        finished trajectory its group needed (the caller cancels the group's stragglers)."""
        group = self.buffer.group_of(traj)
        complete = False
        if traj.fate is Fate.FINISHED:
            if group.finished >= group.needed:
                traj.fate = Fate.CANCELLED_REDUNDANT
            else:
                group.finished += 1
                complete = group.finished == group.needed
        self.buffer.add(traj)
        self.ledger.record(traj)
        self._wake()
        return complete

    def drop_untrainable(self, version: int | None = None) -> list[tuple[str, str | None]]:
        """Remove the ready groups with nothing to train at ``version`` (default: the trained one);
        returns each as (group id, task)."""
        version = self.clock.trained if version is None else version
        dropped = []
        for g in self.buffer.untrainable(version):
            task = self.buffer.groups[g].task
            self._relabel_stale(self.buffer.remove(g, version)[1])
            self.buffer.dropped_groups.append(g)
            dropped.append((g, task))
        if dropped:
            self._wake()  # admission may launch in their place
        return dropped

    def take_batch(
        self, num_groups: int, mix: Mapping[str, int] | None = None, *, version: int | None = None
    ) -> list[Trajectory] | None:
        """The trajectories of the ``num_groups`` oldest ready groups trainable at ``version``
        (default: the trained one; with ``mix``: that many groups of each task), taken out of the
        buffer, or None while there are not enough. Members too old become ``aborted_stale``."""
        version = self.clock.trained if version is None else version
        chosen = self.buffer.choose(num_groups, version, mix)
        if chosen is None:
            return None
        batch = []
        for g in chosen:
            fresh, stale = self.buffer.remove(g, version)
            self._relabel_stale(stale)
            batch += fresh
        self.buffer.consumed += len(batch)
        self.clock.batch_taken()
        self._wake()
        return batch

    def _relabel_stale(self, stale: list[Trajectory]) -> None:
        for t in stale:  # finished ones (SampleBuffer.remove)
            t.fate = Fate.ABORTED_STALE
            self.ledger.relabel(Fate.FINISHED, Fate.ABORTED_STALE)
            self.stale_tokens += t.num_generated()

    def restore(self, buffer: dict[str, Any], fates: Mapping[str, int], launched: int, inflight: int) -> None:
        """A checkpoint's content: its buffered groups, its counts, and the trajectories that were
        in flight when it was saved (they can never end here: booked as ``cancelled_at_stop``)."""
        self.buffer.load_state_dict(buffer)
        self.ledger.counts.update(fates)
        if inflight:
            self.ledger.counts[Fate.CANCELLED_AT_STOP.value] += inflight
        self.launched = launched
        self._wake()

    # the run's failure ---------------------------------------------------------------------------------

    def fail(self, exc: BaseException) -> bool:
        """The run must stop on ``exc``: every :meth:`wait_for` raises it, now and from now on. Only
        the first failure is kept; returns whether this was it."""
        if self.failure is not None:
            return False
        self.failure = exc
        self._wake()
        return True

    # waiting -------------------------------------------------------------------------------------------

    async def wait_for(
        self, choose: Callable[[], T | None], *, wake_at: Callable[[], float | None] | None = None
    ) -> T:
        """Wait until ``choose()`` returns something other than None and return it; it is evaluated
        now and after every change. Raises the run's failure as soon as one is set. ``wake_at()``:
        a ``time.monotonic()`` instant to evaluate ``choose`` at even if nothing changed (a deadline
        it checks)."""
        return await self._wait(choose, wake_at, stop_on_failure=True)

    async def until_served(self, version: int) -> None:
        """Until the engines serve ``version`` or newer. A failure does not end this wait: the
        trajectory waiting here is cancelled when the run stops."""
        await self._wait(lambda: True if self.clock.served >= version else None, None, stop_on_failure=False)

    async def get_batch(
        self, num_groups: int, mix: Mapping[str, int] | None = None, *, version: int | None = None
    ) -> list[Trajectory]:
        """Wait for :meth:`take_batch`'s batch, dropping ready groups with nothing trainable meanwhile
        (for tools and tests; the training loop also replaces those and watches for stalls)."""

        def ready() -> list[Trajectory] | None:
            self.drop_untrainable(version)
            return self.take_batch(num_groups, mix, version=version)

        return await self.wait_for(ready)

    async def _wait(
        self,
        choose: Callable[[], T | None],
        wake_at: Callable[[], float | None] | None,
        *,
        stop_on_failure: bool,
    ) -> T:
        while True:
            if stop_on_failure and self.failure is not None:
                raise self.failure
            if (out := choose()) is not None:
                return out
            changed = self._changed  # taken after choose(): a change it made itself is already seen
            deadline = wake_at() if wake_at is not None else None
            timeout = None if deadline is None else max(deadline - time.monotonic(), 0.001)
            try:
                async with asyncio.timeout(timeout):
                    await changed.wait()
            except TimeoutError:
                pass

    def __repr__(self) -> str:
        return (
            f"RunState({self.clock!r}, pending groups {self.buffer.pending_groups()}, "
            f"fates {dict(self.fates)}, failure {self.failure!r})"
        )
