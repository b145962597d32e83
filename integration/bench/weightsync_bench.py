"""Weight-sync benchmark: store bandwidth vs the machine's ceilings, and rollout stall per update.

    uv run --no-sync python integration/bench/weightsync_bench.py [--quick] [--out weightsync.json]

Part 1 — push+pull bandwidth of each back-end (memory, filesystem, ray, mooncake over TCP and through
shared memory) on the same weights, next to memcpy and loopback-TCP ceilings measured in the same run:
the steady state (best rounds after warm-up rounds, as in a run that pushes every step) and the
first, cold round (a fresh store faults in every page it writes).
Part 2 — generation pause per weight update on a real vLLM (CPU) engine while 8 requests generate:
async staged (pull from the Mooncake store and load into a shadow model in the background, then swap
in a short pause), async in place (pull in the background, vLLM's reload inside the pause), and a
synchronous baseline, where rollout waits for a torch.distributed gloo broadcast of the same
weights between two processes and then for the in-place load. The two async modes alternate
update by update on the same engine.
Prints a table and writes JSON. Ratios matter (the machine is shared and noisy).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

GB = 1e9


def weights(total_bytes: int, n: int = 16) -> dict[str, Any]:
    import torch

    per = total_bytes // 4 // n
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(per, generator=g) for i in range(n)}


def best(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def memcpy_gbps(nbytes: int, repeats: int) -> float:
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return nbytes / best(lambda: dst.copy_(src), repeats) / GB


def tcp_gbps(nbytes: int, repeats: int) -> float:
    """One TCP stream over 127.0.0.1 between two processes (sender is a child process)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    code = (
        f"import socket;s=socket.create_connection(('127.0.0.1',{port}));b=bytearray(8<<20)\n"
        f"for _ in range({repeats}):\n  s.recv(1);left={nbytes}\n"
        f"  while left>0: n=min(left,len(b)); s.sendall(memoryview(b)[:n]); left-=n\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code])
    conn, _ = srv.accept()
    buf = bytearray(8 << 20)
    times = []
    try:
        for _ in range(repeats):
            t0 = time.perf_counter()
            conn.sendall(b"x")
            left = nbytes
            while left > 0:
                got = conn.recv_into(buf, min(left, len(buf)))
                if got == 0:
                    raise RuntimeError("sender closed early")
                left -= got
            times.append(time.perf_counter() - t0)
    finally:
        conn.close()
        srv.close()
        child.wait(60)
    return nbytes / min(times) / GB


def store_bandwidth(
    name: str, store: Any, tensors: dict[str, Any], nbytes: int, repeats: int, warmup: int
) -> dict[str, Any]:
    """Best of ``repeats`` push/pull rounds after ``warmup`` rounds (steady state: a training run
    pushes every step, so the store's memory has been written before); the first round's figures
    are reported too (``cold``: a fresh store, every page faulted in on first write)."""
    import torch

    pushes, pulls = [], []
    k = next(iter(tensors))
    for v in range(1, warmup + repeats + 1):
        t0 = time.perf_counter()
        store.push(v, tensors).result(600)
        pushes.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        out = store.pull(v)
        pulls.append(time.perf_counter() - t0)
        assert torch.equal(out[k], tensors[k]), name
        del out  # as a receiver does once the weights are loaded
    push_s, pull_s = min(pushes[warmup:]), min(pulls[warmup:])
    return {
        "backend": name,
        "push_gbps": nbytes / push_s / GB,
        "pull_gbps": nbytes / pull_s / GB,
        "round_trip_gbps": nbytes / (push_s + pull_s) / GB,
        "push_s": push_s,
        "pull_s": pull_s,
        "cold_push_gbps": nbytes / pushes[0] / GB,
        "cold_pull_gbps": nbytes / pulls[0] / GB,
    }


def part1(nbytes: int, repeats: int, with_ray: bool, warmup: int = 3) -> dict[str, Any]:
    from rollart_weightsync import (
        FilesystemWeightStore,
        FilesystemWeightStoreConfig,
        MemoryWeightStore,
        MooncakeServerConfig,
        MooncakeStoreServer,
        MooncakeWeightStore,
    )

    tensors = weights(nbytes)
    res: dict[str, Any] = {
        "bytes": nbytes,
        "memcpy_gbps": memcpy_gbps(nbytes, repeats),
        "tcp_loopback_gbps": tcp_gbps(nbytes, repeats),
        "backends": [],
    }
    mem = MemoryWeightStore()
    res["backends"].append(store_bandwidth("memory", mem, tensors, nbytes, repeats, warmup))
    mem.close()
    with tempfile.TemporaryDirectory() as d:
        fs = FilesystemWeightStore(FilesystemWeightStoreConfig(root=Path(d), keep_last=1))
        res["backends"].append(store_bandwidth("filesystem", fs, tensors, nbytes, repeats, warmup))
        fs.close()
    # "mooncake": a regular client over TCP; "mooncake-shm": a dummy client of the holder run as
    # Mooncake's real client, through shared memory (same host only)
    for name, shm in (("mooncake", False), ("mooncake-shm", True)):
        # a short read lease: rounds follow each other at once here, and retention may only delete a
        # pulled version once its lease is over (the default 5 s would fill the segment)
        cfg = MooncakeServerConfig(
            segment_bytes=max(3 * nbytes + (64 << 20), 256 << 20), shared_memory=shm, lease_ttl_ms=200
        )
        with MooncakeStoreServer(cfg) as srv:
            mc = MooncakeWeightStore(srv.store_config(keep_last=1, bucket_bytes=8 << 20))
            res["backends"].append(store_bandwidth(name, mc, tensors, nbytes, repeats, warmup))
            mc.close()
    if with_ray:
        from rollart_core.config import RayConfig
        from rollart_core.resources import RayCluster
        from rollart_weightsync import RayWeightStore

        with RayCluster(RayConfig(num_cpus=2)):
            rs = RayWeightStore(name="bench", keep_last=1)
            res["backends"].append(store_bandwidth("ray", rs, tensors, nbytes, repeats, warmup))
            rs.close()
    for b in res["backends"]:
        b["round_trip_vs_tcp"] = b["round_trip_gbps"] / res["tcp_loopback_gbps"]
        b["pull_vs_tcp"] = b["pull_gbps"] / res["tcp_loopback_gbps"]
        b["push_vs_tcp"] = b["push_gbps"] / res["tcp_loopback_gbps"]
        b["round_trip_vs_memcpy"] = b["round_trip_gbps"] / res["memcpy_gbps"]
    return res


_GLOO = r"""
import sys, time, torch, torch.distributed as dist
rank, port, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
from safetensors.torch import load_file
sd = load_file(path) if rank == 0 else None
names = sorted(load_file(path)) if rank == 1 else sorted(sd)
meta = load_file(path)
times = []
for _ in range(int(sys.argv[4])):
    dist.barrier(); t0 = time.perf_counter()
    for n in names:
        t = sd[n] if rank == 0 else torch.empty_like(meta[n])
        dist.broadcast(t, src=0)
    dist.barrier(); times.append(time.perf_counter() - t0)
if rank == 1: print("BCAST", min(times), flush=True)
dist.destroy_process_group()
"""


def gloo_broadcast_s(state: dict[str, Any], repeats: int) -> float:
    from safetensors.torch import save_file

    from rollart_weightsync.mooncake_server import free_port

    with tempfile.TemporaryDirectory() as d:
        path = str(Path(d) / "w.safetensors")
        save_file({k: v.contiguous() for k, v in state.items()}, path)
        port = str(free_port())
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", _GLOO, str(r), port, path, str(repeats)],
                stdout=subprocess.PIPE,
                text=True,
            )
            for r in range(2)
        ]
        outs = [p.communicate(timeout=600)[0] for p in procs]
    line = [ln for ln in outs[1].splitlines() if ln.startswith("BCAST")]
    if not line:
        raise RuntimeError("gloo broadcast failed")
    return float(line[0].split()[1])


