"""``rollart plan``: the planner behind the command line (kept apart from :mod:`rollart_core.cli`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from rollart_core.config import RunConfig
from rollart_core.errors import ConfigError
from rollart_core.plan.catalogue import load_catalogue
from rollart_core.plan.planner import Plan, make_plan, render_plan
from rollart_core.plan.workload import TaskProfile, WorkloadProfile, load_profile

__all__ = ["plan_config", "profile_from_config", "run_plan"]


def profile_from_config(cfg: RunConfig) -> WorkloadProfile:
    """A default profile from the run config alone: batch sizes, turns and output lengths; prompt
    length and latencies are guesses (pass ``--profile`` for measured ones)."""
    return WorkloadProfile(
        tasks=[
            TaskProfile(
                name=t.name,
                trajectories_per_step=t.group_size * t.groups_per_step,
                group_size=t.group_size,
                output_tokens_per_turn=t.sampling.max_tokens,
                turns=t.max_turns,
            )
            for t in cfg.tasks
        ]
    )


def _group_name(hw: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in hw.lower())


def plan_config(cfg: RunConfig, plan: Plan) -> dict[str, Any]:
    """``cfg`` with the plan applied: one engine group per GPU class of the plan (one engine per
    device, on the pool of that class, with the first engine group's impl and options), and every
    task routed to its classes (``pool`` = decode, ``prefill_pool`` + ``pd: on`` when disaggregated).
    ``rollart train`` accepts the result; the cluster must offer the pools (Ray resources named
    after the classes)."""
    template = cfg.engines[0]
    gpu_classes = {c for t in plan.tasks for c in (t.prefill.hw, t.decode.hw)}
    engines = [
        {
            "name": _group_name(hw),
            "impl": template.impl,
            "count": n,
            "pool": hw,
            "max_restarts": template.max_restarts,
            "options": template.options,
        }
        for hw, n in plan.pools.items()
        if hw in gpu_classes
    ]
    routes = {t.task: t for t in plan.tasks}
    data = cfg.model_dump(mode="json")
    data["engines"] = engines
    for task in data["tasks"]:
        tp = routes.get(task["name"])
        if tp is None:
            continue
        task["pool"] = _group_name(tp.decode.hw)
        if tp.disaggregated:
            task.update(prefill_pool=_group_name(tp.prefill.hw), pd="on")
        else:
            task.update(prefill_pool=None, pd="off")
    RunConfig.model_validate(data)  # what is written must load
    return data


def run_plan(cfg: RunConfig, args: argparse.Namespace) -> str:
    catalogue = load_catalogue(args.catalogue)
    profile = load_profile(args.profile) if args.profile else profile_from_config(cfg)
    names = {t.name for t in cfg.tasks}
    unknown = [t.name for t in profile.tasks if t.name not in names]
    if unknown:
        raise ConfigError(f"profile tasks {unknown} are not tasks of {cfg.name!r} ({sorted(names)})")
    classes = [c.strip() for c in args.classes.split(",") if c.strip()] if args.classes else None
    if args.gpus < 1:
        raise ConfigError("--gpus must be >= 1")
    plan = make_plan(profile, catalogue, gpus=args.gpus, classes=classes, simulate_steps=args.simulate)
    out = getattr(args, "write_config", None)
    written = ""
    if out:
        import yaml

        Path(out).write_text(
            f"# written by rollart plan from {cfg.name!r}: engine groups and task routes of the plan\n"
            + yaml.safe_dump(plan_config(cfg, plan), sort_keys=False)
        )
        written = f"wrote the planned config to {out}\n"
    if args.json:
        return json.dumps(dataclasses.asdict(plan), indent=2, default=str)
    note = (
        ""
        if args.profile
        else (
            "(no --profile: prompt length, model size and latencies are defaults; "
            "measure a run or write a profile)\n"
        )
    )
    return written + note + render_plan(plan)
