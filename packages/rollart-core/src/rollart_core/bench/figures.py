"""The bench's arithmetic: throughput, bounds, ratios and their spread over rounds, from the records
of the segments (pure functions, unit-tested on hand-made segments).

Three limits, none measured from the time the trainer takes to take a group:

- **compute bound** (``bound_traj_per_s``): the standalone capacity of each stage, the slowest alone
  (generation and training counted as one stage, since they share the cores:
  :func:`rollart_core.timeline.bottleneck_bound`); a stage its probe could not measure bounds nothing
  and is named in ``unmeasured``;
- **CPU-charged bound** (``cpu_bound_traj_per_s``): every stage's CPU seconds per trained trajectory
  in the mode's own segments (engines, trainer, environments, reward, the driver, Ray's processes:
  :mod:`.cpu`), charged to the cores they share: ``cores / CPU-seconds per trained trajectory``.
  Achieved / it is the share of the machine's core-seconds the run used; the breakdown says where
  every core-second went (each stage, other processes, idle);
- **window bound** (async modes): admission keeps at most ``depth`` steps of groups launched and not
  yet taken, and a group of task t holds its place at least for its *natural* lifetime W_t, launch
  until its last member's fate. By Little's law the steps per second s satisfy
  ``s · Σ_t gps_t · W_t <= depth · Σ_t gps_t``, times the trajectories a group can train
  (:func:`window_bound`). ``window_bound_traj_per_s`` takes W_t and that yield from groups launched
  alone on the idle pipeline (the limit the achieved figure is held against);
  ``window_bound_load_traj_per_s`` from the segment's own groups under load (launch → last fate, and
  the trajectories trained per group taken): achieved / it is how full admission kept the window
  times the share of a group's stay spent in rollout rather than waiting to be taken. The time until
  taken (``group_lifetime_s``) makes a bound that moves with the trainer's speed, kept in the JSON
  for comparison only (``window_bound_taken_traj_per_s``);
- ``min_bound_traj_per_s`` is the tightest of the compute, CPU-charged and (idle) window bounds;
- every ratio is also taken per round (each round runs every mode once, back to back) and given as
  median [min–max] over rounds (:func:`spread`).

A segment that failed (``{"round", "failed": reason}``) counts in no figure; a mode without one
that ran has no results (the harness reports why).
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from rollart_core.bench.cpu import cpu_figures
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


def natural_lifetimes(segs: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """Per task: the groups' mean life under load from launch to their last member's fate
    (``groups_rollout``), less the mean time a group launched ahead of the served version waited
    for it (``groups_wait``: the trainer's time, which would make the bound move with its speed)."""
    segs = list(segs)
    rollout = means(merge_sums(s.get("groups_rollout", {}) for s in segs))
    wait = means(merge_sums(s.get("groups_wait", {}) for s in segs))
    return {t: max(0.0, v - wait.get(t, 0.0)) for t, v in rollout.items()}


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
    trained_per_group: float | Mapping[str, float] | None = None,
) -> float | None:
    """Trained trajectories/s at most, with ``depth`` steps of groups in flight (``mix``: groups of
    each task per batch) holding their place ``lifetime_s`` each (per task): Little's law, times the
    trajectories each group trains (``trained_per_group``: one figure, or one per task; None: the
    nominal group sizes of the mix). None when a task of the mix has no lifetime (or yield)."""
    if any(t not in lifetime_s for t in mix):
        return None
    group_seconds_per_batch = sum(n * lifetime_s[t] for t, n in mix.items())
    if group_seconds_per_batch <= 0:
        return None
    batches_per_s = depth * sum(mix.values()) / group_seconds_per_batch
    if trained_per_group is None:
        return batches_per_s * sum(n * group_size[t] for t, n in mix.items())
    if isinstance(trained_per_group, Mapping):
        if any(t not in trained_per_group for t in mix):
            return None
        return batches_per_s * sum(n * trained_per_group[t] for t, n in mix.items())
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


