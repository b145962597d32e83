"""``rollart bench`` output: the printed table, ``summary.md``, ``bench.json``, ``timeline.png``, ``report.html``."""

from __future__ import annotations

import html
import json
import logging
from pathlib import Path
from typing import Any

from rollart_core.bench.workload import MODES
from rollart_core.timeline import STAGES

__all__ = ["print_table", "write_reports"]

log = logging.getLogger(__name__)
_SHORT = {"generate": "gen", "env": "env", "reward": "rew", "train": "train", "weight_sync": "wsync"}
_COLOURS = {
    "generate": "#1f77b4",
    "env": "#2ca02c",
    "reward": "#ff7f0e",
    "train": "#d62728",
    "weight_sync": "#9467bd",
}


def _fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def fmt_spread(sp: dict[str, Any] | None, pct: bool = False) -> str:
    """``median [min–max]`` of a per-round spread (just the value with one round)."""
    if sp is None:
        return "-"
    one = (lambda x: f"{x:.0%}") if pct else (lambda x: f"{x:.2f}x")
    if sp["min"] == sp["max"]:
        return one(sp["median"])
    lo, hi = (
        (f"{sp['min'] * 100:.0f}", f"{sp['max']:.0%}") if pct else (f"{sp['min']:.2f}", f"{sp['max']:.2f}")
    )
    return f"{one(sp['median'])} [{lo}–{hi}]"


