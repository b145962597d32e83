"""Per-stage busy intervals: where a run's time goes.

The runner and the training loop call :func:`record` with ``(stage, start, end)`` wherever they
already measure a stage (``time.perf_counter`` seconds): ``generate`` (one turn's request),
``env`` (a reset or a step), ``reward`` (one call, queueing included), ``train`` (one step) and
``weight_sync`` (waiting for the push + updating the engines). Nothing is kept unless a
:class:`Timeline` is active (``with Timeline() as tl:``), so recording costs nothing otherwise.

The arithmetic (:func:`union_length`, :func:`utilisation`, :func:`bottleneck_bound`) is pure and
used by ``rollart bench`` to report utilisation per stage and achieved throughput vs the bound.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "STAGES",
    "CpuMeter",
    "Timeline",
    "bottleneck_bound",
    "mean_concurrency",
    "merge",
    "cpu_jiffies",
    "record",
    "union_length",
    "utilisation",
]

STAGES = ("generate", "env", "reward", "train", "weight_sync")
_active: list[Timeline] = []


def record(stage: str, start: float, end: float, lane: str = "") -> None:
    """Record that ``stage`` was busy from ``start`` to ``end`` (no-op unless a Timeline is active)."""
    for tl in _active:
        tl.intervals.append((stage, start, end, lane))


@dataclass
class Timeline:
    """Collects ``(stage, start, end, lane)`` tuples while active (a context manager)."""

    intervals: list[tuple[str, float, float, str]] = field(default_factory=list)

    def __enter__(self) -> Timeline:
        _active.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _active.remove(self)

    def of(self, stage: str) -> list[tuple[float, float]]:
        return [(s, e) for st, s, e, _ in self.intervals if st == stage]

    def summary(self, window: tuple[float, float]) -> dict[str, dict[str, float]]:
        """Per stage: busy fraction of ``window`` (union of intervals), mean concurrency, count."""
        return {
            st: {
                "utilisation": utilisation(self.of(st), window),
                "mean_concurrency": mean_concurrency(self.of(st), window),
                "count": float(len(self.of(st))),
            }
            for st in STAGES
        }


def _clip(intervals: Iterable[tuple[float, float]], window: tuple[float, float]) -> list[tuple[float, float]]:
    lo, hi = window
    out = []
    for s, e in intervals:
        if e < s:
            raise ValueError(f"interval ends before it starts: ({s}, {e})")
        s, e = max(s, lo), min(e, hi)
        if e > s:
            out.append((s, e))
    return out


def merge(
    intervals: Iterable[tuple[float, float]], window: tuple[float, float] = (float("-inf"), float("inf"))
) -> list[tuple[float, float]]:
    """Sorted, disjoint spans covering the same time as ``intervals`` (clipped to ``window``)."""
    out: list[tuple[float, float]] = []
    for s, e in sorted(_clip(intervals, window)):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def union_length(intervals: Iterable[tuple[float, float]], window: tuple[float, float]) -> float:
    """Length of the union of ``intervals`` inside ``window`` (overlaps counted once)."""
    return sum(e - s for s, e in merge(intervals, window))


def utilisation(intervals: Iterable[tuple[float, float]], window: tuple[float, float]) -> float:
    """Fraction of ``window`` in which at least one interval is running, in [0, 1]."""
    span = window[1] - window[0]
    if span <= 0:
        raise ValueError(f"empty window {window}")
    return min(1.0, union_length(intervals, window) / span)


def mean_concurrency(intervals: Iterable[tuple[float, float]], window: tuple[float, float]) -> float:
    """Average number of intervals running at once over ``window`` (sum of clipped lengths / span)."""
    span = window[1] - window[0]
    if span <= 0:
        raise ValueError(f"empty window {window}")
    return sum(e - s for s, e in _clip(intervals, window)) / span


def bottleneck_bound(capacity: Mapping[str, float | None], shared: Iterable[str] = ()) -> dict[str, Any]:
    """Throughput bound from standalone stage capacities (work units/s each, e.g. trajectories/s).

    Stages on separate resources bound throughput by the slowest (``min``). Stages in ``shared``
    run on the same cores, so one unit costs the sum of their times: they count as one stage of
    capacity ``1 / sum(1 / c)``. A capacity of None is a stage that could not be measured: it bounds
    nothing and is listed in ``unmeasured`` (a shared group with one unmeasured member is left out
    whole). Returns the bound and the bottleneck's name (both None when nothing was measured).
    """
    for name, c in capacity.items():
        if c is not None and c <= 0:
            raise ValueError(f"capacity of {name!r} must be > 0, got {c}")
    missing = [k for k, v in capacity.items() if v is None]
    measured = {k: v for k, v in capacity.items() if v is not None}
    shared = [s for s in shared if s in capacity]
    stages: dict[str, float] = {k: v for k, v in measured.items() if k not in shared}
    if shared and all(s in measured for s in shared):
        stages["+".join(shared)] = 1.0 / sum(1.0 / measured[s] for s in shared)
    if not capacity:
        raise ValueError("no capacities given")
    if not stages:
        return {"bound": None, "bottleneck": None, "stages": {}, "unmeasured": missing}
    name = min(stages, key=lambda k: stages[k])
    return {"bound": stages[name], "bottleneck": name, "stages": stages, "unmeasured": missing}


def cpu_jiffies() -> tuple[int, int] | None:
    """The machine's ``(busy, total)`` CPU time in jiffies so far, all cores (Linux ``/proc/stat``);
    None where that file does not exist."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields[:8]) - idle, sum(fields[:8])  # guest time is already in user


class CpuMeter:
    """Samples the machine's CPU busy time every ``period`` seconds while active (an async context
    manager), so the busy fraction of any window inside it can be read afterwards: how much of the
    machine a mode used, whatever ran it (engine, trainer, environments, Ray, the control loop)."""

    def __init__(self, period: float = 0.25) -> None:
        self.period = period
        self.samples: list[tuple[float, int, int]] = []
        self._task: asyncio.Task[None] | None = None

    def _sample(self) -> None:
        j = cpu_jiffies()
        if j is not None:
            self.samples.append((time.perf_counter(), *j))

    async def _run(self) -> None:
        while True:
            self._sample()
            await asyncio.sleep(self.period)

    async def __aenter__(self) -> CpuMeter:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._sample()

    def busy(self, window: tuple[float, float]) -> float | None:
        """Fraction of all cores busy between the samples nearest to ``window``'s ends (None: no data)."""
        if len(self.samples) < 2:
            return None
        a = min(self.samples, key=lambda s: abs(s[0] - window[0]))
        b = min(self.samples, key=lambda s: abs(s[0] - window[1]))
        return (b[1] - a[1]) / (b[2] - a[2]) if b[2] > a[2] else None
