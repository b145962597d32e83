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
own (``load_client.py``: a client in this process would share rollart's GIL and event loop, not vLLM's). Reported:
rollart/vLLM for the round's wall time (1/throughput) and for the per-request latency, paired per
round. Goal: ≤ 1.1.

Dialects (``--no-dialects`` skips them): the same chat-with-tools requests written as OpenAI Responses
(``/v1/responses``: ``instructions``, ``input``, function tools) and as Anthropic Messages
(``/v1/messages``: ``system``, ``messages``, ``input_schema`` tools) to rollart's endpoint, from the
same client process, in a block of their own after the rounds above: ``--dialect-rounds`` rounds of
Chat Completions, Responses and Messages back to back, the order rotated every round (a multiple of
3 rounds: each dialect first, second and third equally often), nothing else running between them.
Checked: every dialect's requests have the same prompt and completion token counts as the chat ones
(the same rendered prompt). ``--stream`` streams them (each dialect's own events, read to the end).
Reported: each dialect / Chat Completions for the round's wall time and the per-request latency,
paired per round. Goal: ≤ 1.1.

Every variant's garbage-collector pauses in this process (full collections of a heap that holds vLLM
and torch take ~0.5 s on 2 cores) are reported beside it: one landing in a round explains an outlier.
Writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import gc
import json
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

from load_client import LoadClient  # this folder (the script's): the load generator's process

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
CHAT_TOOLS = "rollart Chat Completions+tools"  # the dialect block's baseline
RESPONSES_TOOLS = "rollart Responses+tools"
MESSAGES_TOOLS = "rollart Messages+tools"
DIALECTS = (CHAT_TOOLS, RESPONSES_TOOLS, MESSAGES_TOOLS)
PATHS = dict.fromkeys((ROLLART_TOOLS, VLLM_TOOLS, CHAT_TOOLS), "/v1/chat/completions")
PATHS |= {RESPONSES_TOOLS: "/v1/responses", MESSAGES_TOOLS: "/v1/messages"}


