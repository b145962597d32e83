"""The control plane's primitives: the named steps the mode recipes are written in.

A :class:`Run` holds what a recipe works on: the pipeline's typed components, the rollout and the
run's :class:`~rollart_core.control.state.RunState` (versions, groups, fates, failure). Each primitive is one step of the asynchronous
training protocol and records its own timing in the step's :class:`StepRecord`:

==================  ===========================================================================
``get_batch``       1. Get Batch: wait for the step's groups behind the staleness gate; never
                    silently: the run's failure (a failed background task such as a push or the
                    producer, a user's mistake an episode hit) or a stalled / failing rollout
                    raises at once, naming the stage
``sync_weights``    2-5. Suspend → Update → Resume → Recompute KV on every engine (each engine
                    pauses with its requests kept, swaps in the version, re-prefills the running
                    requests and resumes: its pause is only its own swap)
``train_step``      6. Train: one policy update on the batch, off the event loop
``push``            the new weights to the store (from the trainer's ranks when it can), then
                    the engines stage them while generating; optionally ``sync_weights`` at once
``abort_stale``     cancel in-flight trajectories that can no longer be trained within alpha
==================  ===========================================================================
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Iterator
from dataclasses import dataclass, field
from typing import Any

from rollart_core.config import RunConfig
from rollart_core.control.clock import VersionClock
from rollart_core.control.pipeline import Pipeline
from rollart_core.control.rollout import Rollout
from rollart_core.control.state import RunState
from rollart_core.errors import RollartError, WeightSyncError
from rollart_core.malloc import release_free_memory
from rollart_core.protocols import SupportsWeightPrefetch, SupportsWeightPush
from rollart_core.timeline import record
from rollart_core.types import Fate, Trajectory

__all__ = [
    "Run",
    "RunStalled",
    "StepRecord",
    "abort_stale",
    "get_batch",
    "push",
    "sync_weights",
    "train_step",
]

_MIN_FAILURE_SAMPLE = 64


class RunStalled(RollartError):
    """Nothing trainable is arriving: the run stops instead of waiting silently."""


@dataclass
class StepRecord:
    step: int
    t0: float = field(default_factory=time.perf_counter)
    wait_s: float = 0.0
    sync_s: float = 0.0
    pauses: dict[str, float] = field(default_factory=dict)
    aborted: int = 0
    inflight_at_train: int = 0
    train: dict[str, float] = field(default_factory=dict)
    batch: list[Trajectory] = field(default_factory=list)
    ended: list[Trajectory] = field(default_factory=list)
    """The trajectories that got their fate since the previous step's metrics (:func:`step_metrics`)."""


class Run:
    """One run's state as the recipes see it."""

    def __init__(self, p: Pipeline, cfg: RunConfig | None = None, first_step: int = 1) -> None:
        self.p = p
        self.cfg: RunConfig = cfg or p.config
        """The run's config: ``train()``'s (a borrowed pipeline may have been built from another)."""
        self.state = RunState(self.cfg.loop.alpha, p.trainer.version)
        """The run's changing state: versions, groups, fates, its failure."""
        self.rollout = Rollout(p, self.state)
        self.mix = {t.name: t.groups_per_step for t in self.cfg.tasks}
        """Groups of each task in every batch."""
        self.num_groups = sum(self.mix.values())
        self.first_step = first_step
        self.relaunches = 0
        self.background: list[asyncio.Task[Any]] = []
        """Tasks beside the loop (the producer, pushes): the first to fail is the run's failure."""
        self.t_start = time.perf_counter()

    @property
    def clock(self) -> VersionClock:
        """The run's versions (read them; they move through :attr:`state`)."""
        return self.state.clock

    def steps(self) -> Iterator[StepRecord]:
        for step in range(self.first_step, self.cfg.loop.steps + 1):
            yield StepRecord(step)

    def beside(self, coro: Awaitable[Any], name: str) -> asyncio.Task[Any]:
        """Run ``coro`` beside the loop; if it fails, the run fails (every wait raises at once)."""
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        task.add_done_callback(self._ended_beside)
        self.background = [t for t in self.background if not t.done()]
        self.background.append(task)
        return task

    def _ended_beside(self, task: asyncio.Task[Any]) -> None:
        if task.cancelled() or (exc := task.exception()) is None:
            return
        error = RollartError(f"{task.get_name()} failed beside the loop: {exc!r}")
        error.__cause__ = exc
        self.state.fail(error)

    async def stop(self) -> None:
        """Cancel what runs beside the loop and every trajectory still in flight."""
        for t in self.background:
            t.cancel()
        await asyncio.gather(*self.background, return_exceptions=True)
        self.background.clear()
        await self.rollout.cancel_all()


# 1. Get Batch ----------------------------------------------------------------------------------------


