"""``rollart`` command line: ``rollart train <config.yaml>``, ``report RUN_DIR``, ``export CKPT --hf DIR``,
``export --trajectories RUN_DIR``, ``engines RUN_DIR list|add|remove``, ``plan``, ``bench``,
``check-config``; no arguments prints help.

A user's mistake (a config file that does not exist, bad YAML, an unknown field, a model directory
without weights, a port in use) is one line on stderr naming the file / field / port, exit code 2;
``--verbose`` adds the traceback. ``rollart train`` keeps vLLM/Ray logs in ``<output_dir>/logs``
(``--verbose``: on the console) and writes ``report.html`` into the run directory at the end."""

from __future__ import annotations

import argparse
import asyncio
import errno
import json
import logging
import socket
import sys
import traceback
from pathlib import Path
from typing import Any

from rollart_core.errors import ConfigError, RollartError
from rollart_core.malloc import limit_arenas
from rollart_core.signals import sigterm_as_sigint, terminated

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rollart", description="rollart: disaggregated agentic RL training.")
    sub = p.add_subparsers(dest="command")
    t = sub.add_parser("train", help="run a training job from a YAML config")
    t.add_argument("config", help="path to the run config (YAML)")
    t.add_argument("--steps", type=int, help="override loop.steps")
    t.add_argument("--output-dir", help="override output_dir")
    t.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="show every log (vLLM, Ray, rollart INFO) on the console, and tracebacks",
    )
    c = sub.add_parser(
        "check-config",
        help="validate a config file (and each task's environment, reward and executor) and print it resolved",
    )
    c.add_argument("config")
    c.add_argument("-v", "--verbose", action="store_true", help="show tracebacks")
    g = sub.add_parser(
        "engines",
        help="list, add or remove the engines of a run going on in RUN_DIR (its admin endpoint)",
    )
    g.add_argument("run_dir")
    g.add_argument("action", choices=["list", "add", "remove"])
    g.add_argument("target", nargs="?", help="add: the engine group; remove: the engine's name")
    g.add_argument("--drain-timeout", type=float, default=60.0, help="remove: seconds to let requests finish")
    g.add_argument("--place-timeout", type=float, default=120.0, help="add: seconds to wait for room")
    g.add_argument("-v", "--verbose", action="store_true", help="show tracebacks")
    r = sub.add_parser(
        "report", help="(re)build RUN_DIR/report.html from its metrics.jsonl (and timeline.json)"
    )
    r.add_argument("run_dir")
    r.add_argument("-v", "--verbose", action="store_true", help="show tracebacks")
    e = sub.add_parser(
        "export",
        help="turn a checkpoint into a Hugging Face model directory (CKPT --hf DIR), or a run's "
        "trajectories into a JSONL / Parquet table (--trajectories RUN_DIR)",
    )
    e.add_argument(
        "checkpoint",
        nargs="?",
        help="a checkpoint directory written by the trainer (e.g. RUN/checkpoint-12)",
    )
    e.add_argument("--hf", metavar="OUT_DIR", help="the Hugging Face model directory to write")
    e.add_argument(
        "--trajectories",
        metavar="RUN_DIR",
        help="export the trajectories a run saved (loop.export_trajectories) as one table",
    )
    e.add_argument(
        "--format",
        choices=["jsonl", "parquet"],
        default="jsonl",
        help="with --trajectories: the table's format (parquet needs pyarrow; default jsonl)",
    )
    e.add_argument(
        "--out",
        metavar="PATH",
        help="with --trajectories: the file to write (default RUN_DIR/trajectories.FORMAT)",
    )
    e.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists")
    e.add_argument(
        "--adapter-only",
        action="store_true",
        help="for a checkpoint of LoRA training: write its PEFT adapter directory instead of the "
        "base model with the adapters merged in",
    )
    e.add_argument("-v", "--verbose", action="store_true", help="show tracebacks")
    pl = sub.add_parser(
        "plan", help="propose pools and task→hardware mapping for a workload (roofline + simulation)"
    )
    pl.add_argument("config", help="path to the run config (YAML): its tasks, batch sizes and turns")
    pl.add_argument(
        "--profile",
        help="workload profile (YAML/JSON; see rollart_core.plan.workload), e.g. measured by a run",
    )
    pl.add_argument(
        "--catalogue", help="hardware catalogue (YAML) adding to or replacing the built-in classes"
    )
    pl.add_argument("--gpus", type=int, default=64, help="GPU budget to split into pools (default 64)")
    pl.add_argument(
        "--classes", help="comma-separated GPU classes to choose from (default: all in the catalogue)"
    )
    pl.add_argument(
        "--simulate",
        type=int,
        default=0,
        metavar="STEPS",
        help="also simulate STEPS training steps, Sync+, One-off and async, on the planned pools",
    )
    pl.add_argument(
        "--params",
        type=float,
        help="model parameters (e.g. 7e9; default: counted from the config's model directory)",
    )
    pl.add_argument(
        "--train-mfu",
        type=float,
        help="trainer MFU: share of its class's peak FLOP/s for 6·N·tokens per step (default 0.4)",
    )
    pl.add_argument("--train-class", help="GPU class of the trainer (default: most FLOP/s per $)")
    pl.add_argument(
        "--mode",
        choices=["sync", "one_off", "async"],
        help="the mode whose split sizes the pools (default: the config's loop.mode)",
    )
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")
    pl.add_argument(
        "--write-config",
        metavar="OUT.yaml",
        help="also write the config with the plan applied (engine groups per pool, task routes, "
        "the trainer pool)",
    )
    b = sub.add_parser(
        "bench", help="Sync+ vs One-off vs async (and baselines) side by side, with a timeline"
    )
    b.add_argument("--quick", action="store_true", help="the quick size (a few minutes on 2 cores)")
    b.add_argument("--micro", action="store_true", help="the smallest size (tests)")
    b.add_argument("--out", default="runs/bench", help="output directory (default runs/bench)")
    b.add_argument(
        "--modes", nargs="+", help="modes to compare (default: by size; see rollart_core.bench.workload)"
    )
    b.add_argument("--rounds", type=int, help="override the size's rounds")
    b.add_argument(
        "--steps",
        type=int,
        help="override the size's measured steps per mode per round (each mode adds its warm-up steps)",
    )
    b.add_argument(
        "--set",
        nargs="+",
        default=[],
        metavar="FIELD=VALUE",
        help="override workload fields of the size, e.g. --set env_latency_s=0.1 groups_per_step=4 "
        "(fields: rollart_core.bench.workload.BenchSize)",
    )
    b.add_argument("--model", help="model directory (default: the tiny model, created under --out)")
    b.add_argument("-v", "--verbose", action="store_true", help="show INFO logs")
    return p