class GcPauses:
    """The garbage collector's pauses in this process, counted against the variant running."""

    def __init__(self) -> None:
        self.current: str | None = None
        self.pause_s: dict[str, float] = {}
        self.full: dict[str, int] = {}
        self._t0 = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self.current is not None:
            name = self.current
            self.pause_s[name] = self.pause_s.get(name, 0.0) + time.perf_counter() - self._t0
            self.full[name] = self.full.get(name, 0) + (info["generation"] == 2)

    def close(self) -> None:
        gc.callbacks.remove(self._callback)


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
    prompt_tokens: dict[str, int] = {}
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
        CHAT_TOOLS: chat_bodies,
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
    if args.stream:  # the dialect block streams
        bodies[CHAT_TOOLS] = [
            {**b, "stream": True, "stream_options": {"include_usage": True}} for b in chat_bodies
        ]
        for name in (RESPONSES_TOOLS, MESSAGES_TOOLS):
            bodies[name] = [{**b, "stream": True} for b in bodies[name]]

    def chat_tools(name: str, url: str) -> Any:
        async def variant() -> int:
            n = next(counter)  # one session per request, as an agent's trajectory has
            headers = [{"X-Session-Id": f"c{n}-{i}"} for i in range(args.requests)]
            _, lat, prompt, completion = await load.round(url, PATHS[name], bodies[name], headers)
            latencies[name].append(lat)
            prompt_tokens[name] = int(prompt)
            return int(completion)

        return variant

    variants = {"direct engine": direct, "LLMProxy": via_proxy, "proxy HTTP (OpenAI)": via_http}
    if vllm_server is not None:
        await wait_ready(vllm_server, vllm_url, vllm_log)
        variants[ROLLART_TOOLS] = chat_tools(ROLLART_TOOLS, rollart_url)
        variants[VLLM_TOOLS] = chat_tools(VLLM_TOOLS, vllm_url)
    gc_pauses = GcPauses()

    async def interleaved(
        variants: dict[str, Any], rounds: int, label: str
    ) -> tuple[dict[str, list[float]], dict[str, int]]:
        """Each variant once to warm up (prefix cache, compiled paths, connections), then ``rounds``
        rounds of all of them back to back, the order rotated every round."""
        for fn in variants.values():
            await fn()
        for name in variants:
            latencies.get(name, []).clear()
        times: dict[str, list[float]] = {k: [] for k in variants}
        tokens: dict[str, int] = {}
        names = list(variants)
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                gc_pauses.current = name
                t0 = time.perf_counter()
                tokens[name] = await variants[name]()
                times[name].append(time.perf_counter() - t0)
                gc_pauses.current = None
            print(f"{label} round {r + 1}/{rounds}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()),
                  file=sys.stderr, flush=True)  # fmt: skip
        return times, tokens

    times, tokens = await interleaved(variants, args.rounds, "engine/proxy")
    names = list(variants)
    if args.dialects:
        dialect_variants = {name: chat_tools(name, rollart_url) for name in DIALECTS}
        dialect_times, dialect_tokens = await interleaved(dialect_variants, args.dialect_rounds, "dialects")
    gc_pauses.close()
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
            "gc_pause_s": gc_pauses.pause_s.get(name, 0.0),
            "gc_full_collections": gc_pauses.full.get(name, 0),
        }
    for name in names:
        if latencies.get(name):
            flat = sorted(x for lat in latencies[name] for x in lat)
            result["variants"][name]["latency_median_s"] = statistics.median(flat)
            result["variants"][name]["latency_p90_s"] = flat[int(0.9 * (len(flat) - 1))]
    if args.dialects:
        result["dialects"] = {"rounds": args.dialect_rounds, "stream": args.stream, "variants": {}}
        for name in DIALECTS:
            flat = sorted(x for lat in latencies[name] for x in lat)
            result["dialects"]["variants"][name] = {
                "median_s": statistics.median(dialect_times[name]),
                "times_s": dialect_times[name],
                "latency_median_s": statistics.median(flat),
                "latency_p90_s": flat[int(0.9 * (len(flat) - 1))],
                "prompt_tokens": prompt_tokens[name],
                "completion_tokens": dialect_tokens[name],
                "gc_pause_s": gc_pauses.pause_s.get(name, 0.0),
                "gc_full_collections": gc_pauses.full.get(name, 0),
            }
        ct, cl = dialect_times[CHAT_TOOLS], [statistics.median(x) for x in latencies[CHAT_TOOLS]]
        result["dialects_vs_chat"] = {}
        for name in (RESPONSES_TOOLS, MESSAGES_TOOLS):
            dl = [statistics.median(x) for x in latencies[name]]
            d = {
                "round_time_ratio": statistics.median(
                    a / b for a, b in zip(dialect_times[name], ct, strict=True)
                ),
                "latency_ratio": statistics.median(a / b for a, b in zip(dl, cl, strict=True)),
                "same_tokens": dialect_tokens[name] == dialect_tokens[CHAT_TOOLS]
                and prompt_tokens[name] == prompt_tokens[CHAT_TOOLS],
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
        "--dialect-rounds",
        type=int,
        default=12,
        help="rounds of the dialect block (a multiple of 3: each dialect in each place equally often)",
    )
    p.add_argument("--stream", action="store_true", help="the dialect block streams its requests")
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
    if args.dialect_rounds < 3 or args.dialect_rounds % 3:
        p.error(f"--dialect-rounds must be a positive multiple of 3, got {args.dialect_rounds}")
    if args.rounds < 1 or args.requests < 1 or args.max_tokens < 1:
        p.error("--rounds, --requests and --max-tokens must be >= 1")
    res = asyncio.run(run(args))
    print(
        f"\nproxy overhead — {res['requests']} concurrent requests × {res['max_tokens']} tokens, "
        f"{res['rounds']} interleaved rounds"
    )
    print(
        f"{'variant':<22}{'median s':>10}{'tokens/s':>11}{'× direct (paired)':>19}{'× direct (medians)':>20}"
        f"{'GC pauses s':>13}"
    )
    for name, v in res["variants"].items():
        print(
            f"{name:<22}{v['median_s']:>10.3f}{v['tokens_per_s']:>11.0f}{v['ratio_to_direct']:>19.3f}"
            f"{v['ratio_of_medians']:>20.3f}{v['gc_pause_s']:>13.2f}"
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
        vs = res["dialects"]["variants"]
        print(
            f"\nrollart's dialects vs its Chat Completions, the same requests with tools "
            f"({res['dialects']['rounds']} rounds of their own{', streamed' if res['dialects']['stream'] else ''}):\n"
            f"{'variant':<32}{'median s':>10}{'latency p50':>13}{'× chat round':>14}{'× chat latency':>16}"
            f"{'GC pauses s':>13}"
        )
        for name in DIALECTS:
            d = res["dialects_vs_chat"].get(name, {"round_time_ratio": 1.0, "latency_ratio": 1.0})
            print(
                f"{name:<32}{vs[name]['median_s']:>10.3f}{vs[name]['latency_median_s']:>13.3f}"
                f"{d['round_time_ratio']:>14.3f}{d['latency_ratio']:>16.3f}{vs[name]['gc_pause_s']:>13.2f}"
            )
        met = all(d["goal_met"] for d in res["dialects_vs_chat"].values())
        same = all(d["same_tokens"] for d in res["dialects_vs_chat"].values())
        print(f"goal ≤ 1.1 (paired): {'met' if met else 'NOT met'}; same tokens: {same}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
