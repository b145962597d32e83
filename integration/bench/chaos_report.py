"""``chaos.py``'s verdict: the invariants a chaos run must keep, and the table it prints."""

from __future__ import annotations

from typing import Any


def invariants(r: dict[str, Any]) -> list[str]:
    """The broken invariants (empty: the run kept every promise)."""
    bad = []
    if r["error"]:
        bad.append(f"run failed: {r['error']}")
    if r["steps"] != r["steps_asked"]:
        bad.append(f"steps {r['steps']} != asked {r['steps_asked']}")
    if r["launched"] != r["fates_total"]:
        bad.append(f"launched {r['launched']} != sum of fates {r['fates_total']}")
    if r["trained_twice"]:
        bad.append(f"{r['trained_twice']} trajectories trained twice")
    if r["lag_violations"]:
        bad.append(f"{r['lag_violations']} trajectories trained with lag > alpha")
    if r["leftover_processes"]:
        bad.append(f"{len(r['leftover_processes'])} processes left behind: {r['leftover_processes']}")
    if any(r["proxy_session_tables"].values()):
        bad.append(f"the proxy's session tables are not empty after the run: {r['proxy_session_tables']}")
    if r["engine_killed"] and r["engine_back_at_version"] is None:
        bad.append(f"the killed engine {r['engine_killed']} was not back before the run ended")
    elif r["engine_killed"] and not r["engine_served_after_back"]:
        bad.append(f"the killed engine {r['engine_killed']} came back but served no request")
    from chaos_elastic import violations

    return bad + violations(r["elastic"])


def table(r: dict[str, Any]) -> str:
    from chaos_elastic import rows as elastic_rows

    rows = [
        ("steps done / asked", f"{r['steps']} / {r['steps_asked']}"),
        ("launched / sum of fates", f"{r['launched']} / {r['fates_total']}  {r['fates']}"),
        ("trajectories trained", r["trained"]),
        ("trained twice", r["trained_twice"]),
        (f"trained with lag > alpha={r['alpha']}", f"{r['lag_violations']} (max lag {r['lag_max']})"),
        ("faults fired", r["faults_by_kind"]),
        ("reward runtime faults", r["reward_runtime_faults"]),
        ("reward calls", r["reward"]),
        ("trainer restarts", r["trainer_restarts"]),
        ("engines recovered", r["engine_recovered"]),
        (
            "killed engine back",
            "no"
            if r["engine_back_at_version"] is None
            else f"{r['engine_killed']} at v{r['engine_back_at_version']} ({r['engine_back_after_s']:.0f} s after "
            "the kill), "
            f"versions then {r['engine_versions_at_back']}, {r['engine_served_after_back']} requests after",
        ),
        *elastic_rows(r["elastic"]),
        ("proxy session tables", r["proxy_session_tables"]),
        ("env manager", r["env_manager"]),
        ("median step", f"{r['median_step_s']:.2f} s"),
        *(
            (
                f"  lost to {f['kind']} @v{f['at_version']}",
                f"{f['lost_s']:.2f} s  (steps {', '.join(f'{s:.2f}' for s in f['steps_after_s'])})",
            )
            for f in r["faults"]
        ),
        ("leftover processes", f"{len(r['leftover_processes'])} (of {r['processes_seen']} started)"),
        ("build / run / total", f"{r['build_s']:.0f} / {r['run_s']:.0f} / {r['total_s']:.0f} s"),
        (
            "build phases (overlapping)",
            ", ".join(f"{k[:-2]} {v:.0f} s" for k, v in r["build_phases"].items()),
        ),
        ("error", r["error"] or "-"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
