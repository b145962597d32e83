"""Per-task latency samples of a segment's stages, read off its timeline: what a workload profile for
the simulator (:mod:`rollart_core.plan`) is made of, measured in the same run as the throughput.

The runner records every generation turn, env call and reward call with the trajectory id as its
lane (``{tag}{n}-{task}-{k}``); the trainer records its steps without one.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from typing import Any

__all__ = ["MAX_SAMPLES", "latency_samples", "task_of"]

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
