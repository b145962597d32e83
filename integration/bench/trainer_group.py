"""Benchmark: the trainer as a Ray worker group (RayTrainerGroup) against the in-process TorchTrainer.

    uv run --no-sync python integration/bench/trainer_group.py [--quick] [--threads 1] [--out runs/bench/trainer_group.json]

Starts its own Ray on 127.0.0.1 (custom resource ``trainer: 3``; its workers at ``--worker-niceness``,
default 0, through ``RayCluster`` as the pipeline starts them: Ray's own 15 makes the ranks give way to every ordinary
process, the in-process trainer among them) and trains the tiny model on the same
batches with three trainers alive side by side: the in-process ``TorchTrainer`` (world_size 1), a
group of 1 rank and a group of 2 ranks (gloo, FSDP2). Variants alternate within every repetition so the
machine's load hits them alike; the table shows the median seconds per step and the ratio to the
in-process trainer, and "outside step": the call's wall time minus the rank's own ``train_s`` (the
group's overhead proper: ``ray.put`` of the batch, one call per rank, the answer; less noisy than the
ratio on a loaded machine).

Then the weight push into a ``FilesystemWeightStore``: from the driver
(``store.push(v, dict(trainer.named_weights()))``: the in-process trainer, and a 2-rank group whose
weights are first brought to the driver) against ``RayTrainerGroup.push_weights(v)`` of the 1- and 2-rank
groups (gathered on rank 0, pushed from there; nothing passes through the driver), with the gather's
share of it.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from rollart_core.config import RayConfig
from rollart_core.resources import LOOPBACK_ENV, RayCluster, worker_logs_to


def make_batch(n: int, seed: int):
    import random

    from rollart_core.types import Trajectory, Turn

    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = int(min(rng.paretovariate(1.2) * 24, 320))
        ctx = [rng.randrange(3, 400) for _ in range(max(length // 2, 2))]
        gen = [rng.randrange(3, 400) for _ in range(max(length - len(ctx), 1))]
        out.append(
            Trajectory(
                traj_id=f"t{i}",
                task="t",
                env_id="e",
                group_id=f"g{i // 4}",
                seed=i,
                start_version=0,
                reward=float(rng.random() < 0.3),
                turns=[
                    Turn(
                        context_ids=ctx,
                        output_ids=gen,
                        output_logprobs=[-6.0] * len(gen),
                        output_versions=[0] * len(gen),
                    )
                ],
            )
        )
    return out


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads per rank (and of the in-process trainer)"
    )
    ap.add_argument(
        "--worker-niceness",
        type=int,
        default=RayConfig().worker_niceness,
        help="Ray workers' niceness (rollart's default 0; Ray's own default is 15)",
    )
    ap.add_argument("--out", default="runs/bench/trainer_group.json")
    args = ap.parse_args()
    for k, v in LOOPBACK_ENV.items():
        os.environ.setdefault(k, v)

    from rollart_train import RayTrainerGroup, RayTrainerGroupConfig, TorchTrainer, TorchTrainerConfig
    from rollart_train.tiny import create_tiny_model
    from rollart_weightsync import FilesystemWeightStore

    n, steps, pushes = (16, 3, 3) if args.quick else (32, 8, 6)
    tmp = tempfile.mkdtemp(prefix="trainer-group-")
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    model = create_tiny_model(Path(tmp) / "tiny")
    batches = [make_batch(n, s) for s in range(steps + 1)]
    opts = {"lr": 1e-5, "micro_batch_tokens": 1024, "num_threads": args.threads}
    worker_logs_to(Path(tmp) / "ray-logs")  # the ranks' output stays off the table
    cluster = RayCluster(
        RayConfig(num_cpus=4, resources={"trainer": 3}, worker_niceness=args.worker_niceness)
    ).__enter__()
    stores = {
        k: FilesystemWeightStore(root=Path(tmp) / f"weights-{k}") for k in ("driver", "rank0", "via-driver")
    }
    trainers = {"in-process": TorchTrainer(TorchTrainerConfig(**opts), model_path=model)}
    try:
        t0 = time.perf_counter()
        for ranks in (1, 2):
            cfg = RayTrainerGroupConfig(
                ranks=ranks, pool="trainer", num_cpus_per_rank=args.threads, options=opts
            )
            trainers[f"group-{ranks}"] = RayTrainerGroup(cfg, model_path=model, weight_store=stores["rank0"])
        build_s = time.perf_counter() - t0
        for t in trainers.values():  # warm-up
            t.train_step(batches[0])
        times: dict[str, list[float]] = {k: [] for k in trainers}
        outside: dict[str, list[float]] = {k: [] for k in trainers}  # wall time not spent in the rank's step
        for batch in batches[1:]:
            for k, t in trainers.items():
                t0 = time.perf_counter()
                metrics = t.train_step(batch)
                times[k].append(time.perf_counter() - t0)
                outside[k].append(times[k][-1] - metrics["train_s"])
        push: dict[str, list[float]] = {
            "driver (in-process)": [],
            "group-1 rank 0": [],
            "group-2 rank 0": [],
            "group-2 via driver": [],
        }
        gather: dict[str, list[float]] = {"group-1 rank 0": [], "group-2 rank 0": []}
        local, group = trainers["in-process"], trainers["group-2"]
        for v in range(1, pushes + 1):
            push["driver (in-process)"].append(
                _timed(lambda v=v: stores["driver"].push(v, dict(local.named_weights())).result())
            )
            for ranks in (1, 2):
                name = f"group-{ranks}"
                t0 = time.perf_counter()
                metrics = trainers[name].push_weights(2 * v + ranks)  # one store: distinct versions
                push[f"{name} rank 0"].append(time.perf_counter() - t0)
                gather[f"{name} rank 0"].append(metrics["push_gather_s"])
            push["group-2 via driver"].append(
                _timed(lambda v=v: stores["via-driver"].push(v, dict(group.named_weights())).result())
            )
        push_bytes = group.push_weights(4 * pushes)["push_bytes"]
    finally:
        for t in trainers.values():
            t.close()
        cluster.__exit__(None, None, None)
    base = statistics.median(times["in-process"])
    rows = [
        {
            "variant": k,
            "median_s": statistics.median(v),
            "min_s": min(v),
            "max_s": max(v),
            "vs_in_process": statistics.median(v) / base,
            "outside_step_ms": 1e3 * statistics.median(outside[k]),
        }
        for k, v in times.items()
    ]
    push_rows = [
        {
            "path": k,
            "median_s": statistics.median(v),
            "min_s": min(v),
            "max_s": max(v),
            "gather_median_s": statistics.median(gather[k]) if k in gather else None,
        }
        for k, v in push.items()
    ]
    tokens = sum(len(t.token_ids()) for t in batches[1])
    print(
        f"tiny model, {n} trajectories/step (~{tokens} tokens), {steps} steps, {args.threads} thread(s) per rank, "
        f"Ray workers at nice {args.worker_niceness}; "
        f"groups built in {build_s:.1f}s"
    )
    print(f"{'trainer':12} {'s/step':>8} {'min':>7} {'max':>7} {'vs in-process':>13} {'outside step':>12}")
    for r in rows:
        print(
            f"{r['variant']:12} {r['median_s']:8.3f} {r['min_s']:7.3f} {r['max_s']:7.3f} {r['vs_in_process']:12.2f}x "
            f"{r['outside_step_ms']:9.1f} ms"
        )
    print(f"push of {push_bytes / 2**20:.1f} MiB into a FilesystemWeightStore, {pushes} pushes")
    print(f"{'path':20} {'s/push':>8} {'min':>7} {'max':>7} {'of it gather':>12}")
    for r in push_rows:
        g = f"{r['gather_median_s']:12.3f}" if r["gather_median_s"] is not None else f"{'':12}"
        print(f"{r['path']:20} {r['median_s']:8.3f} {r['min_s']:7.3f} {r['max_s']:7.3f} {g}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "n": n,
                "steps": steps,
                "threads": args.threads,
                "worker_niceness": args.worker_niceness,
                "build_s": build_s,
                "rows": rows,
                "push_bytes": push_bytes,
                "push": push_rows,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
