"""Proxy overhead: the same generation load through the LLMProxy (and through its OpenAI-compatible
HTTP endpoint) versus calling the vLLM engine directly, and rollart's OpenAI endpoint versus vLLM's own
OpenAI server on chat requests with tools, interleaved round by round in one run.

    uv run --no-sync python integration/bench/proxy_overhead.py --quick
    uv run --no-sync python integration/bench/proxy_overhead.py --rounds 9 --requests 64 --max-tokens 64

Load per round and variant: ``--requests`` concurrent requests of ``--max-tokens`` greedy tokens
each (EOS excluded, so every variant generates exactly the same tokens). The variant order rotates
every round; the table shows median wall time, tokens/s and the median per-round ratio to the
direct engine call (paired: the median over rounds of variant/direct; medians: ratio of the
median times). Goal: proxy ≤ 1.05 (paired).

rollart vs vLLM's server (``--no-vllm-server`` skips it): vLLM's own OpenAI server
(``python -m vllm.entrypoints.openai.api_server --enable-auto-tool-choice --tool-call-parser hermes``,
a process of its own, same tiny model, same engine settings) and rollart's endpoint
(:class:`rollart_proxy.server.OpenAIServer` over the LLMProxy, hermes parser) get the same chat
requests with ``tools`` (tool_choice auto, one session per request), from a client in a process of its
own (a client in this process would share rollart's GIL and event loop, not vLLM's). Reported:
rollart/vLLM for the round's wall time (1/throughput) and for the per-request latency, paired per
round. Goal: ≤ 1.1.

Dialects (``--no-dialects`` skips them): the same chat-with-tools requests written as OpenAI Responses
(``/v1/responses``: ``instructions``, ``input``, function tools) and as Anthropic Messages
(``/v1/messages``: ``system``, ``messages``, ``input_schema`` tools) to rollart's endpoint, from the
same client process; they render the same prompt. Reported: each dialect / Chat Completions for the
round's wall time and the per-request latency, paired per round. Goal: ≤ 1.1. Writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import multiprocessing
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

NO_EOS = tuple(range(10, 300))
MAX_MODEL_LEN = 1024  # the chat prompt with the tool block is ~480 tokens of the tiny tokenizer
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "Evaluate one arithmetic expression, e.g. 482 * 17",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
ROLLART_TOOLS = "rollart HTTP chat+tools"
VLLM_TOOLS = "vLLM server chat+tools"
RESPONSES_TOOLS = "rollart Responses+tools"
MESSAGES_TOOLS = "rollart Messages+tools"
PATHS = {ROLLART_TOOLS: "/v1/chat/completions", VLLM_TOOLS: "/v1/chat/completions"}
PATHS |= {RESPONSES_TOOLS: "/v1/responses", MESSAGES_TOOLS: "/v1/messages"}


def _client_main(conn: Any) -> None:
    """The load generator, in a process of its own: for each ``(url, path, bodies, headers)`` it receives,
    posts every body at once and answers ``(wall s, per-request latencies, completion tokens)``."""
    import httpx

    async def serve() -> None:
        clients: dict[str, httpx.AsyncClient] = {}
        while True:
            job = await asyncio.to_thread(conn.recv)
            if job is None:
                break
            url, path, bodies, headers = job
            if url not in clients:
                clients[url] = httpx.AsyncClient(
                    base_url=url,
                    trust_env=False,
                    timeout=600,
                    # idle connections dropped before the server's keep-alive timeout (5 s) closes them under us
                    limits=httpx.Limits(max_connections=len(bodies) + 8, keepalive_expiry=1.0),
                )
            client = clients[url]

            async def one(
                client: httpx.AsyncClient, url: str, path: str, body: dict[str, Any], h: dict[str, str]
            ) -> tuple[float, int]:
                t0 = time.perf_counter()
                r = await client.post(path, json=body, headers=h)
                if r.status_code != 200:
                    raise RuntimeError(f"{url}{path}: {r.status_code} {r.text[:500]}")
                usage = r.json()["usage"]  # Chat Completions' names, or the dialects' (output_tokens)
                return time.perf_counter() - t0, usage.get("completion_tokens", usage.get("output_tokens"))

            t0 = time.perf_counter()
            try:
                res = await asyncio.gather(
                    *(one(client, url, path, b, h) for b, h in zip(bodies, headers, strict=True))
                )
            except Exception as e:
                conn.send(("error", repr(e)))
                continue
            conn.send(("ok", (time.perf_counter() - t0, [r[0] for r in res], sum(r[1] for r in res))))
        for c in clients.values():
            await c.aclose()

    asyncio.run(serve())


class LoadClient:
    """Handle of the load-generating process."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_client_main, args=(child,), daemon=True)
        self.proc.start()

    async def round(
        self, url: str, path: str, bodies: list[dict[str, Any]], headers: list[dict[str, str]]
    ) -> Any:
        self.conn.send((url, path, bodies, headers))
        status, value = await asyncio.to_thread(self.conn.recv)
        if status != "ok":
            raise RuntimeError(f"load client: {value}")
        return value

    def close(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_vllm_server(
    model: Path, args: argparse.Namespace, log_path: Path
) -> tuple[subprocess.Popen[bytes], str]:
    """vLLM's own OpenAI server on ``model`` (the engine settings of the in-process engine), hermes
    tool parser on; ``vllm serve``'s console script is broken in the CPU build, hence ``-m``."""
    port = _free_port()
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--served-model-name", "tiny",
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(max(64, args.requests)),
        "--enforce-eager", "--seed", "0", "--distributed-executor-backend", "uni",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        "--disable-uvicorn-access-log",
    ]  # fmt: skip
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_HOST_IP": "127.0.0.1",  # its engine core's message queue on loopback too
    }
    log = open(log_path, "wb")  # the server's output, read if it fails
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    atexit.register(_stop_process, proc)
    return proc, f"http://127.0.0.1:{port}"


