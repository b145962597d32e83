"""Prefill/decode disaggregation: time to first token and decode throughput, PD on vs off, for a
prefill-heavy and a decode-heavy mix, in one run; next to it the planner's roofline prediction
for GPUs (H800 prefill → H20 decode) at agentic lengths of the same mixes.

    uv run --no-sync python integration/bench/pd_bench.py --quick
    uv run --no-sync python integration/bench/pd_bench.py --rounds 5 --requests 16

Two vLLM (CPU) engines, a ``kv_producer`` and a ``kv_consumer`` sharing vLLM's ExampleConnector
store (a directory), serve every variant:

- ``off, 2 engines``: both engines as one pool, each request prefilled and decoded on one engine;
- ``off, 1 engine``: the decode engine alone;
- ``PD on``: prefill on the producer, KV through the store, decode on the consumer (PDRouter).

Per round and mix, ``--requests`` concurrent requests with fresh prompts (no cache hits across
variants); the variant order rotates every round. TTFT is the time to the first streamed token;
decode throughput is per request (tokens after the first / time after the first) and aggregate.

On CPU both engines share the same two cores and the KV moves through files: the numbers show the
mechanism's overhead (extra hop, KV write + read), not the GPU benefit, which comes from running
prefill on compute-optimised and decode on bandwidth-optimised devices (and from decode batches no
longer stalled by prefills) — the roofline table gives that prediction.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

NO_EOS = tuple(range(10, 300))
MIXES = {"prefill-heavy": (1536, 16), "decode-heavy": (160, 256)}
"""mix → (prompt tokens, output tokens) measured here with the tiny model."""
GPU_MIXES = {"prefill-heavy": (8000, 400), "decode-heavy": (2000, 8000)}
"""The same mixes at agentic lengths, for the roofline prediction (7B model)."""


def roofline(prompt: int, output: int) -> dict[str, Any]:
    """Planner's roofline for one request of the mix on a 7B model: H20 alone, H800 alone, H800→H20."""
    from rollart_core.plan.catalogue import DEFAULT_CATALOGUE
    from rollart_core.plan.planner import PD_MARGIN, decode_step, estimate, max_batch, prefill_seconds
    from rollart_core.plan.workload import ModelProfile, TaskProfile

    model = ModelProfile()
    task = TaskProfile(name="mix", prompt_tokens=prompt, output_tokens_per_turn=output)
    h800, h20 = DEFAULT_CATALOGUE["H800"], DEFAULT_CATALOGUE["H20"]
    ctx = task.mean_context()
    out: dict[str, Any] = {"model": "7B (planner default ModelProfile)"}
    for name, hw in (("H800", h800), ("H20", h20)):
        b = max_batch(ctx, model, hw, 256)
        step, bound = decode_step(b, ctx, model, hw)
        out[name] = {
            "ttft_ms": 1e3 * prefill_seconds(prompt, model, hw),
            "decode_tok_s_per_req": 1 / step,
            "decode_tok_s_per_device": b / step,
            "decode_bound": bound,
        }
    e800, e20 = estimate(task, model, "H800", h800), estimate(task, model, "H20", h20)
    if e800 is None or e20 is None:
        raise RuntimeError("the 7B model does not fit an H800/H20 in the catalogue")
    best = min(e800, e20, key=lambda e: e.cost)
    split = (e800.prefill_s * e800.price_per_hour + e20.decode_s * e20.price_per_hour) / 3600
    out["usd_per_1k_requests"] = {"H800": 1e3 * e800.cost, "H20": 1e3 * e20.cost, "PD H800→H20": 1e3 * split}
    out["pd_saving_vs_best_single"] = 1 - split / best.cost
    out["planner_chooses_pd"] = split < best.cost * (1 - PD_MARGIN)
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from rollart_core.types import GenerateRequest, SamplingParams
    from rollart_proxy import LLMProxy, WorkerHandle
    from rollart_proxy.engines.vllm_engine import VllmEngine, VllmEngineConfig
    from rollart_proxy.pd import PDConfig, PDRouter, shared_storage_kv_args
    from rollart_train.tiny import create_tiny_model

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    tmp = Path(tempfile.mkdtemp(prefix="pd-bench-"))
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    model = create_tiny_model(tmp / "tiny", dtype="float32")
    kv_dir = tmp / "kv"
    kv_dir.mkdir()

    def engine(name: str, role: Any) -> VllmEngine:
        cfg = VllmEngineConfig(
            max_model_len=2048,
            dtype="float32",
            max_num_seqs=max(16, args.requests),
            engine_args=shared_storage_kv_args(role, kv_dir),
        )
        return VllmEngine(cfg, model_path=str(model), name=name)

    pre, dec = engine("pre", "kv_producer"), engine("dec", "kv_consumer")
    await pre.start()
    await dec.start()
    on = PDRouter(
        LLMProxy([WorkerHandle("pre", pre, pool="prefill"), WorkerHandle("dec", dec, pool="decode")]),
        PDConfig(
            pools={"decode": "prefill"}, default_policy="on", min_pd_suffix_tokens=1, kv_store_dir=kv_dir
        ),
    )
    off2 = PDRouter(LLMProxy([WorkerHandle("pre", pre, pool="all"), WorkerHandle("dec", dec, pool="all")]))
    off1 = PDRouter(LLMProxy([WorkerHandle("dec", dec)]))
    variants = {"off, 2 engines": off2, "off, 1 engine": off1, "PD on": on}
    rng = random.Random(0)
    counter = iter(range(10**9))

    async def one(router: PDRouter, prompt: list[int], n: int) -> dict[str, float]:
        sp = SamplingParams(max_tokens=n, temperature=0.0, allowed_token_ids=NO_EOS)
        t0 = time.perf_counter()
        first = None
        out = None
        async for out in router.generate_stream(GenerateRequest(f"r{next(counter)}", prompt, sp)):  # noqa: B007
            if first is None:
                first = time.perf_counter()
        end = time.perf_counter()
        if out is None or first is None or len(out.token_ids) != n:
            raise RuntimeError(f"request ended with {out and len(out.token_ids)} of {n} tokens")
        return {"ttft": first - t0, "decode_tok_s": (n - 1) / max(end - first, 1e-9), "end": end}

    async def batch(router: PDRouter, mix: str) -> dict[str, Any]:
        plen, n = MIXES[mix]
        prompts = [[rng.randrange(10, 300) for _ in range(plen)] for _ in range(args.requests)]
        t0 = time.perf_counter()
        rs = await asyncio.gather(*(one(router, p, n) for p in prompts))
        wall = max(r["end"] for r in rs) - t0
        on.clear_kv_store()  # between batches nothing is in flight; keeps the store small
        return {
            "ttft": [r["ttft"] for r in rs],
            "decode_tok_s": [r["decode_tok_s"] for r in rs],
            "tokens_per_s": args.requests * n / wall,
        }

    for mix in MIXES:  # warm-up
        for router in variants.values():
            await batch(router, mix)
    raw: dict[str, dict[str, list[dict[str, Any]]]] = {m: {v: [] for v in variants} for m in MIXES}
    names = list(variants)
    for r in range(args.rounds):
        for mix in MIXES:
            for name in names[r % len(names) :] + names[: r % len(names)]:
                raw[mix][name].append(await batch(variants[name], mix))
    paths = dict(on.paths)
    await pre.shutdown()
    await dec.shutdown()

    result: dict[str, Any] = {
        "requests": args.requests,
        "rounds": args.rounds,
        "mixes": {},
        "pd_paths": paths,
        "note": "CPU: both engines share 2 cores and KV moves through files; the measured "
        "ratios are the mechanism's overhead, not the GPU benefit (see roofline)",
    }
    for mix, per in raw.items():
        plen, n = MIXES[mix]
        rows: dict[str, Any] = {}
        for name, batches in per.items():
            ttft = [t for b in batches for t in b["ttft"]]
            dts = [t for b in batches for t in b["decode_tok_s"]]
            rows[name] = {
                "ttft_ms_median": 1e3 * statistics.median(ttft),
                "ttft_ms_p90": 1e3 * statistics.quantiles(ttft, n=10)[-1] if len(ttft) > 1 else 1e3 * ttft[0],
                "decode_tok_s_per_req_median": statistics.median(dts),
                "tokens_per_s_median": statistics.median(b["tokens_per_s"] for b in batches),
            }
        base = rows["off, 2 engines"]
        for row in rows.values():
            row["ttft_x_off2"] = row["ttft_ms_median"] / base["ttft_ms_median"]
            row["decode_x_off2"] = row["decode_tok_s_per_req_median"] / base["decode_tok_s_per_req_median"]
            row["tokens_per_s_x_off2"] = row["tokens_per_s_median"] / base["tokens_per_s_median"]
        gp, gn = GPU_MIXES[mix]
        result["mixes"][mix] = {
            "prompt_tokens": plen,
            "output_tokens": n,
            "measured_cpu": rows,
            "roofline_gpu": {"prompt_tokens": gp, "output_tokens": gn, **roofline(gp, gn)},
        }
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--quick", action="store_true", help="small size: 3 rounds of 8 requests per mix and variant"
    )
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--out", type=Path, default=Path("runs/bench/pd_bench.json"))
    args = p.parse_args()
    if args.quick:
        args.rounds, args.requests = 3, 8
    res = asyncio.run(run(args))
    print(
        f"\nPD disaggregation — {res['requests']} concurrent requests per batch, {res['rounds']} rounds, "
        f"tiny model on CPU (shared-storage KV connector)"
    )
    print("NOTE: " + res["note"])
    for mix, m in res["mixes"].items():
        print(f"\n{mix}: {m['prompt_tokens']} prompt tokens → {m['output_tokens']} output tokens")
        print(
            f"{'variant':<17}{'TTFT ms':>9}{'p90':>8}{'× off2':>8}{'dec tok/s/req':>15}{'× off2':>8}"
            f"{'tok/s':>9}{'× off2':>8}"
        )
        for name, r in m["measured_cpu"].items():
            print(
                f"{name:<17}{r['ttft_ms_median']:>9.1f}{r['ttft_ms_p90']:>8.1f}{r['ttft_x_off2']:>8.2f}"
                f"{r['decode_tok_s_per_req_median']:>15.0f}{r['decode_x_off2']:>8.2f}"
                f"{r['tokens_per_s_median']:>9.0f}{r['tokens_per_s_x_off2']:>8.2f}"
            )
        g = m["roofline_gpu"]
        print(f"  roofline at {g['prompt_tokens']} → {g['output_tokens']} tokens, {g['model']}:")
        print(
            f"    TTFT H20 {g['H20']['ttft_ms']:.1f} ms vs H800 {g['H800']['ttft_ms']:.1f} ms "
            f"({g['H20']['ttft_ms'] / g['H800']['ttft_ms']:.1f}× faster prefill on H800); decode/device "
            f"H20 {g['H20']['decode_tok_s_per_device']:.0f} vs H800 {g['H800']['decode_tok_s_per_device']:.0f} tok/s"
        )
        c = g["usd_per_1k_requests"]
        print(
            f"    cost per 1k requests: H800 ${c['H800']:.3f}, H20 ${c['H20']:.3f}, PD H800→H20 ${c['PD H800→H20']:.3f} "
            f"(saves {100 * g['pd_saving_vs_best_single']:.0f}% vs best single class; planner picks PD: "
            f"{g['planner_chooses_pd']})"
        )
    print(f"\nPD router paths: {res['pd_paths']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
