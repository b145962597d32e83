"""The bench's arithmetic: throughput, bounds, ratios and their spread over rounds, from the records
of the segments (pure functions, unit-tested on hand-made segments).

- **compute bound**: the standalone capacity of each stage (:func:`rollart_core.timeline.bottleneck_bound`);
- **window bound** (async modes): admission keeps at most ``depth`` steps of groups launched and not yet
  taken by the trainer, and a group of task t lives W_t seconds from launch until it is taken (trained,
  or dropped with nothing trainable). By Little's law the steps per second s satisfy
  ``s · Σ_t gps_t · W_t <= depth · Σ_t gps_t``: groups are taken at most ``s · Σ_t gps_t`` per second,
  and trained trajectories per second are at most that times the trajectories trained per group
  taken, as measured in the same window (:func:`window_bound`): a crashed, timed-out or stale
  member, or a group dropped with nothing trainable, held its place in the window but trains nothing,
  so the nominal group size would give a bound no mode can reach. ``achieved / window bound`` is then
  the mean fraction of the window admission kept filled;
- every ratio is also taken per round (each round runs every mode once, back to back) and given as
  median [min–max] over rounds (:func:`spread`).
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from rollart_core.timeline import STAGES

__all__ = [
    "ADDITIVE_REWARD_STATS",
    "aggregate",
    "episode_sums",
    "goals",
    "group_sums",
    "merge_sums",
    "reward_delta",
    "spread",
    "steady_window",
    "trained_per_group",
    "window_bound",
]

RATIO_BASES = {"sync": "vs_sync", "one_off": "vs_one_off", "admission": "vs_admission"}
"""Modes every other mode's throughput is compared with, when they ran: the key of the ratio."""
ADDITIVE_REWARD_STATS = (
    "calls",
    "failures",
    "busy_s",
    "provisioned_s",
    "runtime_calls",
    "runtime_failures",
    "runtime_busy_s",
    "runtime_provisioned_s",
    "runtime_billed_s",
    "runtime_cold_starts",
    "runtime_restarts",
)
"""Counters of a reward executor's ``stats()`` that add up over time: a segment's share is the
difference of the snapshots around it."""


