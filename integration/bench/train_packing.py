"""Benchmark: TorchTrainer train_step with token-level packing vs right-padding, same batch, same run.

    uv run --no-sync python integration/bench/train_packing.py [--quick] [--out runs/bench/train_packing.json]

A batch of trajectories with heavy-tailed lengths (most short, a few long: what agentic rollouts look
like) trains on the tiny model with ``packing: true`` (micro-batches of ``micro_batch_tokens``) and
``packing: false`` (``micro_batch_size`` sequences per micro-batch, padded to the longest). Variants
alternate within each repetition; the table shows median seconds per step and the ratio.
"""

from __future__ import annotations

import argparse
import atexit
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path


def make_batch(n: int, seed: int):
    import random

    from rollart_core.types import Trajectory, Turn

    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = int(min(rng.paretovariate(1.2) * 24, 480))
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="runs/bench/train_packing.json")
    args = ap.parse_args()
    from rollart_train import TorchTrainer, TorchTrainerConfig, create_tiny_model

    n, reps = (32, 2) if args.quick else (64, 4)
    tmp = tempfile.mkdtemp(prefix="train-packing-")
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    model = create_tiny_model(Path(tmp) / "tiny")
    batch = make_batch(n, 0)
    lengths = [len(t.token_ids()) for t in batch]
    variants = {
        "packed": TorchTrainerConfig(lr=1e-5, packing=True, micro_batch_tokens=2048, micro_batch_size=64),
        "padded": TorchTrainerConfig(lr=1e-5, packing=False, micro_batch_size=8),
    }
    trainers = {k: TorchTrainer(c, model_path=model) for k, c in variants.items()}
    times: dict[str, list[float]] = {k: [] for k in variants}
    info: dict[str, dict[str, float]] = {}
    for t in trainers.values():  # warm-up
        t.train_step(batch)
    for _ in range(reps):
        for k, t in trainers.items():
            t0 = time.perf_counter()
            m = t.train_step(batch)
            times[k].append(time.perf_counter() - t0)
            info[k] = {"micro_batches": m["micro_batches"]}
    padded_tokens = sum(max(lengths[i : i + 8]) * len(lengths[i : i + 8]) for i in range(0, n, 8))
    rows = []
    for k in variants:
        med = statistics.median(times[k])
        rows.append(
            {
                "variant": k,
                "median_s": med,
                "micro_batches": info[k]["micro_batches"],
                "tokens_per_s": sum(lengths) / med,
            }
        )
    base = rows[1]["median_s"]
    print(
        f"batch: {n} trajectories, {sum(lengths)} tokens (padded layout: {padded_tokens} token slots), "
        f"max length {max(lengths)}, {reps} reps"
    )
    print(f"{'variant':8} {'s/step':>8} {'micro':>6} {'tok/s':>9} {'vs padded':>9}")
    for r in rows:
        print(
            f"{r['variant']:8} {r['median_s']:8.3f} {r['micro_batches']:6.0f} {r['tokens_per_s']:9.0f} "
            f"{base / r['median_s']:8.2f}x"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "n": n,
                "reps": reps,
                "tokens": sum(lengths),
                "padded_slots": padded_tokens,
                "rows": rows,
                "speedup_packed_vs_padded": base / rows[0]["median_s"],
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