async def part2(updates: int, interval_s: float, workdir: Path) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from rollart_core.types import GenerateRequest, SamplingParams
    from rollart_proxy.engines.vllm_engine import VllmEngine, VllmEngineConfig
    from rollart_train.tiny import create_tiny_model
    from rollart_weightsync import MooncakeServerConfig, MooncakeStoreServer, MooncakeWeightStore

    model_dir = create_tiny_model(workdir / "tiny", dtype="float32")
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    nbytes = sum(t.numel() * t.element_size() for t in base.values())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    with MooncakeStoreServer(MooncakeServerConfig(segment_bytes=256 << 20)) as srv:
        store = MooncakeWeightStore(srv.store_config(keep_last=2))
        engine = VllmEngine(
            VllmEngineConfig(max_model_len=256, dtype="float32", max_num_seqs=16),
            model_path=str(model_dir),
            weight_store=store,
            name="bench",
        )
        await engine.start()
        stop = asyncio.Event()
        generated = 0

        async def rollout(i: int) -> None:
            nonlocal generated
            n = 0
            while not stop.is_set():
                out = await engine.generate(
                    GenerateRequest(
                        f"r{i}-{n}",
                        [1, 20, 30, 40],
                        SamplingParams(
                            max_tokens=32, temperature=1.0, seed=n, allowed_token_ids=tuple(range(10, 300))
                        ),
                    )
                )
                generated += len(out.token_ids)
                n += 1

        workers = [asyncio.create_task(rollout(i)) for i in range(8)]
        pauses: dict[str, list[float]] = {"staged": [], "in_place": []}
        pulls = []
        try:
            await asyncio.sleep(1.0)  # rollout reaches steady state
            for v in range(1, 2 * updates + 1):
                mode = "staged" if v % 2 else "in_place"  # interleaved: the same noise hits both
                engine.config = engine.config.model_copy(update={"weight_update": mode})
                state = {k: t + 0.001 * v for k, t in base.items()}
                store.push(v, state).result(600)
                t0 = time.perf_counter()
                await engine.prefetch_weights(v)  # pull (and stage), hidden behind rollout
                pulls.append(time.perf_counter() - t0)
                pauses[mode].append(await engine.update_weights(v))
            stats = await engine.get_stats()
        finally:
            stop.set()
            await asyncio.gather(*workers, return_exceptions=True)
            await engine.shutdown()
            store.close()
    bcast = gloo_broadcast_s(base, repeats=3)
    staged = sum(pauses["staged"]) / len(pauses["staged"])
    in_place = sum(pauses["in_place"]) / len(pauses["in_place"])
    sync_stall = bcast + in_place  # rollout waits for the broadcast, then loads in place
    return {
        "weight_bytes": nbytes,
        "updates_per_mode": updates,
        "update_interval_s": interval_s,
        "async_pause_s": staged,
        "async_in_place_pause_s": in_place,
        "async_prepare_s_hidden": sum(pulls) / len(pulls),
        "stage_s_hidden": stats["stage_s"] / max(1, stats["staged_updates"]),
        "staging_fallbacks": stats["staging_fallbacks"],
        "sync_broadcast_s": bcast,
        "sync_stall_s": sync_stall,
        "async_stall_pct_of_interval": 100 * staged / interval_s,
        "async_in_place_stall_pct_of_interval": 100 * in_place / interval_s,
        "sync_stall_pct_of_interval": 100 * sync_stall / interval_s,
        "sync_over_async_stall": sync_stall / staged,
        "in_place_over_staged": in_place / staged,
        "pauses": pauses,
        "tokens_generated": generated,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (about a minute)")
    ap.add_argument("--out", default="weightsync_bench.json")
    ap.add_argument("--no-ray", action="store_true", help="skip the Ray back-end")
    ap.add_argument(
        "--warmup", type=int, default=3, help="push/pull rounds before the measured ones (steady state)"
    )
    ap.add_argument("--no-vllm", action="store_true", help="skip part 2 (engine pause)")
    ap.add_argument(
        "--interval-s",
        type=float,
        default=10.0,
        help="training step (update) interval to compare stalls with",
    )
    args = ap.parse_args()
    nbytes = (64 << 20) if args.quick else (512 << 20)
    repeats = 2 if args.quick else 3
    result: dict[str, Any] = {
        "quick": args.quick,
        "part1": part1(nbytes, repeats, not args.no_ray, args.warmup),
    }
    p1 = result["part1"]
    print(
        f"\nPart 1: {nbytes >> 20} MiB of fp32 weights; ceilings: memcpy {p1['memcpy_gbps']:.2f} GB/s, "
        f"loopback TCP {p1['tcp_loopback_gbps']:.2f} GB/s; best of {repeats} rounds after {args.warmup} warm-up "
        f"rounds (cold: the first round, into a fresh store)"
    )
    print(
        f"{'backend':<13}{'push GB/s':>10}{'pull GB/s':>10}{'push+pull GB/s':>16}{'push/TCP':>10}{'pull/TCP':>10}"
        f"{'rt/TCP':>8}{'rt/memcpy':>10}{'cold push':>10}{'cold pull':>10}"
    )
    for b in p1["backends"]:
        print(
            f"{b['backend']:<13}{b['push_gbps']:>10.2f}{b['pull_gbps']:>10.2f}{b['round_trip_gbps']:>16.2f}"
            f"{b['push_vs_tcp']:>10.2f}{b['pull_vs_tcp']:>10.2f}{b['round_trip_vs_tcp']:>8.2f}"
            f"{b['round_trip_vs_memcpy']:>10.2f}{b['cold_push_gbps']:>10.2f}{b['cold_pull_gbps']:>10.2f}"
        )
    if not args.no_vllm:
        with tempfile.TemporaryDirectory() as d:
            p2 = asyncio.run(part2(3 if args.quick else 6, args.interval_s, Path(d)))
        result["part2"] = p2
        print(
            f"\nPart 2: vLLM engine, {p2['weight_bytes'] / 1e6:.1f} MB weights, {p2['updates_per_mode']} updates per mode "
            f"(interleaved), 8 requests generating throughout; update interval {p2['update_interval_s']} s"
        )
        print(f"{'mode':<44}{'stall/update s':>15}{'% of interval':>15}")
        print(
            f"{'async, staged (pull + load hidden, swap)':<44}{p2['async_pause_s']:>15.4f}{p2['async_stall_pct_of_interval']:>15.3f}"
        )
        print(
            f"{'async, in place (pull hidden, load paused)':<44}{p2['async_in_place_pause_s']:>15.4f}"
            f"{p2['async_in_place_stall_pct_of_interval']:>15.3f}"
        )
        print(
            f"{'sync (gloo broadcast, then load in place)':<44}{p2['sync_stall_s']:>15.4f}{p2['sync_stall_pct_of_interval']:>15.3f}"
        )
        print(
            f"hidden per update: prepare {p2['async_prepare_s_hidden']:.4f} s (staging {p2['stage_s_hidden']:.4f} s); "
            f"gloo broadcast: {p2['sync_broadcast_s']:.4f} s; in place/staged: {p2['in_place_over_staged']:.2f}x; "
            f"sync/staged: {p2['sync_over_async_stall']:.2f}x; staging fallbacks: {p2['staging_fallbacks']}"
        )
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
