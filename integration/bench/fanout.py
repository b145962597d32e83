"""Fan-out of one weight version: N readers pull the same version at once, against one reader alone.

    uv run --no-sync python integration/bench/fanout.py [--mb 269] [--readers 1 4] [--rounds 3] \
        [--stores filesystem mooncake] [--node-cache] [--out runs/bench/fanout.json]

Each reader is a process of its own with its own store client, as each engine is. The version (bf16
tensors of ``--mb`` MB in 30 layers' shapes, SmolLM2-135M's size by default) is pushed once per store;
every round starts the readers, waits until each has connected, then lets them pull at the same moment
and takes each reader's pull time. A round's figure is its slowest reader (the moment every engine has
the version); the table gives the median over ``--rounds`` and the ratio N readers / 1 reader per store
(the goal: at most 1.5x for 4 readers). Ratios matter (the machine is shared and noisy).
``--node-cache`` measures each store behind the ``node_cache`` store too (one pull per node, shared
through ``/dev/shm``; a fresh, empty cache every round), with its ratio to the plain store's one reader.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any


def weights(mb: int) -> dict[str, Any]:
    import torch

    n = 30
    per = mb * (1 << 20) // 2 // n
    g = torch.Generator().manual_seed(0)
    return {f"layers.{i}.weight": torch.randn(per, generator=g).to(torch.bfloat16) for i in range(n)}


def open_store(kind: str, config: dict[str, Any], cache: dict[str, str] | None = None) -> Any:
    from rollart_weightsync import (
        FilesystemWeightStore,
        FilesystemWeightStoreConfig,
        MooncakeWeightStore,
        MooncakeWeightStoreConfig,
        NodeCacheWeightStore,
        NodeCacheWeightStoreConfig,
    )

    if cache is not None:  # readers that build their store from the same cache key share one pull
        node = NodeCacheWeightStoreConfig(store={"impl": kind, "options": config}, **cache)
        return NodeCacheWeightStore(node, inner=open_store(kind, config))
    if kind == "filesystem":
        return FilesystemWeightStore(FilesystemWeightStoreConfig(**config))
    return MooncakeWeightStore(MooncakeWeightStoreConfig(**config))


def reader(
    kind: str,
    config: dict[str, Any],
    cache: dict[str, str] | None,
    version: int,
    ready: Any,
    go: Any,
    out: Any,
) -> None:
    import blake3  # noqa: F401  (an engine has these loaded long before a pull: the pull alone is timed)
    import safetensors.torch  # noqa: F401
    import torch  # noqa: F401

    store = open_store(kind, config, cache)
    try:
        store.latest_version()  # connected
        ready.set()
        go.wait(120)
        t0 = time.perf_counter()
        tensors = store.pull(version)
        out.put((time.perf_counter() - t0, sum(t.numel() * t.element_size() for t in tensors.values())))
    finally:
        close = getattr(store, "close", None)
        if close is not None:
            close()


def one_round(kind: str, config: dict[str, Any], version: int, n: int, node_cache: bool) -> list[float]:
    ctx = mp.get_context("spawn")
    go, out = ctx.Event(), ctx.Queue()
    readies = [ctx.Event() for _ in range(n)]
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    cache_dir = tempfile.mkdtemp(prefix="rollart-fanout-", dir=shm) if node_cache else None
    cache = {"cache_dir": cache_dir, "cache_key": uuid.uuid4().hex} if cache_dir else None
    procs = [ctx.Process(target=reader, args=(kind, config, cache, version, r, go, out)) for r in readies]
    for p in procs:
        p.start()
    try:
        for r in readies:
            if not r.wait(120):
                raise RuntimeError(f"a {kind} reader did not connect within 120 s")
        go.set()
        times = [out.get(timeout=600)[0] for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
                p.join()
        if cache_dir:
            shutil.rmtree(cache_dir, ignore_errors=True)
    return times


def bench(
    kind: str, config: dict[str, Any], mb: int, readers: list[int], rounds: int, node_cache: bool
) -> dict[str, Any]:
    writer = open_store(kind, config)
    try:
        t0 = time.perf_counter()
        writer.push(1, weights(mb)).result(600)
        push_s = time.perf_counter() - t0
        res: dict[str, Any] = {"push_s": push_s, "readers": {}, "node_cache": {}}
        for cached in (False, True) if node_cache else (False,):
            key = "node_cache" if cached else "readers"
            for n in readers:
                slowest = [max(one_round(kind, config, 1, n, cached)) for _ in range(rounds)]
                res[key][n] = {"slowest_s": slowest, "median_s": statistics.median(slowest)}
                name = f"{kind}+node_cache" if cached else kind
                print(
                    f"{name:>21}  {n} reader(s): slowest pull {statistics.median(slowest):.2f} s (rounds {slowest})"
                )
        base = res["readers"][readers[0]]["median_s"]  # one engine alone, no cache
        for key in ("readers", "node_cache"):
            for r in res[key].values():
                r["ratio"] = r["median_s"] / base
        return res
    finally:
        close = getattr(writer, "close", None)
        if close is not None:
            close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=269)
    ap.add_argument("--readers", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--stores", nargs="+", default=["filesystem", "mooncake"], choices=["filesystem", "mooncake"]
    )
    ap.add_argument("--node-cache", action="store_true", help="also each store behind a node_cache store")
    ap.add_argument("--out", type=Path, default=Path("runs/bench/fanout.json"))
    args = ap.parse_args()
    results: dict[str, Any] = {"mb": args.mb, "rounds": args.rounds, "stores": {}}
    for kind in args.stores:
        if kind == "filesystem":
            with tempfile.TemporaryDirectory(prefix="rollart-fanout-") as root:
                results["stores"][kind] = bench(
                    kind, {"root": root}, args.mb, args.readers, args.rounds, args.node_cache
                )
        else:
            from rollart_weightsync import MooncakeServerConfig, MooncakeStoreServer

            segment = max(256 << 20, 2 * args.mb << 20)
            with MooncakeStoreServer(MooncakeServerConfig(segment_bytes=segment)) as server:
                config = server.store_config(bucket_bytes=16 << 20, keep_last=2).model_dump()
                results["stores"][kind] = bench(
                    kind, config, args.mb, args.readers, args.rounds, args.node_cache
                )
    print(f"\n{'store':>21}  " + "  ".join(f"{n} readers (s)  ratio" for n in args.readers))
    print(f"{'':>21}  (ratio: to the plain store's {args.readers[0]} reader(s))")
    for kind, r in results["stores"].items():
        for key, name in (("readers", kind), ("node_cache", f"{kind}+node_cache")):
            if r[key]:
                cells = "  ".join(
                    f"{r[key][n]['median_s']:>13.2f}  {r[key][n]['ratio']:.2f}x" for n in args.readers
                )
                print(f"{name:>21}  {cells}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