async def wait_ready(proc: subprocess.Popen[bytes], url: str, log_path: Path, timeout_s: float = 600) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(trust_env=False, timeout=5) as c:
        while True:
            if proc.poll() is not None:
                tail = log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"vLLM's server exited with {proc.returncode}:\n{tail}")
            try:
                if (await c.get(f"{url}/v1/models")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"vLLM's server did not answer within {timeout_s} s (log: {log_path})")
            await asyncio.sleep(0.5)


def _stop_process(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)  # its own session: the server and its engine-core child
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


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
    vllm_server = None
    if args.vllm_server:  # starts beside the in-process engine (a minute of imports and start-up)
        vllm_log = args.out.with_name(args.out.stem + "_vllm_server.log")  # kept: what it ran with
        vllm_log.parent.mkdir(parents=True, exist_ok=True)
        vllm_server, vllm_url = start_vllm_server(model, args, vllm_log)
    if args.vllm_server or args.dialects:
        load = LoadClient()
    engine = VllmEngine(
        VllmEngineConfig(max_model_len=MAX_MODEL_LEN, dtype="float32", max_num_seqs=max(64, args.requests)),
        model_path=str(model),
        name="e0",
    )
    await engine.start()
    proxy = LLMProxy([WorkerHandle("e0", engine, max_inflight=max(64, args.requests))])
    server = OpenAIServer(
        proxy, str(model), served_model_name="tiny", max_model_len=MAX_MODEL_LEN, tool_parser="hermes"
    )
    port = await server.start("127.0.0.1", 0)
    rollart_url = f"http://127.0.0.1:{port}"
    client = httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{port}",
        trust_env=False,
        timeout=600,
        limits=httpx.Limits(max_connections=args.requests + 8, keepalive_expiry=1.0),
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

    latencies: dict[str, list[list[float]]] = {k: [] for k in PATHS}
    chat_bodies = [
        {
            "model": "tiny",
            "messages": [
                {"role": "system", "content": "Compute the expression with the calc tool."},
                {"role": "user", "content": f"{20 + i % 200} * {i % 7 + 3} + {i}"},
            ],
            "tools": TOOLS,
            "tool_choice": "auto",
            "max_tokens": args.max_tokens,
            "temperature": 0.0,
            "allowed_token_ids": list(NO_EOS),
        }
        for i in range(args.requests)
    ]

    fn = TOOLS[0]["function"]
    bodies = {
        ROLLART_TOOLS: chat_bodies,
        VLLM_TOOLS: chat_bodies,
        RESPONSES_TOOLS: [
            {
                "model": "tiny",
                "instructions": b["messages"][0]["content"],
                "input": b["messages"][1]["content"],
                "tools": [{"type": "function", **fn}],
                "tool_choice": "auto",
                "max_output_tokens": args.max_tokens,
                "temperature": 0.0,
                "allowed_token_ids": list(NO_EOS),
            }
            for b in chat_bodies
        ],
        MESSAGES_TOOLS: [
            {
                "model": "tiny",
                "system": b["messages"][0]["content"],
                "messages": [b["messages"][1]],
                "tools": [
                    {"name": fn["name"], "description": fn["description"], "input_schema": fn["parameters"]}
                ],
                "tool_choice": {"type": "auto"},
                "max_tokens": args.max_tokens,
                "temperature": 0.0,
                "allowed_token_ids": list(NO_EOS),
            }
            for b in chat_bodies
        ],
    }

    def chat_tools(name: str, url: str) -> Any:
        async def variant() -> int:
            n = next(counter)  # one session per request, as an agent's trajectory has
            headers = [{"X-Session-Id": f"c{n}-{i}"} for i in range(args.requests)]
            _, lat, toks = await load.round(url, PATHS[name], bodies[name], headers)
            latencies[name].append(lat)
            return int(toks)

        return variant

    variants = {"direct engine": direct, "LLMProxy": via_proxy, "proxy HTTP (OpenAI)": via_http}
    if vllm_server is not None:
        await wait_ready(vllm_server, vllm_url, vllm_log)
        variants[ROLLART_TOOLS] = chat_tools(ROLLART_TOOLS, rollart_url)
        variants[VLLM_TOOLS] = chat_tools(VLLM_TOOLS, vllm_url)
    if args.dialects:
        for name in (ROLLART_TOOLS, RESPONSES_TOOLS, MESSAGES_TOOLS):
            variants[name] = chat_tools(name, rollart_url)
    for fn in variants.values():  # warm-up (prefix cache, compiled paths, connections)
        await fn()
    for lat in latencies.values():
        lat.clear()
    times: dict[str, list[float]] = {k: [] for k in variants}
    tokens: dict[str, int] = {}
    names = list(variants)
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            t0 = time.perf_counter()
            tokens[name] = await variants[name]()
            times[name].append(time.perf_counter() - t0)
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()),
              file=sys.stderr, flush=True)  # fmt: skip
    await client.aclose()
    await server.stop()
    await engine.shutdown()
    if vllm_server is not None or args.dialects:
        load.close()
    if vllm_server is not None:
        _stop_process(vllm_server)

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
    for name in names:
        if latencies.get(name):
            flat = sorted(x for lat in latencies[name] for x in lat)
            result["variants"][name]["latency_median_s"] = statistics.median(flat)
            result["variants"][name]["latency_p90_s"] = flat[int(0.9 * (len(flat) - 1))]
    if args.dialects:
        ct, cl = times[ROLLART_TOOLS], [statistics.median(x) for x in latencies[ROLLART_TOOLS]]
        result["dialects_vs_chat"] = {}
        for name in (RESPONSES_TOOLS, MESSAGES_TOOLS):
            dl = [statistics.median(x) for x in latencies[name]]
            d = {
                "round_time_ratio": statistics.median(a / b for a, b in zip(times[name], ct, strict=True)),
                "latency_ratio": statistics.median(a / b for a, b in zip(dl, cl, strict=True)),
                "same_tokens": tokens[name] == tokens[ROLLART_TOOLS],
            }
            d["goal_met"] = d["round_time_ratio"] <= 1.1 and d["latency_ratio"] <= 1.1
            result["dialects_vs_chat"][name] = d
    if vllm_server is not None:
        rt, vt = times[ROLLART_TOOLS], times[VLLM_TOOLS]
        rl = [statistics.median(x) for x in latencies[ROLLART_TOOLS]]
        vl = [statistics.median(x) for x in latencies[VLLM_TOOLS]]
        result["rollart_vs_vllm"] = {
            "round_time_ratio": statistics.median(a / b for a, b in zip(rt, vt, strict=True)),
            "latency_ratio": statistics.median(a / b for a, b in zip(rl, vl, strict=True)),
            "throughput_ratio": result["variants"][ROLLART_TOOLS]["tokens_per_s"]
            / result["variants"][VLLM_TOOLS]["tokens_per_s"],
            "same_tokens": tokens[ROLLART_TOOLS] == tokens[VLLM_TOOLS],
        }
        r = result["rollart_vs_vllm"]
        r["goal_met"] = r["round_time_ratio"] <= 1.1 and r["latency_ratio"] <= 1.1
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
    p.add_argument(
        "--no-vllm-server",
        dest="vllm_server",
        action="store_false",
        help="skip the comparison with vLLM's own OpenAI server (chat requests with tools)",
    )
    p.add_argument(
        "--no-dialects",
        dest="dialects",
        action="store_false",
        help="skip the Responses and Messages dialects (the same requests with tools) against Chat Completions",
    )
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
    if "rollart_vs_vllm" in res:
        r, vs = res["rollart_vs_vllm"], res["variants"]
        print(
            f"\nrollart's endpoint vs vLLM's own server, chat with tools (client in its own process):\n"
            f"{'variant':<26}{'median s':>10}{'tokens/s':>11}{'latency p50':>13}{'p90':>8}"
        )
        for name in (ROLLART_TOOLS, VLLM_TOOLS):
            v = vs[name]
            print(
                f"{name:<26}{v['median_s']:>10.3f}{v['tokens_per_s']:>11.0f}"
                f"{v['latency_median_s']:>13.3f}{v['latency_p90_s']:>8.3f}"
            )
        print(
            f"rollart/vLLM: round time {r['round_time_ratio']:.3f} (paired), latency {r['latency_ratio']:.3f} "
            f"(paired), throughput {r['throughput_ratio']:.3f}; goal ≤ 1.1: "
            f"{'met' if r['goal_met'] else 'NOT met'}; same tokens: {r['same_tokens']}"
        )
    if "dialects_vs_chat" in res:
        vs = res["variants"]
        print(
            f"\nrollart's dialects vs its Chat Completions, the same requests with tools:\n"
            f"{'variant':<26}{'median s':>10}{'latency p50':>13}{'× chat round':>14}{'× chat latency':>16}"
        )
        for name in (ROLLART_TOOLS, RESPONSES_TOOLS, MESSAGES_TOOLS):
            d = res["dialects_vs_chat"].get(name, {"round_time_ratio": 1.0, "latency_ratio": 1.0})
            print(
                f"{name:<26}{vs[name]['median_s']:>10.3f}{vs[name]['latency_median_s']:>13.3f}"
                f"{d['round_time_ratio']:>14.3f}{d['latency_ratio']:>16.3f}"
            )
        met = all(d["goal_met"] for d in res["dialects_vs_chat"].values())
        same = all(d["same_tokens"] for d in res["dialects_vs_chat"].values())
        print(f"goal ≤ 1.1 (paired): {'met' if met else 'NOT met'}; same tokens: {same}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
