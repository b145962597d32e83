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
from rollart_core.plan.workload import ModelProfile, TaskProfile, WorkloadProfile, load_profile

__all__ = [
    "basis_line",
    "model_from_config",
    "plan_config",
    "profile_from_config",
    "resolve_model",
    "run_plan",
]


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
    task routed to its classes (``engine_group`` = decode, ``prefill_engine_group`` + ``pd: on`` when
    disaggregated).
    The trainer becomes a worker group of ``plan.trainer_gpus`` ranks, one GPU each, on the pool of
    its class (its impl and options kept). ``rollart train`` accepts the result; the cluster must
    offer the pools (Ray resources named after the classes)."""
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
        task["engine_group"] = _group_name(tp.decode.hw)
        if tp.disaggregated:
            task.update(prefill_engine_group=_group_name(tp.prefill.hw), pd="on")
        else:
            task.update(prefill_engine_group=None, pd="off")
    # the trainer: a worker group of one rank per device on its pool
    data["trainer"].update(ranks=plan.trainer_gpus, pool=plan.trainer.hw, num_gpus=1.0)
    RunConfig.model_validate(data)  # what is written must load
    return data


def model_from_config(cfg: RunConfig) -> tuple[ModelProfile, str] | None:
    """The run's model shapes from its Hugging Face ``config.json``, if the directory exists."""
    path = cfg.model.path
    if path is None or not (path / "config.json").is_file():
        return None
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path / 'config.json'}: cannot read the model's shapes ({exc})") from None
    return ModelProfile.from_hf_config(raw), f"{path / 'config.json'}"


def resolve_model(
    cfg: RunConfig, profile: WorkloadProfile, params: float | None, from_file: bool
) -> tuple[ModelProfile, str]:
    """The model to plan for and where it came from: ``--params`` (on the profile's or the run
    model's shapes), the profile's ``model``, the run's model directory, or the default shapes."""
    given = from_file and "model" in profile.model_fields_set
    found = None if given else model_from_config(cfg)
    base, source = (profile.model, "the profile") if given else found or (ModelProfile(), "")
    if params is not None:
        if params <= 0:
            raise ConfigError(f"--params must be > 0, got {params:g}")
        return base.model_copy(update={"params": params}), f"--params, shapes from {source or 'the defaults'}"
    return base, source or "default"


def basis_line(args: argparse.Namespace, profile: WorkloadProfile, model: ModelProfile, source: str) -> str:
    """The plan's first line: what it was made from."""
    what = f"model {model.params:.3g} params ({source}), trainer MFU {profile.train.mfu:g}"
    if not args.profile:
        return (
            f"PLAN FROM DEFAULTS, not a measured profile: prompt length, env/reward latencies (0), weight "
            f"sync (0 s) are guesses; {what}. Measure a run or write a profile (--profile)"
        )
    kind = "measured" if profile.measured else "written by hand, not measured"
    return f"plan from the profile {args.profile} ({kind}); {what}"


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
    model, source = resolve_model(cfg, profile, getattr(args, "params", None), bool(args.profile))
    profile.model = model
    mfu = getattr(args, "train_mfu", None)
    if mfu is not None:
        if not 0 < mfu <= 1:
            raise ConfigError(f"--train-mfu must be in (0, 1], got {mfu:g}")
        profile.train.mfu = mfu
    mode = getattr(args, "mode", None) or cfg.loop.mode
    plan = make_plan(
        profile,
        catalogue,
        gpus=args.gpus,
        classes=classes,
        simulate_steps=args.simulate,
        mode=mode,
        alpha=cfg.loop.alpha,
        train_class=getattr(args, "train_class", None),
    )
    plan.basis = basis_line(args, profile, model, source)
    out = getattr(args, "write_config", None)
    written = ""
    if out:
        import yaml

        Path(out).write_text(
            f"# written by rollart plan from {cfg.name!r}: engine groups, task routes and the trainer pool "
            f"of the plan ({mode}: {plan.trainer_gpus} trainer + {plan.split.rollout_gpus} rollout GPUs)\n"
            + yaml.safe_dump(plan_config(cfg, plan), sort_keys=False)
        )
        written = f"\nwrote the planned config to {out}"
    if args.json:
        return json.dumps(dataclasses.asdict(plan), indent=2, default=str)
    return render_plan(plan) + written
