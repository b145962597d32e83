"""Per-task latency samples of a segment's stages, read off its timeline: what a workload profile for
the simulator (:mod:`rollart_core.plan`) is made of, measured in the same run as the throughput.

The runner records every generation turn, env call and reward call with the trajectory id as its
lane (``{tag}{n}-{task}-{k}``); the trainer records its steps without one.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from typing import Any

__all__ = ["MAX_SAMPLES", "latency_samples", "task_of", "version_waits"]

MAX_SAMPLES = 2000
"""Samples kept per task and stage (evenly thinned beyond): bench.json stays small."""


def task_of(traj_id: str) -> str | None:
    """The task of a trajectory id ``{tag}{n}-{task}-{k}`` (None if it is not one)."""
    group, sep, k = traj_id.rpartition("-")
    _, sep2, task = group.partition("-")
    return task if sep and sep2 and k.isdigit() and task else None


def _thin(values: list[float]) -> list[float]:
    step = max(1, -(-len(values) // MAX_SAMPLES))
    return [round(v, 5) for v in values[::step]]


def latency_samples(intervals: Iterable[tuple[str, float, float, str]]) -> dict[str, Any]:
    """Per task: seconds of each ``generate`` turn, ``env`` call and ``reward`` call, the turns of
    every trajectory that was scored (finished), and the generation turns split by whether they ended
    while the trainer ran (``generate_beside_train``) or not (``generate_alone``): the contention
    between the two on shared cores."""
    ivs = list(intervals)
    train = sorted((s, e) for st, s, e, _ in ivs if st == "train")
    starts = [s for s, _ in train]

    def beside_train(t: float) -> bool:
        i = bisect.bisect_right(starts, t) - 1
        return i >= 0 and train[i][1] >= t

    out: dict[str, dict[str, list[float]]] = {}
    turns: dict[str, int] = {}
    scored: set[str] = set()
    for st, s, e, lane in ivs:
        task = task_of(lane) if st in ("generate", "env", "reward") else None
        if task is None:
            continue
        per = out.setdefault(
            task,
            {k: [] for k in ("generate", "env", "reward", "generate_alone", "generate_beside_train")},
        )
        per[st].append(e - s)
        if st == "generate":
            turns[lane] = turns.get(lane, 0) + 1
            per["generate_beside_train" if beside_train(e) else "generate_alone"].append(e - s)
        elif st == "reward":
            scored.add(lane)
    result: dict[str, Any] = {}
    for task, per in out.items():
        result[task] = {k: _thin(v) for k, v in per.items()}
        result[task]["turns"] = [turns.get(lane, 0) for lane in sorted(scored) if task_of(lane) == task][
            :MAX_SAMPLES
        ]
    return result


def version_waits(
    intervals: Iterable[tuple[str, float, float, str]], window: tuple[float, float]
) -> dict[str, list[float]]:
    """Per task: [total seconds, count] of the time the groups launched ahead of the served policy
    version waited for it (reset done, first turn held back: the trainer's time, not the group's),
    for the groups whose last recorded call ended inside ``window``. A group's wait is the least any
    member waited between the end of its reset and its first generation (every member of a group
    waits for the same version)."""
    reset_end: dict[str, float] = {}
    first_gen: dict[str, float] = {}
    last: dict[str, float] = {}
    for st, s, e, lane in intervals:
        if st not in ("generate", "env", "reward") or task_of(lane) is None:
            continue
        group = lane.rpartition("-")[0]
        last[group] = max(last.get(group, e), e)
        if st == "env" and lane not in reset_end:
            reset_end[lane] = e
        elif st == "generate" and lane not in first_gen:
            first_gen[lane] = s
    waits: dict[str, float] = {}
    for lane, start in first_gen.items():
        if lane in reset_end:
            group = lane.rpartition("-")[0]
            gap = max(0.0, start - reset_end[lane])
            waits[group] = min(waits.get(group, gap), gap)
    out: dict[str, list[float]] = {}
    for group, end in last.items():
        task = task_of(f"{group}-0")
        if task is None or not window[0] < end <= window[1]:
            continue
        acc = out.setdefault(task, [0.0, 0])
        acc[0] += waits.get(group, 0.0)
        acc[1] += 1
    return out