def episode_sums(rows: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Per task: [total seconds, count] of the episodes that finished in these step rows (launch
    to fate, wall time), so that means can be taken over any set of rows."""
    return merge_sums(
        {task: [h["episode_s_by_task"][task] * n, n] for task, n in h["finished_by_task"].items()}
        for h in rows
    )


def merge_sums(parts: Iterable[Mapping[str, list[float]]]) -> dict[str, list[float]]:
    """Add per-task [total, count] pairs."""
    out: dict[str, list[float]] = {}
    for part in parts:
        for task, (total, n) in part.items():
            acc = out.setdefault(task, [0.0, 0])
            acc[0] += total
            acc[1] += n
    return out


def group_sums(
    intervals: Iterable[tuple[str, float, float, str]], stage: str, window: tuple[float, float]
) -> dict[str, list[float]]:
    """Per task (the interval's lane): [total seconds, count] of the ``stage`` intervals (``group``:
    launch → taken; ``group_rollout``: launch → last fate) of the groups taken inside ``window``."""
    return merge_sums(
        {lane: [e - s, 1]} for st, s, e, lane in intervals if st == stage and window[0] < e <= window[1]
    )


def means(sums: Mapping[str, list[float]]) -> dict[str, float]:
    return {task: total / n for task, (total, n) in sums.items() if n}


def steady_window(
    hist: list[dict[str, Any]], warmup: int
) -> tuple[tuple[float, float], list[dict[str, Any]]] | None:
    """The steady state of a segment's step rows (``elapsed``: seconds since the segment's start at
    the end of the step): from the end of step ``warmup`` (0: the start) to the end of the last, and
    the rows of the steps measured in it. None without a step after the warm-up."""
    if len(hist) <= warmup:
        return None
    return (hist[warmup - 1]["elapsed"] if warmup else 0.0, hist[-1]["elapsed"]), hist[warmup:]


def window_bound(
    depth: int,
    mix: Mapping[str, int],
    group_size: Mapping[str, int],
    lifetime_s: Mapping[str, float],
    trained_per_group: float | None = None,
) -> float | None:
    """Trained trajectories/s at most, with ``depth`` steps of groups in flight (``mix``: groups of
    each task per batch) living ``lifetime_s`` each (launch → taken, per task): Little's law, times
    ``trained_per_group`` (measured: trained trajectories per group taken; None: the nominal group
    sizes of the mix). None when a task of the mix has no measured lifetime."""
    if any(t not in lifetime_s for t in mix):
        return None
    group_seconds_per_batch = sum(n * lifetime_s[t] for t, n in mix.items())
    if group_seconds_per_batch <= 0:
        return None
    batches_per_s = depth * sum(mix.values()) / group_seconds_per_batch
    if trained_per_group is None:
        return batches_per_s * sum(n * group_size[t] for t, n in mix.items())
    return batches_per_s * sum(mix.values()) * trained_per_group


def trained_per_group(segs: Iterable[Mapping[str, Any]]) -> float | None:
    """Trajectories trained per group taken (``groups``: the groups taken or dropped in the measured
    window, whose batches ``trained`` counts); None without a group."""
    segs = list(segs)
    groups = sum(n for s in segs for _, n in s.get("groups", {}).values())
    return sum(s["trained"] for s in segs) / groups if groups else None


def spread(values: Iterable[float | None]) -> dict[str, Any] | None:
    """Median, min and max of the per-round values (None where a round had none)."""
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "rounds": vals}


def reward_delta(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, float]:
    """What a reward executor did between two ``stats()`` snapshots: the additive counters' growth,
    and the snapshot figures (workers now, mean cold start) as they are after."""
    out: dict[str, float] = {
        k: float(after[k]) - float(before.get(k, 0.0)) for k in ADDITIVE_REWARD_STATS if k in after
    }
    for k in ("runtime_workers", "runtime_peak_workers", "runtime_cold_start_s_mean"):
        if k in after:
            out[k] = float(after[k])
    return out


def _reward_figures(deltas: list[dict[str, float]]) -> dict[str, float] | None:
    """A mode's reward executor over its segments: summed counters and the utilisations they give."""
    if not deltas:
        return None
    out: dict[str, float] = {}
    for d in deltas:
        for k in ADDITIVE_REWARD_STATS:
            if k in d:
                out[k] = out.get(k, 0.0) + d[k]
    for k in ("runtime_workers", "runtime_peak_workers", "runtime_cold_start_s_mean"):
        if k in deltas[-1]:
            out[k] = deltas[-1][k]
    if out.get("provisioned_s"):
        out["utilisation"] = out.get("busy_s", 0.0) / out["provisioned_s"]
    if out.get("runtime_provisioned_s"):
        out["runtime_utilisation"] = out.get("runtime_busy_s", 0.0) / out["runtime_provisioned_s"]
    if out.get("runtime_billed_s"):
        out["runtime_utilisation_billed"] = out.get("runtime_busy_s", 0.0) / out["runtime_billed_s"]
    return out


def _measured(seg: dict[str, Any], steady: bool) -> dict[str, Any]:
    return seg["steady"] if steady else seg


def _rate(seg: dict[str, Any]) -> float:
    return seg["trained"] / seg["wall_s"]


