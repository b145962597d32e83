"""Proxy overhead: the same generation load through the LLMProxy (and through its OpenAI-compatible
HTTP endpoint) versus calling the vLLM engine directly, interleaved round by round in one run.

    uv run --no-sync python integration/bench/proxy_overhead.py --quick
    uv run --no-sync python integration/bench/proxy_overhead.py --rounds 9 --requests 64 --max-tokens 64

Load per round and variant: ``--requests`` concurrent requests of ``--max-tokens`` greedy tokens
each (EOS excluded, so every variant generates exactly the same tokens). The variant order rotates
every round; the table shows median wall time, tokens/s and the median per-round ratio to the
direct engine call (paired: the median over rounds of variant/direct; medians: ratio of the
median times). Goal: proxy ≤ 1.05 (paired). Writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

NO_EOS = tuple(range(10, 300))


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    from rollart_core.types import GenerateRequest, SamplingParams
    from rollart_proxy import LLMProxy, WorkerHandle
    from rollart_proxy.engines.vllm_engine import VllmEngine, VllmEngineConfig
    from rollart_proxy.server import OpenAIServer
    from rollart_train.tiny import create_tiny_model

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    tmp = Path(tempfile.mkdtemp(prefix="proxy-bench-"))
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    model = create_tiny_model(tmp / "tiny", dtype="float32")
    engine = VllmEngine(
        VllmEngineConfig(max_model_len=512, dtype="float32", max_num_seqs=max(64, args.requests)),
        model_path=str(model),
        name="e0",
    )
    await engine.start()
    proxy = LLMProxy([WorkerHandle("e0", engine, max_inflight=max(64, args.requests))])
    server = OpenAIServer(proxy, str(model), served_model_name="tiny", max_model_len=512)
    port = await server.start("127.0.0.1", 0)
    client = httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{port}",
        trust_env=False,
        timeout=600,
        limits=httpx.Limits(max_connections=args.requests + 8),
    )
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, allowed_token_ids=NO_EOS)
    prompts = [[1, 20 + i % 200, 30, 40 + i % 7, 50] for i in range(args.requests)]
    counter = iter(range(10**9))

    async def direct() -> int:
        outs = await asyncio.gather(
            *(engine.generate(GenerateRequest(f"d{next(counter)}", p, sp)) for p in prompts)
        )
        return sum(len(o.token_ids) for o in outs)

    async def via_proxy() -> int:
        outs = await asyncio.gather(
            *(
                proxy.generate(GenerateRequest(f"p{next(counter)}", p, sp, session_id=f"s{i}"))
                for i, p in enumerate(prompts)
            )
        )
        return sum(len(o.token_ids) for o in outs)

    async def via_http() -> int:
        body = {
            "model": "tiny",
            "max_tokens": args.max_tokens,
            "temperature": 0.0,
            "allowed_token_ids": list(NO_EOS),
        }
        rs = await asyncio.gather(
            *(
                client.post("/v1/completions", json={**body, "prompt": p}, headers={"X-Session-Id": f"h{i}"})
                for i, p in enumerate(prompts)
            )
        )
        for r in rs:
            r.raise_for_status()
        return sum(r.json()["usage"]["completion_tokens"] for r in rs)

    variants = {"direct engine": direct, "LLMProxy": via_proxy, "proxy HTTP (OpenAI)": via_http}
    for fn in variants.values():  # warm-up (prefix cache, compiled paths, connections)
        await fn()
    times: dict[str, list[float]] = {k: [] for k in variants}
    tokens: dict[str, int] = {}
    names = list(variants)
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            t0 = time.perf_counter()
            tokens[name] = await variants[name]()
            times[name].append(time.perf_counter() - t0)
    await client.aclose()
    await server.stop()
    await engine.shutdown()

    base = times["direct engine"]
    result: dict[str, Any] = {
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "variants": {},
    }
    for name in names:
        ratios = [t / b for t, b in zip(times[name], base, strict=True)]
        med = statistics.median(times[name])
        result["variants"][name] = {
            "median_s": med,
            "times_s": times[name],
            "tokens": tokens[name],
            "tokens_per_s": tokens[name] / med,
            "ratio_to_direct": statistics.median(ratios),
            "ratio_of_medians": med / statistics.median(base),
        }
    result["proxy_overhead_pct"] = 100 * (result["variants"]["LLMProxy"]["ratio_to_direct"] - 1)
    result["http_overhead_pct"] = 100 * (result["variants"]["proxy HTTP (OpenAI)"]["ratio_to_direct"] - 1)
    result["goal_met"] = result["proxy_overhead_pct"] <= 5.0
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small size: 11 rounds of 32 requests × 32 tokens")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out", type=Path, default=Path("runs/bench/proxy_overhead.json"))
    args = p.parse_args()
    if args.quick:
        args.rounds, args.requests, args.max_tokens = 11, 32, 32
    res = asyncio.run(run(args))
    print(
        f"\nproxy overhead — {res['requests']} concurrent requests × {res['max_tokens']} tokens, "
        f"{res['rounds']} interleaved rounds"
    )
    print(
        f"{'variant':<22}{'median s':>10}{'tokens/s':>11}{'× direct (paired)':>19}{'× direct (medians)':>20}"
    )
    for name, v in res["variants"].items():
        print(
            f"{name:<22}{v['median_s']:>10.3f}{v['tokens_per_s']:>11.0f}{v['ratio_to_direct']:>19.3f}"
            f"{v['ratio_of_medians']:>20.3f}"
        )
    print(
        f"LLMProxy overhead: {res['proxy_overhead_pct']:+.1f}% (goal ≤ 5%: {'met' if res['goal_met'] else 'NOT met'}); "
        f"HTTP endpoint: {res['http_overhead_pct']:+.1f}%"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