def _num(x: float | None, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


_BREAK_SHORT = {
    "generate": "gen",
    "train": "train",
    "env": "env",
    "reward": "rew",
    "driver": "drv",
    "ray": "ray",
    "other": "other",
    "idle": "idle",
}


def breakdown_cell(cpu: dict[str, Any] | None) -> str:
    """The machine's core-seconds by where they went (``-``: not measured)."""
    if not cpu:
        return "-"
    return " ".join(f"{_BREAK_SHORT[k]} {v:.0%}" for k, v in cpu["share"].items())


def table_rows(res: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    results = res["results"]
    bases = [b for b in ("one_off", "admission") if b in results]
    head = [
        "mode",
        "traj/s",
        "vs Sync+",
        *[f"vs {MODES[b].label or b}" for b in bases],
        "whole-segment traj/s",
        "gen tok/s",
        "tok vs Sync+",
        "compute bound traj/s",
        "of compute",
        "CPU-charged bound traj/s",
        "of CPU",
        "window bound (idle) traj/s",
        "of window",
        "window bound (load) traj/s",
        "of window (load)",
        "of tightest",
        "cores went to",
        "cpu busy",
        *[f"util {_SHORT[s]}" for s in STAGES],
        "step s",
        "episode s",
        "group life s idle/load/taken",
        "gen waste",
        "reward runtime",
        "launched",
        "fates",
    ]
    rows = []
    for m, r in results.items():
        rounds = r["rounds"]
        fates = " ".join(f"{k}={v}" for k, v in sorted(r["fates"].items()))
        idle = r.get("group_idle_s") or {}
        rollout, taken = r.get("group_natural_s", {}), r.get("group_lifetime_s", {})
        lives = " ".join(
            f"{k} {_num(idle.get(k), '.1f')}/{_num(rollout.get(k), '.1f')}/{_num(taken.get(k), '.1f')}"
            for k in sorted(set(idle) | set(rollout) | set(taken))
        )
        compute = r.get("bound_traj_per_s")
        rows.append(
            [
                MODES[m].label or m,
                f"{r['traj_per_s']:.2f}",
                fmt_spread(rounds.get("vs_sync")),
                *[fmt_spread(rounds.get(f"vs_{b}")) for b in bases],
                f"{r['traj_per_s_segment']:.2f} ({fmt_spread(rounds.get('segment_vs_sync'))})",
                f"{r['tok_per_s']:.0f}",
                fmt_spread(rounds.get("tok_vs_sync")),
                "unmeasured" if compute is None else f"{compute:.2f} ({r['bottleneck']})",
                fmt_spread(rounds.get("of_bound"), pct=True),
                _num(r.get("cpu_bound_traj_per_s")),
                fmt_spread(rounds.get("of_cpu_bound"), pct=True),
                _num(r.get("window_bound_traj_per_s")),
                fmt_spread(rounds.get("of_window"), pct=True),
                _num(r.get("window_bound_load_traj_per_s")),
                fmt_spread(rounds.get("of_window_load"), pct=True),
                f"{fmt_spread(rounds.get('of_min_bound'), pct=True)} ({r.get('min_bound_by') or '-'})",
                breakdown_cell(r.get("cpu")),
                "-" if r.get("cpu_busy") is None else f"{r['cpu_busy']:.0%}",
                *[f"{r['utilisation'][s]:.0%}" for s in STAGES],
                f"{r['measured_step_s_mean']:.2f}",
                " ".join(f"{k} {v:.1f}" for k, v in sorted(r["episode_s"].items())),
                lives or "-",
                "-" if r["gen_waste"] is None else f"{r['gen_waste']:.0%}",
                _runtime_cell(r.get("reward")),
                str(r["launched"]),
                fates,
            ]
        )
    return head, rows


def _runtime_cell(rw: dict[str, Any] | None) -> str:
    """The function runtime's own utilisation and cold starts (``-``: the mode used none)."""
    if not rw or "runtime_provisioned_s" not in rw:
        return "-"
    return f"{rw.get('runtime_utilisation', 0.0):.0%} busy, {rw.get('runtime_cold_starts', 0):.0f} cold"


def _cap_figure(c: dict[str, Any] | None, text: str) -> str:
    if not c:
        return "not probed"
    if c.get("traj_per_s") is None:
        return f"unmeasured: {c.get('unmeasured', '?')}"
    return text.format(**c) + (
        f" (after a longer probe: nothing finished in {c['retried_after_s']:.1f} s)"
        if "retried_after_s" in c
        else ""
    )


def _capacity_lines(res: dict[str, Any]) -> list[str]:
    c = res["capacity"]
    lines = [
        "generation alone: "
        + _cap_figure(
            c.get("generate"),
            "{traj_per_s:.2f} traj/s ({gen_tok_per_s:.0f} generated + {prompt_tok_per_s:.0f} prompt tok/s)",
        ),
        "trainer alone: " + _cap_figure(c.get("train"), "{traj_per_s:.2f} traj/s ({tok_per_s:.0f} tok/s)"),
        f"env alone ({(c.get('env') or {}).get('concurrency', '?')} at once): "
        + _cap_figure(c.get("env"), "{traj_per_s:.2f} episodes/s ({calls_per_s:.1f} calls/s)"),
    ]
    for k, v in c.items():
        if k.startswith("reward_"):
            lines.append(
                f"reward {k[7:]} alone ({v.get('concurrency', '?')} at once): "
                + _cap_figure(v, "{calls_per_s:.1f} calls/s")
            )
    lines.append(
        "compute bound = min over stages; generation and training share this machine's cores, so they count "
        "as one stage of capacity 1/(1/gen + 1/train); an unmeasured stage bounds nothing (named per mode)"
    )
    for mode, idle in (res.get("idle_lifetimes") or {}).items():
        if idle.get("first_mode") != mode:
            continue
        if "lifetime_s" not in idle:
            lines.append(
                f"natural group lifetimes alone ({MODES[mode].label} and alike): {idle.get('unmeasured')}"
            )
            continue
        lives = ", ".join(
            f"{k} {v:.1f} s (trains {idle['trained_per_group'].get(k, 0):.1f})"
            for k, v in sorted(idle["lifetime_s"].items())
        )
        lines.append(
            f"natural group lifetimes alone, launch to last member's fate ({MODES[mode].label} and modes "
            f"set alike; {idle['groups']} groups per task, each alone): {lives}"
        )
    return lines


def bound_lines(res: dict[str, Any]) -> list[str]:
    """Per mode: achieved over each bound, which one it is held against, and where the machine's
    core-seconds went; then every mode that has no figure in a round, and why."""
    out = []
    for m, r in res["results"].items():
        parts = [f"{MODES[m].label or m}: {r['traj_per_s']:.2f} traj/s"]
        if r.get("bound_traj_per_s") is not None:
            parts.append(
                f"{r['achieved_over_bound']:.0%} of the compute bound {r['bound_traj_per_s']:.2f} ({r['bottleneck']})"
            )
        why = (res.get("bounds", {}).get(m) or {}).get("unmeasured_why") or {}
        if why:
            parts.append("the compute bound leaves out " + "; ".join(f"{k} ({v})" for k, v in why.items()))
        cpu = r.get("cpu")
        if cpu and cpu.get("bound"):
            per = ", ".join(f"{_BREAK_SHORT[k]} {v:.3f}" for k, v in cpu["cpu_s_per_traj_by_stage"].items())
            parts.append(
                f"{r['achieved_over_cpu_bound']:.0%} of the CPU-charged bound {cpu['bound']:.2f} "
                f"({cpu['cores']} cores / {cpu['cpu_s_per_traj']:.3f} CPU-s per trained trajectory: {per})"
            )
        if r.get("window_bound_traj_per_s") is not None:
            parts.append(
                f"{r['achieved_over_window']:.0%} of the window bound {r['window_bound_traj_per_s']:.2f} "
                "(idle lifetimes)"
            )
        if r.get("window_bound_load_traj_per_s") is not None:
            parts.append(
                f"{r['achieved_over_window_load']:.0%} of the window bound under load "
                f"{r['window_bound_load_traj_per_s']:.2f} (the segment's own launch-to-last-fate lifetimes, "
                f"{r.get('trained_per_group') or 0:.2f} trained per group taken)"
            )
        if r.get("min_bound_by"):
            parts.append(
                f"held against the tightest, {r['min_bound_by']}: {r['achieved_over_min_bound']:.0%}"
            )
        line = "; ".join(parts)
        if cpu:
            line += ". Core-seconds: " + ", ".join(
                f"{_BREAK_SHORT[k]} {v:.0%}" for k, v in cpu["share"].items()
            )
        out.append(line)
    for m, rounds in (res.get("missing") or {}).items():
        for r, why in rounds.items():
            out.append(f"{MODES[m].label or m}, round {r}: no figure: {why}")
    if res.get("figures_error"):
        out.append(f"the figures could not be computed: {res['figures_error']} (segments kept in bench.json)")
    return out


def _goal_lines(res: dict[str, Any]) -> list[str]:
    out = []
    for a, g in res["goals"].items():
        parts = [
            f"{k}: {v['ratio']:.2f}{_rounds_note(v.get('rounds'))} (goal {v['goal']}, "
            f"{'met' if v['met'] else 'NOT met'})"
            for k, v in g.items()
        ]
        out.append(f"{MODES[a].label}: " + "; ".join(parts))
    return out


def _rounds_note(sp: dict[str, Any] | None) -> str:
    if sp is None or len(sp["rounds"]) < 2:
        return ""
    return f" [rounds {sp['min']:.2f}–{sp['max']:.2f}, median {sp['median']:.2f}]"


def reward_lines(res: dict[str, Any]) -> list[str]:
    """Each mode's reward executor: a function runtime's own utilisation and cold starts, a fixed
    pool's utilisation; and elastic-through-the-runtime against the in-process stand-in, where a
    mode that differs from another only in that ran."""
    out = []
    for m, r in res["results"].items():
        rw = r.get("reward") or {}
        kind = MODES[m].reward
        if "runtime_provisioned_s" in rw:
            billed = rw.get("runtime_utilisation_billed")
            out.append(
                f"{MODES[m].label}: reward through the function runtime: {rw.get('runtime_calls', 0):.0f} calls, "
                f"utilisation {rw.get('runtime_utilisation', 0.0):.0%} of its workers' provisioned time "
                f"({rw.get('runtime_busy_s', 0.0):.1f} of {rw['runtime_provisioned_s']:.1f} s"
                f"{'' if billed is None else f'; {billed:.0%} of billed time'}), "
                f"{rw.get('runtime_cold_starts', 0):.0f} cold starts "
                f"(mean {rw.get('runtime_cold_start_s_mean', 0.0):.2f} s), "
                f"{rw.get('runtime_workers', 0):.0f} workers at the end"
            )
        elif kind == "colocated" and rw.get("provisioned_s"):
            out.append(
                f"{MODES[m].label}: colocated reward pool utilisation {rw.get('utilisation', 0.0):.0%} "
                f"({rw.get('busy_s', 0.0):.1f} of {rw['provisioned_s']:.1f} slot-seconds)"
            )
    for m in res["results"]:
        twin = _elastic_twin(m, res["results"])
        if twin is None:
            continue
        a, b = res["results"][twin], res["results"][m]
        ratio = a["traj_per_s"] / b["traj_per_s"]
        out.append(
            f"elastic reward through the runtime vs the in-process stand-in ({MODES[twin].label} vs "
            f"{MODES[m].label}): {a['traj_per_s']:.2f} vs {b['traj_per_s']:.2f} traj/s = {ratio:.2f}x"
            f"{_rounds_note(_pair_spread(res, twin, m))}"
        )
    return out


def _elastic_twin(mode: str, results: dict[str, Any]) -> str | None:
    """The mode that ran the same spec as ``mode`` (an ``inline_standin`` one) but with ``elastic``."""
    spec = MODES[mode]
    if spec.reward != "inline_standin":
        return None
    want = spec.model_dump(exclude={"reward", "label"})
    return next(
        (
            m
            for m in results
            if MODES[m].reward == "elastic" and MODES[m].model_dump(exclude={"reward", "label"}) == want
        ),
        None,
    )


def _pair_spread(res: dict[str, Any], a: str, b: str) -> dict[str, Any] | None:
    from rollart_core.bench.figures import spread

    def rate(seg: dict[str, Any]) -> float:
        s = seg.get("steady", seg)
        return s["trained"] / s["wall_s"]

    mine = {s.get("round", i): s for i, s in enumerate(res["segments"][a])}
    theirs = {s.get("round", i): s for i, s in enumerate(res["segments"][b])}
    return spread(rate(mine[r]) / rate(theirs[r]) for r in mine if r in theirs)


def window_lines(res: dict[str, Any]) -> list[str]:
    """For every mode with a staleness bound: how long a trajectory has to finish against how long
    episodes take, the share of launches dropped as stale, and the generation spent on work not trained."""
    out = []
    for m, r in res["results"].items():
        cfg = res["mode_configs"][m]
        if cfg["mode"] != "async":
            continue
        window = (cfg["alpha"] + 1) * r["measured_step_s_mean"]
        eps = ", ".join(f"{k} {v:.1f} s" for k, v in sorted(r["episode_s"].items()))
        stale = r["fates"].get("aborted_stale", 0) / max(1, r["launched"])
        waste = "-" if r["gen_waste"] is None else f"{r['gen_waste']:.0%}"
        line = (
            f"{MODES[m].label}: a trajectory must be trained within alpha+1 = {cfg['alpha'] + 1} steps of its "
            f"start, {window:.1f} s at the measured step time; finished episodes took {eps} on average; "
            f"{stale:.0%} of launches aborted stale; {waste} of generated tokens went to trajectories cancelled, stale or failed"
        )
        spec = res["bounds"][m].get("window")
        if spec:
            idle = r.get("group_idle_s") or {}
            natural, taken = r.get("group_natural_s", {}), r.get("group_lifetime_s", {})
            lives = ", ".join(
                f"{k} {_num(idle.get(k), '.1f')} s alone, {_num(natural.get(k), '.1f')} s under load "
                f"(+{_num(taken[k] - natural[k] if k in taken and k in natural else None, '.1f')} s "
                "waiting for a version or to be taken)"
                for k in sorted(set(idle) | set(natural))
            )
            line += (
                f". Window bound (Little's law): at most {spec['depth']} steps x {sum(spec['mix'].values())} "
                f"groups in flight, groups living {lives} from launch until their last member's fate: "
                f"{_num(r.get('window_bound_traj_per_s'))} traj/s at the lifetimes alone (the limit), "
                f"{_num(r.get('window_bound_load_traj_per_s'))} under load"
            )
        out.append(line)
    return out


def _warmup(res: dict[str, Any]) -> str:
    return " after its warm-up steps" if res["size"].get("warmup") else ""


def print_table(res: dict[str, Any]) -> str:
    head, rows = table_rows(res)
    widths = [max(len(head[i]), *(len(r[i]) for r in rows)) for i in range(len(head))]
    lines = [
        f"rollart bench ({res['size_name']}): {res['size']['rounds']} rounds x {res['size']['steps']} measured steps per "
        f"mode{_warmup(res)}, modes interleaved; machine: {res['machine']['cpus_usable']} CPUs, load "
        f"{res['machine']['loadavg_start'][0]:.1f} -> {res['machine']['loadavg_end'][0]:.1f}",
        *_capacity_lines(res),
        "",
        "  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)),
    ]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines += [
        "",
        *bound_lines(res),
        "",
        *window_lines(res),
        "",
        *reward_lines(res),
        "",
        *_goal_lines(res),
        f"total {res['wall_s']:.0f}s"
        + (
            ""
            if res.get("rounds_done", res["size"]["rounds"]) >= res["size"]["rounds"]
            else f" (after round {res['rounds_done']} of {res['size']['rounds']})"
        ),
    ]
    return "\n".join(lines)


def markdown(res: dict[str, Any]) -> str:
    head, rows = table_rows(res)
    md = [
        f"# rollart bench ({res['size_name']})",
        "",
        f"{res['size']['rounds']} rounds x {res['size']['steps']} measured steps per mode{_warmup(res)}, modes interleaved. Machine: "
        f"{res['machine']['cpus_usable']} CPUs, {res['machine']['memory_gib']} GiB, load average "
        f"{res['machine']['loadavg_start'][0]:.1f} at start, {res['machine']['loadavg_end'][0]:.1f} at end.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    md += ["| " + " | ".join(r) + " |" for r in rows]
    md += [
        "",
        "Standalone capacity:",
        "",
        *[f"- {x}" for x in _capacity_lines(res)],
        "",
        "Bounds, and where the cores went:",
        "",
        *[f"- {x}" for x in bound_lines(res)],
        "",
        "Staleness window (async):",
        "",
        *[f"- {x}" for x in window_lines(res)],
        "",
        "Reward executors:",
        "",
        *[f"- {x}" for x in reward_lines(res)],
        "",
        "Goals:",
        "",
        *[f"- {x}" for x in _goal_lines(res)],
        "",
        "traj/s: trained trajectories per second of wall time, in the steady state (after each segment's "
        "warm-up steps, as many as the mode's pipeline is deep: 1 for One-off, max_pending_steps for async, and 1 "
        "for Sync+ too, so that it measures One-off's groups; before that, a pipeline launched all at once drains a "
        "burst of groups and runs fast); the modes of a round launch the same episode seeds and draw the same env "
        "latencies and crashes (common random numbers); "
        "whole-segment traj/s counts the fill-up too (which penalises deep pipelines); cpu busy: fraction of all "
        "the machine's cores busy (anything running), the room left under a compute bound; util: fraction of the time at least one call "
        "of the stage was running; fates count every launched trajectory once (cancelled_at_stop: still in "
        "flight when a segment ended); step s: mean measured step; episode s: mean wall time, launch to "
        "finish, of the episodes that finished, per task; gen waste: share of the generated tokens (whole segments) "
        "that went to trajectories cancelled as redundant, aborted or dropped stale, failed or timed out, "
        "against those trained (what was still in the pipeline when a segment ended is neither). "
        "Ratios (vs Sync+, vs One-off, vs admission-only, achieved/bound, of min bound) are taken per round "
        "(every mode ran once per round) and given as median [min–max] over rounds; traj/s is over all rounds. "
        "compute bound: the slowest stage alone (generation + training as one, on shared cores); CPU-charged "
        "bound: cores / CPU-seconds per trained trajectory, every process of the run charged (engines, trainer, "
        "reward runtime, the driver, Ray's processes; env and in-process reward calls charged off the driver's "
        "time at the CPU per call their probes measured); achieved over it is the run's share of the machine's "
        "core-seconds, and 'cores went to' says where every core-second went (other: processes not of this run; "
        "idle: no process); window bound (async): admission keeps at most max_pending_steps steps of groups in "
        "flight, so by Little's law trained traj/s <= depth x groups per step x trajectories trained per group / "
        "(group-seconds per batch), with each group's life from launch to its last member's fate: alone on the "
        "idle pipeline (the limit), or the segment's own groups under load; group life s: alone / launch to last "
        "fate under load (less any wait for a version) / launch until the trainer took it (which moves with the trainer's speed, so it makes "
        "no limit); of tightest: achieved / min(compute, CPU-charged, window alone), and which one. reward runtime: the "
        "function runtime's own busy share of its workers' provisioned time, and its cold starts, in the mode's "
        "segments.",
        "",
    ]
    return "\n".join(md)


def plot_timeline(res: dict[str, Any], path: Path) -> bool:
    """One panel per mode (its last-round segment): busy spans of every stage over time."""
    try:
        import matplotlib
    except ImportError:
        log.warning("matplotlib is not installed: no timeline.png (pip install matplotlib)")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from rollart_core.timeline import merge

    segs: dict[str, dict[str, Any]] = {}
    for m, v in res["segments"].items():
        last = next((s for s in reversed(v) if "intervals" in s), None)
        if last is not None:
            segs[m] = last
    if not segs:
        return False
    span = max(s["wall_s"] for s in segs.values())
    fig, axes = plt.subplots(len(segs), 1, figsize=(12, 1.1 + 1.5 * len(segs)), squeeze=False)
    for ax, (m, s) in zip(axes[:, 0], segs.items(), strict=True):
        for row, st in enumerate(reversed(STAGES)):
            spans = merge([(a, b) for name, a, b in s["intervals"] if name == st])
            ax.broken_barh([(a, b - a) for a, b in spans], (row + 0.1, 0.8), color=_COLOURS[st])
        if "steady" in s:  # throughput is measured from here on (after the warm-up steps)
            ax.axvline(s["steady"]["window"][0], color="k", ls=":", lw=0.8)
        ax.set_yticks([i + 0.5 for i in range(len(STAGES))], [_SHORT[x] for x in reversed(STAGES)])
        ax.set_xlim(0, span)
        ax.set_ylim(0, len(STAGES))
        ax.set_title(
            f"{MODES[m].label or m}: {s['trained']} trained in {s['wall_s']:.1f}s "
            f"({s['trained'] / s['wall_s']:.2f} traj/s)",
            fontsize=9,
            loc="left",
        )
    axes[-1, 0].set_xlabel("seconds since the segment started (last round)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_reports(res: dict[str, Any], out_dir: Path, plot: bool = True) -> list[Path]:
    """``bench.json`` first (everything, whatever else fails), then the rest; ``plot``: draw the
    timeline (the reports written after each round leave it for the end)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "bench.json", out_dir / "summary.md"]
    tmp = out_dir / "bench.json.tmp"
    tmp.write_text(json.dumps(res, indent=1, default=str))
    tmp.replace(paths[0])  # a reader never sees half a file
    paths[1].write_text(markdown(res))
    png = out_dir / "timeline.png"
    has_png = plot and plot_timeline(res, png)
    if has_png:
        paths.append(png)
    head, rows = table_rows(res)
    table = (
        "<table><tr>"
        + "".join(f"<th>{html.escape(h)}</th>" for h in head)
        + "</tr>"
        + "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows)
        + "</table>"
    )
    page = [
        "<!doctype html><meta charset='utf-8'><title>rollart bench</title>",
        "<style>body{font-family:sans-serif;margin:2em}td,th{border:1px solid #ccc;padding:3px 6px;"
        "font-size:13px}table{border-collapse:collapse}</style>",
        f"<h1>rollart bench ({html.escape(res['size_name'])})</h1>",
        table,
        "<h2>Standalone capacity</h2><ul>",
        *[f"<li>{html.escape(x)}</li>" for x in _capacity_lines(res)],
        "</ul><h2>Bounds, and where the cores went</h2><ul>",
        *[f"<li>{html.escape(x)}</li>" for x in bound_lines(res)],
        "</ul><h2>Staleness window (async)</h2><ul>",
        *[f"<li>{html.escape(x)}</li>" for x in window_lines(res)],
        "</ul><h2>Reward executors</h2><ul>",
        *[f"<li>{html.escape(x)}</li>" for x in reward_lines(res)],
        "</ul><h2>Goals</h2><ul>",
        *[f"<li>{html.escape(x)}</li>" for x in _goal_lines(res)],
        "</ul>",
        "<h2>Timeline</h2>"
        + (
            "<img src='timeline.png' style='max-width:100%'>"
            if has_png
            else "<p>(matplotlib not installed)</p>"
        ),
        f"<h2>Machine</h2><pre>{html.escape(json.dumps(res['machine'], indent=1))}</pre>",
    ]
    paths.append(out_dir / "report.html")
    paths[-1].write_text("\n".join(page))
    return paths