async def get_batch(run: Run, rec: StepRecord, *, relaunch: bool = False) -> list[Trajectory]:
    """The step's groups at the trainer's version, oldest first. ``relaunch`` (sync/one_off, where
    nothing else launches): a group that ended with nothing trainable is replaced by a fresh one of
    its task, within ``loop.max_group_relaunches``. Evaluated on every change of the run's state (and
    at the stall deadline); raises the run's failure as soon as it is set."""
    t0 = time.perf_counter()
    state, loop = run.state, run.cfg.loop

    def ready() -> list[Trajectory] | None:
        for group, task in state.drop_untrainable():
            _replace(run, group, task, relaunch)
        batch = state.take_batch(run.num_groups, run.mix)
        if batch is None:
            _check_progress(run)
        return batch

    def stall_deadline() -> float | None:
        if loop.stall_timeout_s is None:
            return None
        return state.ledger.last_finished_at + loop.stall_timeout_s

    batch = await state.wait_for(ready, wake_at=stall_deadline)
    rec.wait_s += time.perf_counter() - t0
    rec.batch = batch
    return batch


def _replace(run: Run, group: str, task: str | None, relaunch: bool) -> None:
    if not relaunch:
        return
    if run.relaunches >= run.cfg.loop.max_group_relaunches:
        raise RunStalled(
            f"{_failing_stage(run)}: group {group} of task {task!r} ended with nothing trainable "
            f"and the relaunch budget (loop.max_group_relaunches = "
            f"{run.cfg.loop.max_group_relaunches}) is spent; {_fates_report(run)}"
        )
    run.relaunches += 1
    run.rollout.relaunch(task)


def _check_progress(run: Run) -> None:
    ledger, loop = run.state.ledger, run.cfg.loop
    share, stage = ledger.failure_share()
    if len(ledger.recent) >= _MIN_FAILURE_SAMPLE and share >= loop.max_failure_share:
        raise RunStalled(
            f"{stage}: {share:.0%} of the last {len(ledger.recent)} trajectories failed "
            f"(loop.max_failure_share = {loop.max_failure_share}); {_fates_report(run)}"
        )
    idle = time.monotonic() - ledger.last_finished_at
    if loop.stall_timeout_s is not None and idle >= loop.stall_timeout_s:
        raise RunStalled(
            f"{_failing_stage(run)}: no trajectory finished for {idle:.0f} s while waiting for a batch "
            f"(loop.stall_timeout_s = {loop.stall_timeout_s:g}); {len(run.rollout.inflight)} in flight; "
            f"{_fates_report(run)}"
        )


def _failing_stage(run: Run) -> str:
    return run.state.ledger.failure_share()[1] or "rollout"


def _fates_report(run: Run) -> str:
    ledger = run.state.ledger
    errors = "; ".join(f"{n}× {e}" for e, n in ledger.errors.most_common(3))
    return f"fates so far {dict(ledger.counts)}" + (f"; most frequent errors: {errors}" if errors else "")


# 2-5. Suspend, Update, Resume, Recompute KV ------------------------------------------------------------


async def sync_weights(run: Run, rec: StepRecord | None, version: int) -> dict[str, float]:
    """Every engine: Suspend (pause, requests kept) → Update (swap in ``version``, staged by the
    push) → Recompute KV (re-prefill the running requests) → Resume. Launches from now on start on
    ``version``. Returns each engine's pause."""
    t0 = time.perf_counter()
    pauses = await run.p.proxy.update_weights(version)
    run.state.serve(version)  # admission: groups launched from now on start on this version
    record("weight_sync", t0, time.perf_counter())
    if rec is not None:
        rec.pauses = pauses
        rec.sync_s += time.perf_counter() - t0
    return pauses


async def landed(run: Run, rec: StepRecord, pushed: asyncio.Task[dict[str, float]] | None) -> None:
    """Wait for the previous step's push (and, if it ran one, its ``sync_weights``)."""
    if pushed is None:
        return
    t0 = time.perf_counter()
    pauses = await pushed
    if pauses:
        rec.pauses = pauses
    rec.sync_s += time.perf_counter() - t0


# 6. Train, push -------------------------------------------------------------------------------------------


async def train_step(run: Run, rec: StepRecord, batch: list[Trajectory]) -> dict[str, float]:
    """One policy update on ``batch`` while rollout goes on (in a thread: the step never holds the loop)."""
    await asyncio.sleep(0)  # the producer refills the groups just taken before the step starts
    rec.inflight_at_train = len(run.rollout.inflight)
    t0 = time.perf_counter()
    metrics = await asyncio.to_thread(run.p.trainer.train_step, batch)
    record("train", t0, time.perf_counter())
    run.state.trained_to(run.p.trainer.version)
    rec.train = metrics
    return metrics


