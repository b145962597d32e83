"""``rollart`` command line: ``rollart train <config.yaml>``, ``rollart plan <config.yaml>``; no arguments prints help."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys

from rollart_core.errors import RollartError

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rollart", description="rollart: disaggregated agentic RL training.")
    sub = p.add_subparsers(dest="command")
    t = sub.add_parser("train", help="run a training job from a YAML config")
    t.add_argument("config", help="path to the run config (YAML)")
    t.add_argument("--steps", type=int, help="override train.steps")
    t.add_argument("--output-dir", help="override output_dir")
    t.add_argument("-v", "--verbose", action="store_true", help="show INFO logs")
    c = sub.add_parser("check-config", help="validate a config file and print it resolved")
    c.add_argument("config")
    pl = sub.add_parser("plan", help="propose pools and task→hardware mapping for a workload (roofline + simulation)")
    pl.add_argument("config", help="path to the run config (YAML): its tasks, batch sizes and turns")
    pl.add_argument("--profile", help="workload profile (YAML/JSON; see rollart_core.workload), e.g. measured by a run")
    pl.add_argument("--catalogue", help="hardware catalogue (YAML) adding to or replacing the built-in classes")
    pl.add_argument("--gpus", type=int, default=64, help="GPU budget to split into pools (default 64)")
    pl.add_argument("--classes", help="comma-separated GPU classes to choose from (default: all in the catalogue)")
    pl.add_argument("--simulate", type=int, default=0, metavar="STEPS",
                    help="also simulate STEPS training steps, Sync+ and async, on the planned pools")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")
    b = sub.add_parser("bench", help="Sync+ vs One-off vs async (and baselines) side by side, with a timeline")
    b.add_argument("--quick", action="store_true", help="the quick size (a few minutes on 2 cores)")
    b.add_argument("--micro", action="store_true", help="the smallest size (tests)")
    b.add_argument("--out", default="runs/bench", help="output directory (default runs/bench)")
    b.add_argument("--modes", nargs="+", help="modes to compare (default: by size; see rollart_core.bench_workload)")
    b.add_argument("--rounds", type=int, help="override the size's rounds")
    b.add_argument("--steps", type=int, help="override the size's measured steps per mode per round (each mode adds its warm-up steps)")
    b.add_argument("--set", nargs="+", default=[], metavar="FIELD=VALUE",
                   help="override workload fields of the size, e.g. --set env_latency_s=0.1 groups_per_step=4 "
                        "(fields: rollart_core.bench_workload.BenchSize)")
    b.add_argument("--model", help="model directory (default: the tiny model, created under --out)")
    b.add_argument("-v", "--verbose", action="store_true", help="show INFO logs")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    from rollart_core.config import load_config

    try:
        if args.command == "bench":
            from rollart_core.bench import run_bench_cli

            return run_bench_cli(args)
        cfg = load_config(args.config)
        if args.command == "plan":
            from rollart_core.planner_cli import run_plan

            print(run_plan(cfg, args))
            return 0
        if args.command == "check-config":
            print(cfg.model_dump_json(indent=2))
            return 0
        updates: dict[str, object] = {}
        if args.steps is not None:
            cfg.train.steps = args.steps
        if args.output_dir is not None:
            from pathlib import Path

            updates["output_dir"] = Path(args.output_dir).resolve()
        cfg = cfg.model_copy(update=updates)
        logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        from rollart_core.loop import train

        summary = asyncio.run(train(cfg))
    except RollartError as exc:
        print(f"rollart: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    summary.pop("history", None)
    print(json.dumps(summary, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
