"""``rollart plan``: the planner behind the command line (kept apart from the CLI module)."""

from __future__ import annotations

import argparse
import dataclasses
import json

from rollart_core.catalogue import load_catalogue
from rollart_core.config import RunConfig
from rollart_core.errors import ConfigError
from rollart_core.planner import make_plan, render_plan
from rollart_core.workload import TaskProfile, WorkloadProfile, load_profile

__all__ = ["profile_from_config", "run_plan"]


def profile_from_config(cfg: RunConfig) -> WorkloadProfile:
    """A default profile from the run config alone: batch sizes, turns and output lengths; prompt
    length and latencies are guesses (pass ``--profile`` for measured ones)."""
    return WorkloadProfile(tasks=[
        TaskProfile(name=t.name, trajectories_per_step=t.group_size * t.groups_per_step, group_size=t.group_size,
                    output_tokens_per_turn=t.sampling.max_tokens, turns=t.max_turns)
        for t in cfg.tasks])


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
    if args.json:
        return json.dumps(dataclasses.asdict(plan), indent=2, default=str)
    note = "" if args.profile else ("(no --profile: prompt length, model size and latencies are defaults; "
                                    "measure a run or write a profile)\n")
    return note + render_plan(plan)
