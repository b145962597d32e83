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
        "bound traj/s",
        "achieved/bound",
        "window bound traj/s",
        "of min bound",
        "cpu busy",
        *[f"util {_SHORT[s]}" for s in STAGES],
        "step s",
        "episode s",
        "group life s",
        "gen waste",
        "reward runtime",
        "launched",
        "fates",
    ]
    rows = []
    for m, r in results.items():
        rounds = r["rounds"]
        fates = " ".join(f"{k}={v}" for k, v in sorted(r["fates"].items()))
        window = r.get("window_bound_traj_per_s")
        rows.append(
            [
                MODES[m].label or m,
                f"{r['traj_per_s']:.2f}",
                fmt_spread(rounds.get("vs_sync")),
                *[fmt_spread(rounds.get(f"vs_{b}")) for b in bases],
                f"{r['traj_per_s_segment']:.2f} ({fmt_spread(rounds.get('segment_vs_sync'))})",
                f"{r['tok_per_s']:.0f}",
                fmt_spread(rounds.get("tok_vs_sync")),
                f"{r['bound_traj_per_s']:.2f} ({r['bottleneck']})",
                fmt_spread(rounds["of_bound"], pct=True),
                "-" if window is None else f"{window:.2f}",
                fmt_spread(rounds["of_min_bound"], pct=True),
                "-" if r.get("cpu_busy") is None else f"{r['cpu_busy']:.0%}",
                *[f"{r['utilisation'][s]:.0%}" for s in STAGES],
                f"{r['measured_step_s_mean']:.2f}",
                " ".join(f"{k} {v:.1f}" for k, v in sorted(r["episode_s"].items())),
                " ".join(f"{k} {v:.1f}" for k, v in sorted(r.get("group_lifetime_s", {}).items())) or "-",
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


def _capacity_lines(res: dict[str, Any]) -> list[str]:
    c = res["capacity"]
    lines = [
        f"generation alone: {c['generate']['traj_per_s']:.2f} traj/s ({c['generate']['gen_tok_per_s']:.0f} "
        f"generated + {c['generate']['prompt_tok_per_s']:.0f} prompt tok/s)",
        f"trainer alone: {c['train']['traj_per_s']:.2f} traj/s ({c['train']['tok_per_s']:.0f} tok/s)",
        f"env alone ({c['env']['concurrency']} at once): {c['env']['traj_per_s']:.2f} episodes/s "
        f"({c['env']['calls_per_s']:.1f} calls/s)",
    ]
    for k, v in c.items():
        if k.startswith("reward_"):
            lines.append(f"reward {k[7:]} alone ({v['concurrency']} at once): {v['calls_per_s']:.1f} calls/s")
    lines.append(
        "bound = min over stages; generation and training share this machine's cores, so they count "
        "as one stage of capacity 1/(1/gen + 1/train)"
    )
    return lines


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
        if spec and r.get("window_bound_traj_per_s") is not None:
            life = r["group_lifetime_s"]
            rollout = r.get("group_rollout_s", {})
            lives = ", ".join(
                f"{k} {v:.1f} s ({rollout.get(k, 0.0):.1f} rollout + {v - rollout.get(k, 0.0):.1f} in the buffer)"
                for k, v in sorted(life.items())
            )
            line += (
                f". Window bound: at most {spec['depth']} steps x {sum(spec['mix'].values())} groups in flight, "
                f"groups living {lives} from launch until taken, "
                f"{r.get('trained_per_group') or 0:.2f} trajectories trained per group taken: "
                f"{r['window_bound_traj_per_s']:.2f} traj/s (Little's law); achieved {r['achieved_over_min_bound']:.0%} of min(compute "
                f"{r['bound_traj_per_s']:.2f}, window {r['window_bound_traj_per_s']:.2f})"
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
        *window_lines(res),
        "",
        *reward_lines(res),
        "",
        *_goal_lines(res),
        f"total {res['wall_s']:.0f}s",
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
        "bound: the compute bound (the slowest stage alone); window bound (async): admission keeps at most "
        "max_pending_steps steps of groups in flight, so by Little's law trained traj/s <= depth x groups "
        "per step x batch / (group-seconds per batch), with each group's life measured from launch until the "
        "trainer took it (group life s) and the batch counted as trained (trajectories trained per group "
        "taken, measured: crashed members and dropped groups held their place); of min bound: achieved / min(bound, window bound). reward runtime: the "
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

    segs = {m: next((s for s in reversed(v) if "intervals" in s), None) for m, v in res["segments"].items()}
    segs = {m: s for m, s in segs.items() if s is not None}
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


def write_reports(res: dict[str, Any], out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "bench.json", out_dir / "summary.md"]
    paths[0].write_text(json.dumps(res, indent=1, default=str))
    paths[1].write_text(markdown(res))
    png = out_dir / "timeline.png"
    has_png = plot_timeline(res, png)
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