def aggregate(
    segments: dict[str, list[dict[str, Any]]], bounds: dict[str, dict[str, Any]], baseline: str = "sync"
) -> dict[str, dict[str, Any]]:
    """Per mode: throughput over all its segments, ratios to the base modes (``vs_sync``, ...),
    achieved over the compute bound and over min(compute, window bound) (``bounds[mode]["window"]``:
    ``{depth, mix, group_size}`` for async modes), wall-weighted utilisation per stage, fates, the
    reward executor's figures; and per round (``rounds``), every ratio's spread. Where every segment
    has a steady state, throughput and utilisation are taken over it (after each segment's warm-up
    steps: its pipeline depth); otherwise over whole segments."""
    out: dict[str, dict[str, Any]] = {}
    steady = all("steady" in s for segs in segments.values() for s in segs)
    for mode, all_segs in segments.items():
        fates: Counter[str] = Counter()
        for s in all_segs:
            fates.update(s["fates"])
        segs = [_measured(s, steady) for s in all_segs]
        wall = sum(s["wall_s"] for s in segs)
        traj_per_s = sum(s["trained"] for s in segs) / wall
        trained_tok, wasted_tok = (
            sum(s[k] for s in all_segs) for k in ("trained_gen_tokens", "wasted_gen_tokens")
        )
        episodes = merge_sums(s["episodes"] for s in segs)
        step_s = [x for s in segs for x in s["step_s"]]
        bound = bounds[mode]
        lifetime = means(merge_sums(s.get("groups", {}) for s in segs))
        per_group = trained_per_group(segs)
        window = _window(bound, lifetime, per_group)
        min_bound = min(bound["bound"], window) if window is not None else bound["bound"]
        out[mode] = {
            "basis": "steady" if steady else "segment",
            "segments": len(segs),
            "wall_s": wall,
            "steps": sum(s["steps"] for s in all_segs),
            "trained": sum(s["trained"] for s in segs),
            "traj_per_s": traj_per_s,
            "tok_per_s": sum(s["gen_tokens"] for s in segs) / wall,
            "traj_per_s_segment": sum(s["trained"] for s in all_segs) / sum(s["wall_s"] for s in all_segs),
            "launched": sum(s["launched"] for s in all_segs),
            "fates": dict(fates),
            "trained_by_task": dict(sum((Counter(s["trained_by_task"]) for s in all_segs), Counter())),
            "step_s_mean": sum(sum(s["step_s"]) for s in all_segs)
            / max(1, sum(s["steps"] for s in all_segs)),
            "measured_step_s_mean": sum(step_s) / max(1, len(step_s)),
            "gen_waste": wasted_tok / (wasted_tok + trained_tok) if wasted_tok + trained_tok else None,
            "episode_s": {task: total / n for task, (total, n) in episodes.items() if n},
            "group_lifetime_s": lifetime,
            "trained_per_group": per_group,
            "group_rollout_s": means(merge_sums(s.get("groups_rollout", {}) for s in segs)),
            "lag_max": max(s["lag_max"] for s in all_segs),
            "utilisation": {
                st: sum(s["stages"][st]["utilisation"] * s["wall_s"] for s in segs) / wall for st in STAGES
            },
            "mean_concurrency": {
                st: sum(s["stages"][st]["mean_concurrency"] * s["wall_s"] for s in segs) / wall
                for st in STAGES
            },
            "cpu_busy": (
                sum(s["cpu_busy"] * s["wall_s"] for s in segs) / wall
                if all(s.get("cpu_busy") is not None for s in segs)
                else None
            ),
            "bound_traj_per_s": bound["bound"],
            "bottleneck": bound["bottleneck"],
            "achieved_over_bound": traj_per_s / bound["bound"],
            "window_bound_traj_per_s": window,
            "min_bound_traj_per_s": min_bound,
            "min_bound_by": "window" if window is not None and window < bound["bound"] else "compute",
            "achieved_over_min_bound": traj_per_s / min_bound,
            "reward": _reward_figures([s["reward"] for s in all_segs if "reward" in s]),
        }
        out[mode]["rounds"] = _own_rounds(all_segs, steady, bound)
    for base, key in RATIO_BASES.items():
        if base not in out:
            continue
        for mode, r in out.items():
            r[key] = r["traj_per_s"] / out[base]["traj_per_s"]
            r["rounds"][key] = _ratio_rounds(segments[mode], segments[base], steady, _rate)
            if base == baseline:
                r["tok_vs_sync"] = r["tok_per_s"] / out[base]["tok_per_s"] if out[base]["tok_per_s"] else None
                r["rounds"]["tok_vs_sync"] = _ratio_rounds(
                    segments[mode], segments[base], steady, lambda s: s["gen_tokens"] / s["wall_s"]
                )
                r["rounds"]["segment_vs_sync"] = _ratio_rounds(segments[mode], segments[base], False, _rate)
    return out