def _bad_input_line(exc: BaseException) -> str | None:
    """The one line for a user's mistake (a bad config, a missing file, a port in use); None: a bug."""
    if isinstance(exc, RollartError):
        return _one_line(str(exc))
    if isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE:
        return _one_line(f"address already in use: {exc}")
    return None


def _one_line(msg: str) -> str:
    """A multi-line message (a YAML parser's, several validation errors) as one line."""
    parts = [ln.strip() for ln in msg.splitlines() if ln.strip() and set(ln.strip()) != {"^"}]
    return "; ".join(parts).replace('in "<unicode string>", ', "")


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    verbose = getattr(args, "verbose", False)
    sigterm_as_sigint()  # a scheduler's SIGTERM stops the run as Ctrl-C does, cleaning up
    limit_arenas()  # before the run's threads start (rollart_core.malloc says why)
    try:
        return _run(args)
    except KeyboardInterrupt:
        return 143 if terminated() else 130
    except Exception as exc:
        line = _bad_input_line(exc)
        if verbose:
            traceback.print_exc()
        if line is not None:
            print(f"rollart: error: {line}", file=sys.stderr)
            return 2
        where = getattr(exc, "_rollart_log", None)
        hint = f" (traceback in {where})" if where else " (--verbose shows the traceback)"
        print(f"rollart: error: {type(exc).__name__}: {exc}{hint if not verbose else ''}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    if args.command == "bench":
        from rollart_core.bench.harness import run_bench_cli

        return run_bench_cli(args)
    if args.command == "report":
        from rollart_core.report import write_report

        print(f"report: {write_report(Path(args.run_dir).resolve())}")
        return 0
    if args.command == "export":
        return _export(args)
    if args.command == "engines":
        return _engines(args)
    from rollart_core.config import load_config

    cfg = load_config(args.config)
    if args.command == "plan":
        from rollart_core.plan.cli import run_plan

        print(run_plan(cfg, args))
        return 0
    if args.command == "check-config":
        from rollart_core.control.pipeline import check_tasks

        check_tasks(cfg)  # what the run would check first: each task's env, reward and executor
        print(cfg.model_dump_json(indent=2))
        return 0
    if args.steps is not None:
        cfg.loop.steps = args.steps
    if args.output_dir is not None:
        cfg = cfg.model_copy(update={"output_dir": Path(args.output_dir).resolve()})
    _preflight(cfg)
    return _train(cfg, verbose=args.verbose)


def _engines(args: argparse.Namespace) -> int:
    from urllib.parse import quote

    from rollart_core.control.admin import admin_call

    if args.action == "list":
        if args.target is not None:
            raise ConfigError("engines list takes no target")
        answer = admin_call(args.run_dir, "GET", "/engines")
    elif args.target is None:
        raise ConfigError(f"engines {args.action} needs a target (add: an engine group; remove: an engine)")
    elif args.action == "add":
        answer = admin_call(
            args.run_dir, "POST", "/engines", {"group": args.target, "place_timeout_s": args.place_timeout}
        )
    else:
        answer = admin_call(
            args.run_dir,
            "DELETE",
            f"/engines/{quote(args.target, safe='')}?drain_timeout_s={args.drain_timeout:g}",
        )
    print(json.dumps(answer, indent=2))
    return 0


def _export(args: argparse.Namespace) -> int:
    if args.trajectories is not None:
        if args.checkpoint is not None or args.hf is not None or args.adapter_only:
            raise ConfigError("export: --trajectories RUN_DIR takes no checkpoint, --hf or --adapter-only")
        from rollart_core.trajectories import export_trajectories

        path, rows = export_trajectories(args.trajectories, args.out, format=args.format)
        print(f"exported {rows} trajectories of {args.trajectories} -> {path}")
        return 0
    if args.checkpoint is None or args.hf is None:
        raise ConfigError("export: give a checkpoint and --hf OUT_DIR, or --trajectories RUN_DIR")
    from rollart_core.registry import resolve

    export_hf = resolve(
        "exporter", "rollart_train.export:export_hf"
    )  # rollart-core never imports rollart-train
    out = export_hf(
        Path(args.checkpoint), Path(args.hf), overwrite=args.force, adapter_only=args.adapter_only
    )
    what = "a PEFT LoRA adapter directory" if args.adapter_only else "a Hugging Face model directory"
    print(f"exported {args.checkpoint} -> {out} ({what})")
    return 0


def _preflight(cfg: Any) -> None:
    """User mistakes found before anything starts: a model directory without weights, a port in use,
    a task whose environment cannot work (a dataset file that is missing, empty or lacks a key)."""
    from rollart_core.control.pipeline import check_tasks

    model = Path(cfg.model.path)
    if model.is_dir() and (model / "config.json").is_file() and not any(model.glob("*.safetensors")):
        raise ConfigError(
            f"model.path {model}: has config.json but no weights (*.safetensors); point it at a "
            "complete Hugging Face model directory"
        )
    if model.exists() and not model.is_dir():
        raise ConfigError(f"model.path {model}: not a directory")
    for where, host, port in _configured_ports(cfg.model_dump(mode="json")):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError as exc:
                raise ConfigError(f"{where}: port {port} on {host} is in use ({exc.strerror})") from None
    check_tasks(cfg)


def _configured_ports(node: Any, where: str = "") -> list[tuple[str, str, int]]:
    """Every ``port`` / ``*_port`` field with a fixed value (0 and None pick a free one), with the host beside it."""
    found: list[tuple[str, str, int]] = []
    if isinstance(node, dict):
        named = node.get("host")
        host = named if isinstance(named, str) else "127.0.0.1"
        for k, v in node.items():
            path = f"{where}.{k}" if where else str(k)
            if (
                (k == "port" or k.endswith("_port"))
                and isinstance(v, int)
                and not isinstance(v, bool)
                and v > 0
            ):
                found.append((path, host if host not in ("node", "") else "127.0.0.1", v))
            else:
                found += _configured_ports(v, path)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            found += _configured_ports(v, f"{where}.{i}")
    return found


def _train(cfg: Any, *, verbose: bool) -> int:
    from rollart_core.console import route_logs, startup_display, wants_live
    from rollart_core.control.checkpoint import set_aside_earlier_run
    from rollart_core.metrics import since_process_start
    from rollart_core.report import save_timeline, write_report
    from rollart_core.resources import worker_logs_to
    from rollart_core.timeline import Timeline
    from rollart_core.trackers import tracking

    out: Path = cfg.output_dir
    moved = set_aside_earlier_run(out, cfg.loop.resume_from)  # before this run's log opens there
    if moved is not None:
        print(f"rollart: the earlier run in {out} was moved to {moved}", flush=True)
    log_file = out / "logs" / "rollart.log"
    live = wants_live()
    summary: dict[str, Any] = {}
    error: BaseException | None = None
    import_s: float | None = None
    worker_logs_to(None if verbose else out / "logs" / "ray")
    # trackers (W&B, MLflow) start before the pipeline, so one that cannot start stops the run first
    with route_logs(log_file, verbose=verbose), tracking(cfg) as trackers:
        logging.getLogger(__name__).info("rollart train %s -> %s", cfg.name, out)
        if not live:
            print(
                f"rollart: starting {cfg.name} ({cfg.loop.mode}, {cfg.loop.steps} steps); logs: {log_file}",
                flush=True,
            )
        try:
            with Timeline() as tl, startup_display(f"starting {cfg.name}"):
                import_s = since_process_start()
                from rollart_core.control.train import train

                # summary is filled however the run ends; the earlier run was set aside above
                asyncio.run(train(cfg, summary=summary, set_aside_earlier=False))
        except BaseException as exc:
            error = exc
            logging.getLogger(__name__).info("the run failed", exc_info=True)  # the file only
        finally:
            worker_logs_to(None)
        summary.pop("history", None)
        summary["outcome"] = _outcome(error)
        if error is not None and not isinstance(error, KeyboardInterrupt):
            summary["error"] = f"{type(error).__name__}: {error}"
        if import_s is not None:
            summary["import_s"] = import_s
        summary = {"name": cfg.name, "output_dir": str(out), **summary}
        if trackers is not None:
            summary["trackers"] = trackers.status()
        report = _write_outputs(out, summary, tl, error, save_timeline, write_report)
        if trackers is not None:  # the summary and the report's page and figures, then they end
            trackers.finish(summary, [report, *sorted(out.glob("*.png"))] if report else [])
    if error is not None:
        if not isinstance(error, (KeyboardInterrupt, RollartError)):
            error._rollart_log = log_file  # type: ignore[attr-defined]
        _print_where(out, log_file, report, stream=sys.stderr)
        raise error
    if live:
        _print_summary(summary)
    else:
        print(json.dumps(summary, indent=2, default=str), flush=True)
    _print_where(out, log_file, report, stream=sys.stdout if live else sys.stderr)
    return 0


def _outcome(error: BaseException | None) -> str:
    if error is None:
        return "completed"
    if isinstance(error, KeyboardInterrupt):
        return "terminated (SIGTERM)" if terminated() else "interrupted (SIGINT)"
    return "failed"


def _write_outputs(
    out: Path,
    summary: dict[str, Any],
    tl: Any,
    error: BaseException | None,
    save_timeline: Any,
    write_report: Any,
) -> Path | None:
    """``summary.json``, ``timeline.json`` and the report; a failure here is logged, never hides the run's own."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        if not error or "steps" in summary:  # a run stopped or failed after its loop began: what it did
            (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
        if tl.intervals:
            save_timeline(tl.intervals, min(s for _, s, _, _ in tl.intervals), out / "timeline.json")
        if not (out / "metrics.jsonl").is_file():
            return None
        return write_report(out, summary, error=None if error is None else f"{type(error).__name__}: {error}")
    except Exception:
        logging.getLogger(__name__).exception("writing the report failed")
        return None


def _print_summary(summary: dict[str, Any]) -> None:
    phases = ", ".join(
        f"{k[:-2]} {summary[k]:.1f}"
        for k in (
            "import_s",
            "ray_start_s",
            "model_s",
            "trainer_start_s",
            "engines_start_s",
            "first_step_s",
            "wall_s",
        )
        if isinstance(summary.get(k), float)
    )
    print(
        f"done: {summary.get('steps')} steps, version {summary.get('final_version')}, fates {summary.get('fates')}"
    )
    print(f"start-up and wall time (s): {phases}")


def _print_where(out: Path, log_file: Path, report: Path | None, stream: Any) -> None:
    print(f"run directory: {out}", file=stream)
    print(
        f"log file:      {log_file}"
        + (f"  (Ray workers: {out / 'logs' / 'ray'})" if (out / "logs" / "ray").exists() else ""),
        file=stream,
    )
    if report is not None:
        print(f"report:        {report}", file=stream)
    if (out / "tensorboard").is_dir():
        print(f"tensorboard:   tensorboard --logdir {out / 'tensorboard'}", file=stream)
    stream.flush()


if __name__ == "__main__":
    sys.exit(main())