def ran(segs: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The segments that ran to the end (not ``failed``)."""
    return [s for s in segs if "failed" not in s]


def _sum_cpu(segs: list[dict[str, Any]]) -> dict[str, float] | None:
    """The segments' CPU seconds per stage, summed; None where one has none."""
    if not segs or any(not s.get("cpu") for s in segs):
        return None
    out: dict[str, float] = {}
    for s in segs:
        for k, v in s["cpu"].items():
            out[k] = out.get(k, 0.0) + v
    return out


def _in_driver(segs: list[dict[str, Any]], per_call: Mapping[str, float | None]) -> dict[str, float]:
    """CPU seconds of the driver's time that were the environments' and the in-process reward's:
    the calls in the segments' windows times the CPU per call measured by the capacity probes."""
    out = {}
    for stage in ("env", "reward"):
        cost = per_call.get(stage)
        if cost:
            out[stage] = cost * sum(s.get("calls", {}).get(stage, 0) for s in segs)
    return out


def bound_figures(segs: list[dict[str, Any]], bound: Mapping[str, Any]) -> dict[str, Any]:
    """Every bound of a set of measured windows (a mode's, or one round's) with achieved over each:
    compute, CPU-charged, window (idle lifetimes; under load; until taken), and the tightest of
    compute, CPU-charged and idle window."""
    trained = sum(s["trained"] for s in segs)
    rate = trained / sum(s["wall_s"] for s in segs)
    cpu_s = _sum_cpu(segs)
    cpu = (
        None
        if cpu_s is None
        else cpu_figures(cpu_s, trained, bound.get("cores", 1), _in_driver(segs, bound.get("in_driver", {})))
    )
    spec, idle = bound.get("window"), bound.get("idle")
    per_group = trained_per_group(segs)
    window = window_load = window_taken = None
    if spec:
        args = (spec["depth"], spec["mix"], spec["group_size"])
        if idle:
            window = window_bound(*args, idle["lifetime_s"], idle.get("trained_per_group"))
        window_load = window_bound(*args, natural_lifetimes(segs), per_group)
        window_taken = window_bound(*args, means(merge_sums(s.get("groups", {}) for s in segs)), per_group)
    limits = {
        "compute": bound.get("bound"),
        "cpu": None if cpu is None else cpu["bound"],
        "window": window,
    }
    known = {k: v for k, v in limits.items() if v}
    by = min(known, key=lambda k: known[k]) if known else None

    def over(x: float | None) -> float | None:
        return rate / x if x else None

    return {
        "traj_per_s": rate,
        "cpu": cpu,
        "cpu_bound_traj_per_s": limits["cpu"],
        "window_bound_traj_per_s": window,
        "window_bound_load_traj_per_s": window_load,
        "window_bound_taken_traj_per_s": window_taken,
        "trained_per_group": per_group,
        "min_bound_traj_per_s": known.get(by) if by else None,
        "min_bound_by": by,
        "achieved_over_bound": over(limits["compute"]),
        "achieved_over_cpu_bound": over(limits["cpu"]),
        "achieved_over_window": over(window),
        "achieved_over_window_load": over(window_load),
        "achieved_over_min_bound": over(known.get(by) if by else None),
    }


def aggregate(
    segments: dict[str, list[dict[str, Any]]], bounds: dict[str, dict[str, Any]], baseline: str = "sync"
) -> dict[str, dict[str, Any]]:
    """Per mode that ran a segment to its end: throughput over all its segments, ratios to the base
    modes (``vs_sync``, ...), every bound and achieved over each (:func:`bound_figures`;
    ``bounds[mode]``: the compute bound, ``window``: ``{depth, mix, group_size}`` for async modes,
    ``idle``: the tasks' lifetimes and yields alone, ``in_driver``: CPU per env / reward call in the
    driver, ``cores``), wall-weighted utilisation per stage, fates, the reward executor's figures;
    and per round (``rounds``), every ratio's spread. Where every segment has a steady state,
    throughput and utilisation are taken over it (after each segment's warm-up steps: its pipeline
    depth); otherwise over whole segments."""
    out: dict[str, dict[str, Any]] = {}
    segments = {m: ran(v) for m, v in segments.items()}
    segments = {m: v for m, v in segments.items() if v}
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
        out[mode] = {
            "basis": "steady" if steady else "segment",
            "segments": len(segs),
            "wall_s": wall,
            "steps": sum(s["steps"] for s in all_segs),
            "trained": sum(s["trained"] for s in segs),
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
            "group_lifetime_s": means(merge_sums(s.get("groups", {}) for s in segs)),
            "group_rollout_s": means(merge_sums(s.get("groups_rollout", {}) for s in segs)),
            "group_natural_s": natural_lifetimes(segs),
            "group_version_wait_s": means(merge_sums(s.get("groups_wait", {}) for s in segs)),
            "group_idle_s": (bound.get("idle") or {}).get("lifetime_s"),
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
            "bound_traj_per_s": bound.get("bound"),
            "bottleneck": bound.get("bottleneck"),
            "unmeasured": bound.get("unmeasured", []),
            **bound_figures(segs, bound),
            "reward": _reward_figures([s["reward"] for s in all_segs if "reward" in s]),
        }
        out[mode]["traj_per_s"] = traj_per_s
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


def _by_round(segs: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {s.get("round", i): s for i, s in enumerate(segs)}


ROUND_RATIOS = {
    "of_bound": "achieved_over_bound",
    "of_cpu_bound": "achieved_over_cpu_bound",
    "of_window": "achieved_over_window",
    "of_window_load": "achieved_over_window_load",
    "of_min_bound": "achieved_over_min_bound",
}
"""Per-round spreads of achieved over each bound: the key in ``rounds`` and the figure it spreads."""


def _own_rounds(segs: list[dict[str, Any]], steady: bool, bound: Mapping[str, Any]) -> dict[str, Any]:
    """Per round: throughput, and achieved over every bound."""
    per = [bound_figures([_measured(s, steady)], bound) for s in _by_round(segs).values()]
    out = {"traj_per_s": spread(f["traj_per_s"] for f in per)}
    for key, figure in ROUND_RATIOS.items():
        out[key] = spread(f[figure] for f in per)
    return out


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


def _goal(ratio: float | None, rounds: dict[str, Any] | None, target: float) -> dict[str, Any] | None:
    return (
        None if ratio is None else {"ratio": ratio, "goal": target, "met": ratio >= target, "rounds": rounds}
    )


def goals(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The issues' goals, for each async mode that ran, each with its spread over rounds: the speed-up
    over Sync+ / One-off / admission-only, and ``of_bound``: achieved over the tightest of the compute,
    CPU-charged and (idle) window bounds (``of_compute_bound``, ``of_cpu_bound``, ``of_window``: over
    each alone; a bound that could not be measured gives no goal). A mode with env replicas (``_r3``)
    is also compared with Sync+ given the same replicas (``vs_sync_r3``, like for like)."""
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
        for key, ratio, rounds in (
            ("of_bound", "achieved_over_min_bound", "of_min_bound"),
            ("of_compute_bound", "achieved_over_bound", "of_bound"),
            ("of_cpu_bound", "achieved_over_cpu_bound", "of_cpu_bound"),
            ("of_window", "achieved_over_window", "of_window"),
        ):
            goal = _goal(r.get(ratio), r["rounds"].get(rounds), 0.9)
            if goal is not None:
                g[key] = goal
        out[a] = g
    return out