def _window(bound: Mapping[str, Any], lifetime: Mapping[str, float], per_group: float | None) -> float | None:
    w = bound.get("window")
    return None if not w else window_bound(w["depth"], w["mix"], w["group_size"], lifetime, per_group)


def _by_round(segs: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {s.get("round", i): s for i, s in enumerate(segs)}


def _own_rounds(segs: list[dict[str, Any]], steady: bool, bound: Mapping[str, Any]) -> dict[str, Any]:
    """Per round: throughput, achieved over the compute bound and over min(compute, window)."""
    rates, of_bound, of_min = [], [], []
    for s in _by_round(segs).values():
        m = _measured(s, steady)
        rate = _rate(m)
        window = _window(bound, means(m.get("groups", {})), trained_per_group([m]))
        rates.append(rate)
        of_bound.append(rate / bound["bound"])
        of_min.append(rate / (min(bound["bound"], window) if window is not None else bound["bound"]))
    return {"traj_per_s": spread(rates), "of_bound": spread(of_bound), "of_min_bound": spread(of_min)}


def _ratio_rounds(
    segs: list[dict[str, Any]], base: list[dict[str, Any]], steady: bool, rate: Any
) -> dict[str, Any] | None:
    """``rate(mode) / rate(base)`` in every round both ran."""
    mine, theirs = _by_round(segs), _by_round(base)
    return spread(
        rate(_measured(mine[r], steady)) / rate(_measured(theirs[r], steady))
        for r in sorted(mine)
        if r in theirs and rate(_measured(theirs[r], steady))
    )


def goals(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The issues' goals, for each async mode that ran, each with its spread over rounds: the speed-up
    over Sync+ / One-off / admission-only, and ``of_bound``: achieved over min(compute bound, window
    bound) (``of_compute_bound``: over the compute bound alone). A mode with env replicas (``_r3``) is
    also compared with Sync+ given the same replicas (``vs_sync_r3``, like for like)."""
    out: dict[str, Any] = {}
    for a in [
        m
        for m in ("async_a1", "async_a2", "async_a4", "async_a1_r3", "async_a2_r3", "async_a4_r3")
        if m in results
    ]:
        r = results[a]
        g: dict[str, Any] = {}
        bases = [("sync_r3", 4.6)] if a.endswith("_r3") else []
        for base, target in (*bases, ("sync", 4.6), ("one_off", 1.35), ("admission", 1.31)):
            if base in results:
                ratio = r["traj_per_s"] / results[base]["traj_per_s"]
                rounds = r["rounds"].get(f"vs_{base}")
                g[f"vs_{base}"] = {"ratio": ratio, "goal": target, "met": ratio >= target, "rounds": rounds}
        g["of_bound"] = {
            "ratio": r["achieved_over_min_bound"],
            "goal": 0.9,
            "met": r["achieved_over_min_bound"] >= 0.9,
            "rounds": r["rounds"]["of_min_bound"],
        }
        g["of_compute_bound"] = {
            "ratio": r["achieved_over_bound"],
            "goal": 0.9,
            "met": r["achieved_over_bound"] >= 0.9,
            "rounds": r["rounds"]["of_bound"],
        }
        out[a] = g
    return out
