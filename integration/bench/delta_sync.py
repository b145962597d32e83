"""Delta vs full weight sync: bytes and time per update, per store, on real training updates.

    uv run --no-sync python integration/bench/delta_sync.py [--model DIR] [--steps 3]
        [--lrs 1e-6 3e-6 1e-5] [--stores filesystem ray mooncake] [--dtypes float32 bfloat16]
        [--out delta_sync.json]

The torch trainer makes ``--steps`` optimizer steps at each learning rate on ``--model`` (default:
the tiny Qwen2 model created in code) on batches of random-token trajectories with random rewards;
every version (the initial weights, then one per step) is pushed to each store twice — a store with
``delta: false`` and one with ``delta: true`` — and pulled by a second store object of each (as an
engine would). Per update (version 1 onwards) it reports the bytes the puller fetched (the full
version vs the delta), the push+pull time of both, and checks that both pulls are bit-identical to
what was pushed. Weights are stored as ``--dtypes`` (the trainer's float32 masters, or converted to
bf16 on push). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch


def random_batch(trainer: Any, vocab: int, seed: int, n: int = 8, length: int = 24) -> list[Any]:
    from rollart_core.types import Trajectory, Turn

    rng = random.Random(seed)
    out = []
    for i in range(n):
        ctx = [rng.randrange(3, vocab) for _ in range(length)]
        gen = [rng.randrange(3, vocab) for _ in range(length)]
        lps = trainer.logprobs(ctx + gen)[-len(gen) :]
        turn = Turn(context_ids=ctx, output_ids=gen, output_logprobs=lps, output_versions=[0] * len(gen))
        out.append(
            Trajectory(
                traj_id=f"{seed}-{i}",
                task="t",
                env_id="e",
                group_id=f"g{seed}",
                seed=i,
                start_version=0,
                turns=[turn],
                reward=rng.random(),
                fate=None,
                terminated=True,
            )
        )
    return out


def train_versions(model: Path, lr: float, steps: int) -> list[dict[str, torch.Tensor]]:
    """The weights before training and after each of ``steps`` optimizer steps at ``lr``."""
    from rollart_train import TorchTrainer, TorchTrainerConfig

    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    with TorchTrainer(TorchTrainerConfig(lr=lr), model_path=model) as trainer:
        versions = [{n: w.detach().clone() for n, w in trainer.named_weights()}]
        for s in range(steps):
            trainer.train_step(random_batch(trainer, vocab, seed=s))
            versions.append({n: w.detach().clone() for n, w in trainer.named_weights()})
    return versions


@contextmanager
def store_factory(kind: str) -> Iterator[Any]:
    """make(delta, dtype) -> (pusher, puller): two store objects of one back-end."""
    n = iter(range(10**6))
    with ExitStack() as stack:
        if kind == "filesystem":
            from rollart_weightsync import FilesystemWeightStore, FilesystemWeightStoreConfig

            root = Path(stack.enter_context(tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP"))))

            def make(delta: bool, dtype: str) -> tuple[Any, Any]:
                cfg = FilesystemWeightStoreConfig(root=root / f"s{next(n)}", delta=delta, dtype=dtype)
                return FilesystemWeightStore(cfg), FilesystemWeightStore(cfg)

        elif kind == "ray":
            from rollart_core.config import RayConfig
            from rollart_core.resources import RayCluster
            from rollart_weightsync import RayWeightStore

            stack.enter_context(RayCluster(RayConfig(num_cpus=2)))

            def make(delta: bool, dtype: str) -> tuple[Any, Any]:
                opts = {"name": f"delta-bench-{next(n)}", "delta": delta, "dtype": dtype}
                return RayWeightStore(**opts), RayWeightStore(**opts)

        else:
            from rollart_weightsync import MooncakeServerConfig, MooncakeStoreServer, MooncakeWeightStore

            servers: list[Any] = []
            stack.callback(lambda: [s.stop() for s in servers])

            def make(delta: bool, dtype: str) -> tuple[Any, Any]:
                # a fresh holder per store: an earlier store's versions stay in its holder's segment,
                # and a real model's versions from several stores do not fit one
                while servers:
                    servers.pop().stop()
                servers.append(MooncakeStoreServer(MooncakeServerConfig(segment_bytes=3 << 30)))
                servers[-1].start()
                cfg = servers[-1].store_config(prefix=f"bench/{next(n)}", delta=delta, dtype=dtype)
                return MooncakeWeightStore(cfg), MooncakeWeightStore(cfg)

        yield make


def same_bits(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], dtype: str) -> bool:
    dt = getattr(torch, dtype)
    for k, w in want.items():
        w = w.to(dt) if w.is_floating_point() else w
        if k not in got or got[k].dtype != w.dtype:
            return False
        if not torch.equal(
            got[k].reshape(-1).view(torch.uint8), w.contiguous().reshape(-1).view(torch.uint8)
        ):
            return False
    return len(got) == len(want)


def run_store(
    make: Any, delta: bool, dtype: str, versions: list[dict[str, torch.Tensor]]
) -> list[dict[str, Any]]:
    """Push and pull every version; per update: bytes fetched, seconds (push to commit, pull), exact."""
    pusher, puller = make(delta, dtype)
    rows = []
    try:
        for v, sd in enumerate(versions):
            before = puller.stats["delta_bytes"] + puller.stats["full_bytes"]
            t0 = time.perf_counter()
            pusher.push(v, sd).result(600)
            t1 = time.perf_counter()
            got = puller.pull(v)
            t2 = time.perf_counter()
            fetched = puller.stats["delta_bytes"] + puller.stats["full_bytes"] - before
            if not delta:
                fetched = puller.full_nbytes(v)
            rows.append(
                {
                    "version": v,
                    "bytes": fetched,
                    "push_s": t1 - t0,
                    "pull_s": t2 - t1,
                    "exact": same_bits(got, sd, dtype),
                }
            )
    finally:
        pusher.close()
        puller.close()
    return rows[1:]  # version 0 is every reader's first pull: full in both


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="HF model directory (default: the tiny model)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 3e-6, 1e-5])
    ap.add_argument("--stores", nargs="+", default=["filesystem", "ray", "mooncake"])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--out", default="delta_sync.json")
    args = ap.parse_args()

    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    tmp = tempfile.TemporaryDirectory()
    model = args.model
    if model is None:
        from rollart_train.tiny import create_tiny_model

        model = create_tiny_model(Path(tmp.name) / "tiny")
    trained = {lr: train_versions(model, lr, args.steps) for lr in args.lrs}
    results: list[dict[str, Any]] = []
    for kind in args.stores:
        with store_factory(kind) as make:
            for dtype in args.dtypes:
                for lr, versions in trained.items():
                    full = run_store(make, False, dtype, versions)
                    delta = run_store(make, True, dtype, versions)
                    for f, d in zip(full, delta, strict=True):
                        results.append(
                            {
                                "store": kind,
                                "dtype": dtype,
                                "lr": lr,
                                "version": f["version"],
                                "full_bytes": f["bytes"],
                                "delta_bytes": d["bytes"],
                                "ratio": f["bytes"] / max(d["bytes"], 1),
                                "full_s": f["push_s"] + f["pull_s"],
                                "delta_s": d["push_s"] + d["pull_s"],
                                "delta_push_s": d["push_s"],
                                "delta_pull_s": d["pull_s"],
                                "exact": f["exact"] and d["exact"],
                            }
                        )
    header = f"{'store':<11}{'dtype':<10}{'lr':>7}{'v':>3}{'full MB':>10}{'delta MB':>10}{'ratio':>8}{'full s':>8}{'delta s':>8}  exact"
    print(header)
    for r in results:
        print(
            f"{r['store']:<11}{r['dtype']:<10}{r['lr']:>7.0e}{r['version']:>3}{r['full_bytes'] / 1e6:>10.3f}"
            f"{r['delta_bytes'] / 1e6:>10.3f}{r['ratio']:>8.1f}{r['full_s']:>8.3f}{r['delta_s']:>8.3f}  {r['exact']}"
        )
    n_params = sum(t.numel() for t in next(iter(trained.values()))[0].values())
    out = {"model": str(args.model or "tiny"), "parameters": n_params, "steps": args.steps, "rows": results}
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")
    tmp.cleanup()
    if not all(r["exact"] for r in results):
        sys.exit("a pulled version differs from the pushed one")


if __name__ == "__main__":
    main()