def push(run: Run, *, update: bool) -> asyncio.Task[dict[str, float]]:
    """Push the trainer's new weights in the background; once they land the engines stage them while
    generating. ``update``: run :func:`sync_weights` as soon as they are staged (update on arrival).
    A trainer that pushes by itself (``SupportsWeightPush``, e.g. a worker group) sends them from its
    ranks; otherwise the driver snapshots them now and the store writes them in its thread."""
    version, trainer = run.clock.trained, run.p.trainer
    if isinstance(trainer, SupportsWeightPush):
        commit: Awaitable[Any] = asyncio.to_thread(trainer.push_weights, version)
    else:
        commit = asyncio.wrap_future(run.p.store.push(version, dict(trainer.named_weights())))
    return run.beside(_land(run, version, commit, update), f"weight push of version {version}")


async def _land(run: Run, version: int, commit: Awaitable[Any], update: bool) -> dict[str, float]:
    t0 = time.perf_counter()
    limit = run.cfg.loop.weight_push_timeout_s
    try:
        await asyncio.wait_for(commit, limit)
    except TimeoutError:
        raise WeightSyncError(
            f"weight push of version {version}: writing it to the weight store "
            f"({run.cfg.weight_store.impl}) took over loop.weight_push_timeout_s={limit:g}"
        ) from None
    release_free_memory()  # the driver's snapshot of the weights, freed once written
    if isinstance(run.p.proxy, SupportsWeightPrefetch):
        await run.p.proxy.prefetch_weights(version)
    record("weight_sync", t0, time.perf_counter())
    return await sync_weights(run, None, version) if update else {}


def abort_stale(run: Run, rec: StepRecord) -> int:
    """Cancel in-flight trajectories that can no longer be trained within alpha (fate ``aborted_stale``)."""
    rec.aborted = run.rollout.abort_stale(run.clock.trained, run.cfg.loop.alpha)
    return rec.aborted


# metrics ------------------------------------------------------------------------------------------------


def step_metrics(run: Run, rec: StepRecord) -> dict[str, Any]:
    """The step's row: the trainer's metrics, timings, throughput, staleness and the step's fates."""
    done = rec.ended = run.rollout.drain_finished()
    batch, m = rec.batch, rec.train
    step_s = time.perf_counter() - rec.t0
    lags = [m["version"] - 1 - t.min_version() for t in batch]
    finished = [t for t in done if t.fate is Fate.FINISHED]
    episodes: dict[str, list[float]] = {}
    for t in finished:
        episodes.setdefault(t.task, []).append(t.timings.get("episode", 0.0))
    return {
        **_agent_metrics(finished),
        **m,
        "step_s": step_s,
        "wait_s": rec.wait_s,
        "sync_s": rec.sync_s,
        "aborted": rec.aborted,
        "elapsed": time.perf_counter() - run.t_start,
        "inflight_at_train": rec.inflight_at_train,
        "version": int(m["version"]),
        "success_rate": sum(bool(t.info.get("success")) for t in batch) / len(batch),
        "traj_per_s": len(finished) / step_s,
        "gen_tok_per_s": sum(t.num_generated() for t in done) / step_s,
        "trained_gen_tokens": sum(t.num_generated() for t in batch),
        "wasted_gen_tokens": sum(t.num_generated() for t in done) - sum(t.num_generated() for t in finished),
        "episode_s_by_task": {k: sum(v) / len(v) for k, v in episodes.items()},
        "finished_by_task": {k: len(v) for k, v in episodes.items()},
        "update_pause_s": max(rec.pauses.values(), default=0.0),
        "lag_max": max(lags, default=0),
        "lag_mean": sum(lags) / max(len(lags), 1),
        "batch_size": len(batch),
        "batch_groups": sorted({t.group_id for t in batch}),
        "batch_traj_ids": [t.traj_id for t in batch],
        "batch_start_versions": [t.min_version() for t in batch],
        "batch_tasks": dict(Counter(t.task for t in batch)),
        "success_by_task": {
            task: sum(bool(t.info.get("success")) for t in batch if t.task == task) / n
            for task, n in Counter(t.task for t in batch).items()
        },
        "fates": run.state.ledger.take_step(),
    }


def _agent_metrics(finished: list[Trajectory]) -> dict[str, int]:
    """Agent episodes finished this step (only when there are any): their model calls, the sequences
    they were trained as, and the history rewrites that split them (a sequence beyond the first)."""
    agents = [t for t in finished if "agent_calls" in t.info]
    if not agents:
        return {}
    segments = [int(t.info.get("segments", 1)) for t in agents]
    return {
        "agent_episodes": len(agents),
        "agent_calls": sum(int(t.info["agent_calls"]) for t in agents),
        "agent_segments": sum(segments),
        "agent_rewrites": sum(n - 1 for n in segments),
    }
