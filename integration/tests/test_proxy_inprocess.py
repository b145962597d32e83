"""LLMProxy over two real in-process vLLM (CPU) engines: stickiness, least-outstanding, back-pressure,
suspend → weight update → resume without loss (per-token versions), abort of one trajectory, the
OpenAI-compatible endpoint with the ``openai`` client, bad requests, and a worker crash with retry.

Both engines live for the whole module (at most two engines at a time on this machine); the crash
test runs last because it shuts one of them down.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from rollart_core.errors import EngineError
from rollart_core.types import GenerateRequest, SamplingParams
from rollart_proxy import LLMProxy, WorkerHandle
from rollart_proxy.errors import WorkerUnavailableError

pytestmark = [pytest.mark.vllm, pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]

# token ids 10..300 contain no special token: generation never stops early on EOS
NO_EOS = tuple(range(10, 300))


async def until(cond: Callable[[], Awaitable[bool]], timeout: float = 120.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not await cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def req(
    rid: str, n: int = 8, *, session: str | None = None, prompt: list[int] | None = None, **sampling: Any
) -> GenerateRequest:
    sp = {"max_tokens": n, "temperature": 1.0, "seed": 0, "allowed_token_ids": NO_EOS, **sampling}
    return GenerateRequest(rid, prompt or [1, 20, 30, 40, 50], SamplingParams(**sp), session_id=session)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rollart_train.tiny import create_tiny_model

    return create_tiny_model(tmp_path_factory.mktemp("proxy-inproc") / "tiny", dtype="float32")


@pytest.fixture(scope="module")
async def engines(model_dir: Path) -> AsyncIterator[tuple[Any, Any, Any]]:
    from rollart_proxy.engines.vllm_engine import VllmEngine, VllmEngineConfig, vllm_ipc_dir
    from rollart_weightsync import MemoryWeightStore

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    store = MemoryWeightStore()
    cfg = VllmEngineConfig(max_model_len=512, dtype="float32", max_num_seqs=32, kv_cache_gib=1)
    a = VllmEngine(cfg, model_path=str(model_dir), weight_store=store, name="a")  # staged updates
    b = VllmEngine(
        cfg.model_copy(update={"weight_update": "in_place"}),
        model_path=str(model_dir),
        weight_store=store,
        name="b",
    )
    prev_env = os.environ.get("VLLM_RPC_BASE_PATH")
    ipc = None
    try:
        await asyncio.gather(a.start(), b.start())
        ipc = vllm_ipc_dir()
        assert ipc is not None and os.environ["VLLM_RPC_BASE_PATH"] == ipc
        assert os.listdir(ipc)  # vLLM's sockets are in our directory
        yield a, b, store
    finally:
        await a.shutdown()
        await b.shutdown()
    # vLLM's IPC sockets went into this process's directory (vLLM itself leaves them in the temp dir),
    # and the last engine's stop removed it and gave VLLM_RPC_BASE_PATH back (no other module's
    # in-process engine is alive now)
    assert ipc is not None and not os.path.exists(ipc) and vllm_ipc_dir() is None
    assert os.environ.get("VLLM_RPC_BASE_PATH") == prev_env


def two(engines: tuple[Any, Any, Any], **kw: Any) -> LLMProxy:
    a, b, _ = engines
    return LLMProxy([WorkerHandle("a", a, **kw), WorkerHandle("b", b, **kw)])


async def test_sticky_sessions_and_least_outstanding(engines: tuple[Any, Any, Any]) -> None:
    proxy = two(engines)
    # first turns of 6 trajectories at once: least-outstanding spreads them over both workers
    first = await asyncio.gather(*(proxy.generate(req(f"s{i}-t0", 4, session=f"s{i}")) for i in range(6)))
    owners = {f"s{i}": o.worker for i, o in enumerate(first)}
    assert set(owners.values()) == {"a", "b"}
    # later turns (prompt = history + new tokens) stay on the worker holding the prefix
    for turn in (1, 2):
        outs = await asyncio.gather(
            *(
                proxy.generate(
                    req(
                        f"s{i}-t{turn}", 4, session=f"s{i}", prompt=[1, 20, 30, 40, 50, *range(60, 60 + turn)]
                    )
                )
                for i in range(6)
            )
        )
        assert {f"s{i}": o.worker for i, o in enumerate(outs)} == owners
    # the sticky worker is gone → fallback to the other one, and the session follows it
    gone = owners["s0"]
    proxy.workers[gone].healthy = False
    out = await proxy.generate(req("s0-t3", 4, session="s0"))
    assert out.worker != gone and proxy.session_worker("s0") == out.worker
    proxy.workers[gone].healthy = True
    assert await proxy.check_health() == 0  # nothing was unhealthy any more


async def test_sticky_falls_back_when_overloaded(engines: tuple[Any, Any, Any]) -> None:
    proxy = two(engines, max_inflight=1)
    home = (await proxy.generate(req("o-t0", 2, session="o"))).worker
    blocker = asyncio.create_task(proxy.generate(req("o-blocker", 200, session="o")))
    await until(lambda: _true(proxy.workers[home].inflight == 1), what="the sticky worker to fill up")
    out = await proxy.generate(req("o-t1", 2, session="o"))
    assert out.worker != home  # sticky worker full → served elsewhere instead of queueing behind it
    assert (await blocker).worker == home


async def _true(v: bool) -> bool:
    return v


async def test_back_pressure_bounds_inflight(engines: tuple[Any, Any, Any]) -> None:
    a, _, _ = engines
    proxy = LLMProxy([WorkerHandle("a", a, max_inflight=2)])
    w = proxy.workers["a"]
    peak_inflight, peak_queued, peak_engine = 0, 0, 0
    tasks = [asyncio.create_task(proxy.generate(req(f"bp{i}", 24))) for i in range(6)]
    while not all(t.done() for t in tasks):
        peak_inflight = max(peak_inflight, w.inflight)
        peak_queued = max(peak_queued, w.metrics.queued)
        peak_engine = max(peak_engine, (await a.get_stats())["inflight"])
        await asyncio.sleep(0.005)
    outs = [t.result() for t in tasks]
    assert all(len(o.token_ids) == 24 for o in outs)
    assert peak_inflight == 2 and peak_engine <= 2 and peak_queued >= 3


async def test_suspend_update_resume_keeps_requests_and_stamps_versions(
    engines: tuple[Any, Any, Any], model_dir: Path
) -> None:
    import torch
    from safetensors.torch import load_file

    a, b, store = engines
    proxy = two(engines)
    new = {
        k: (v + 0.05 * torch.randn_like(v)) if v.is_floating_point() else v
        for k, v in load_file(str(model_dir / "model.safetensors")).items()
    }
    store.push(1, new).result(timeout=60)
    n = 240
    tasks = [asyncio.create_task(proxy.generate(req(f"u{i}", n, session=f"u{i}"))) for i in range(4)]

    async def all_started() -> bool:
        prog = {**await a.progress(), **await b.progress()}
        return len(prog) == 4 and min(prog.values()) >= 10

    await until(all_started, what="every request generating")
    await proxy.suspend()
    before = {**await a.progress(), **await b.progress()}
    paused = await proxy.update_weights(1)
    after = {**await a.progress(), **await b.progress()}
    assert after == before, "a weight update during suspend must not let generation continue"
    assert set(paused) == {"a", "b"} and await proxy.weight_versions() == {"a": 1, "b": 1}
    await proxy.resume()
    outs = await asyncio.gather(*tasks)
    for o in outs:
        assert o.finish_reason == "length" and len(o.token_ids) == n == len(o.logprobs) == len(o.versions)
        assert o.versions == sorted(o.versions) and o.start_version == 0 and o.end_version == 1, o.versions
    # the engines really serve the new weights (exact bytes, fused names aside)
    shape, _, raw = await a.read_parameter("model.embed_tokens.weight")
    assert torch.equal(
        torch.frombuffer(bytearray(raw), dtype=torch.float32).reshape(shape), new["model.embed_tokens.weight"]
    )
    m = await proxy.metrics()
    assert m["a"]["suspended_s"] > 0 and m["a"]["decode_tokens"] > 0 and "engine" in m["a"]


async def test_staged_update_serves_exactly_what_an_in_place_reload_serves(
    engines: tuple[Any, Any, Any],
) -> None:
    """Engine a builds the next weights in a shadow model while generating and swaps them in; engine b
    reloads in place. Same weights → the same tokens and logprobs, token for token, for two versions
    in a row (the second swap reuses the shadow, which then holds the first version's weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    a, b, store = engines
    probe = req("probe", 24, seed=5)  # a seeded request: both engines must agree before and after each update
    before = await a.generate(probe)
    assert (await b.generate(probe)).logprobs == before.logprobs
    v0 = await a.weight_version()
    ref = AutoModelForCausalLM.from_pretrained(a.model_path, dtype=torch.float32).state_dict()
    stats0 = (await a.get_stats())["staged_updates"]
    long = asyncio.create_task(a.generate(req("during-staging", 480, seed=6)))  # in flight across the updates
    await until(lambda: _progress_at_least(a, "during-staging", 5), what="the long request generating")
    outs = []
    for v in (v0 + 1, v0 + 2):
        g = torch.Generator().manual_seed(v)
        store.push(v, {k: t + 0.05 * torch.randn(t.shape, generator=g) for k, t in ref.items()}).result(
            timeout=60
        )
        await asyncio.gather(a.prefetch_weights(v), b.prefetch_weights(v))
        await asyncio.gather(a.update_weights(v), b.update_weights(v))
        oa, ob = await a.generate(probe), await b.generate(probe)
        assert oa.token_ids == ob.token_ids and oa.logprobs == ob.logprobs, f"version {v}: staged != in place"
        assert oa.versions == [v] * len(oa.versions)
        outs.append(oa)
    assert (
        outs[0].logprobs != before.logprobs and outs[1].logprobs != outs[0].logprobs
    )  # weights really changed
    stats = await a.get_stats()
    assert stats["staged_updates"] == stats0 + 2 and stats["staging_fallbacks"] == 0
    assert (await b.get_stats())["staged_updates"] == 0
    kept = await long
    assert kept.finish_reason == "length" and len(kept.token_ids) == 480  # nothing lost across the swaps
    assert kept.versions[0] == v0 and kept.versions == sorted(kept.versions)


async def _progress_at_least(engine: Any, rid: str, n: int) -> bool:
    return (await engine.progress()).get(rid, 0) >= n


async def test_abort_one_trajectory(engines: tuple[Any, Any, Any]) -> None:
    a, b, _ = engines
    proxy = two(engines)
    keep = asyncio.create_task(proxy.generate(req("keep-0", 120, session="keep")))
    kill = asyncio.create_task(proxy.generate(req("kill-0", 480, session="kill")))

    async def generating() -> bool:
        return (await a.progress()).get("kill-0", 0) + (await b.progress()).get("kill-0", 0) >= 5

    await until(generating, what="the doomed request generating")
    assert await proxy.abort("kill") == 1  # by trajectory (session) id
    killed, kept = await asyncio.gather(kill, keep)
    assert killed.finish_reason == "abort" and 5 <= len(killed.token_ids) < 480
    assert kept.finish_reason == "length" and len(kept.token_ids) == 120
    assert all(w.healthy for w in proxy.workers.values())  # an abort is not a failure


async def test_streaming_yields_deltas_then_the_complete_output_and_closing_aborts(
    engines: tuple[Any, Any, Any],
) -> None:
    a, b, _ = engines
    proxy = two(engines)
    whole = await proxy.generate(req("whole", 40, seed=11))
    parts = [p async for p in proxy.generate_stream(req("streamed", 40, seed=11))]
    deltas, final = parts[:-1], parts[-1]
    assert len(deltas) >= 2 and all(p.finish_reason == "" for p in deltas)  # really incremental
    assert final.finish_reason == "length" and final.token_ids == whole.token_ids  # same seed, same tokens
    assert [t for p in deltas for t in p.token_ids] == final.token_ids[
        : sum(len(p.token_ids) for p in deltas)
    ]
    # A client that goes away mid-stream frees the engine's slot (the request is aborted there).
    stream = proxy.generate_stream(req("gone", 480, seed=12))
    first = await anext(stream)
    assert first.token_ids and not first.finish_reason
    await stream.aclose()

    async def freed() -> bool:
        return "gone" not in await a.progress() and "gone" not in await b.progress()

    await until(freed, timeout=30, what="the abandoned stream to be aborted on its engine")
    assert all(w.inflight == 0 for w in proxy.workers.values())
    assert (await a.get_stats())["output_tokens"] + (await b.get_stats())["output_tokens"] > 0


async def test_abort_while_suspended_is_delivered_on_resume(engines: tuple[Any, Any, Any]) -> None:
    a, _, _ = engines
    proxy = LLMProxy([WorkerHandle("a", a)])
    task = asyncio.create_task(proxy.generate(req("frozen-0", 480, session="frozen")))

    async def generating() -> bool:
        return (await a.progress()).get("frozen-0", 0) >= 5

    await until(generating, what="the request generating")
    await proxy.suspend()
    assert await proxy.abort("frozen") == 1
    await proxy.resume()
    out = await asyncio.wait_for(task, 60)
    assert out.finish_reason == "abort" and 5 <= len(out.token_ids) < 480


async def test_bad_requests_are_engine_errors_not_retried(engines: tuple[Any, Any, Any]) -> None:
    proxy = two(engines)
    with pytest.raises(EngineError, match=r"out-of-vocab|allowed_token_ids"):
        await proxy.generate(req("bad-vocab", 4, allowed_token_ids=(10**6,)))
    with pytest.raises(EngineError, match="exceeds max_model_len"):
        await proxy.generate(req("bad-long", 4, prompt=[5] * 600))
    with pytest.raises(EngineError, match="stop strings"):
        await proxy.generate(req("bad-stop", 4, stop=("",)))
    assert all(w.healthy and w.metrics.failures == 0 for w in proxy.workers.values())
    # stop strings end the turn
    out = await proxy.generate(
        GenerateRequest(
            "stop-ok", [1, 20, 30], SamplingParams(max_tokens=200, temperature=1.0, seed=3, stop=("e",))
        )
    )
    assert out.finish_reason == "stop" and len(out.token_ids) < 200


async def test_openai_client_against_the_proxy_endpoint(
    engines: tuple[Any, Any, Any], model_dir: Path
) -> None:
    import httpx
    import openai

    from rollart_proxy.server import OpenAIServer

    proxy = two(engines)
    server = OpenAIServer(proxy, str(model_dir), served_model_name="tiny", max_model_len=512)
    port = await server.start("127.0.0.1", 0)
    base = f"http://127.0.0.1:{port}"
    try:
        client = openai.AsyncOpenAI(
            base_url=f"{base}/v1",
            api_key="unused",
            max_retries=0,
            default_headers={"X-Session-Id": "agent-1"},
        )
        messages: list[dict[str, str]] = [
            {"role": "system", "content": "you are an agent"},
            {"role": "user", "content": "move left"},
        ]
        workers = set()
        for _ in range(2):  # a two-turn conversation, like a black-box agent
            r = await client.chat.completions.create(
                model="tiny",
                messages=messages,
                max_tokens=8,
                logprobs=True,
                extra_body={"allowed_token_ids": list(NO_EOS)},
            )
            assert r.choices[0].finish_reason == "length" and len(r.choices[0].logprobs.content) == 8
            workers.add(r.model_extra["rollart"]["worker"])
            messages += [
                {"role": "assistant", "content": r.choices[0].message.content or ""},
                {"role": "user", "content": "again"},
            ]
        assert len(workers) == 1  # sticky across turns
        chunks = [
            c
            async for c in await client.chat.completions.create(
                model="tiny",
                messages=messages,
                max_tokens=24,
                stream=True,
                logprobs=True,
                extra_body={"allowed_token_ids": list(NO_EOS)},
            )
        ]
        assert chunks[-1].choices[0].finish_reason == "length"
        with_tokens = [c for c in chunks if c.choices[0].logprobs and c.choices[0].logprobs.content]
        assert len(with_tokens) >= 2  # token deltas as they are generated, not one chunk at the end
        assert sum(len(c.choices[0].logprobs.content) for c in with_tokens) == 24
        streamed_text = "".join(c.choices[0].delta.content or "" for c in chunks)
        comp = await client.completions.create(
            model="tiny",
            prompt=[1, 20, 30],
            max_tokens=5,
            logprobs=0,
            extra_body={"allowed_token_ids": list(NO_EOS)},
        )
        assert len(comp.choices[0].logprobs.token_logprobs) == 5
        async with httpx.AsyncClient(base_url=base, trust_env=False, timeout=60) as h:
            rec = (await h.get("/v1/sessions/agent-1")).json()["calls"]
            assert [c["endpoint"] for c in rec] == ["chat", "chat", "chat", "completions"]
            assert len(rec[2]["output_ids"]) == 24 and streamed_text == server.template.decode(
                rec[2]["output_ids"]
            )
            for c in rec:
                assert (
                    len(c["output_ids"]) == len(c["logprobs"]) == len(c["versions"]) > 0 and c["prompt_ids"]
                )
            assert rec[1]["prompt_ids"][: len(rec[0]["prompt_ids"])] == rec[0]["prompt_ids"]
            assert len((await h.post("/v1/sessions/agent-1/drain")).json()["calls"]) == 4
            assert (await h.get("/v1/sessions/agent-1")).json()["calls"] == []
            m = (await h.get("/metrics")).json()
            assert set(m) == {"a", "b"} and "queue_depth" in m["a"]
            # bad requests → 4xx with a message, never a hang
            bad = [
                (
                    "/v1/chat/completions",
                    {"model": "nope", "messages": [{"role": "user", "content": "x"}]},
                    404,
                ),
                ("/v1/chat/completions", {"model": "tiny", "messages": []}, 400),
                (
                    "/v1/chat/completions",
                    {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": -1},
                    400,
                ),
                ("/v1/completions", {"model": "tiny", "prompt": [5] * 600}, 400),
                ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 0}, 400),
                ("/v1/completions", {"model": "tiny", "prompt": [1, 2], "allowed_token_ids": [10**6]}, 400),
                ("/v1/completions", {"model": "tiny", "prompt": "x", "n": 17}, 400),
                ("/v1/completions", {"model": "tiny", "prompt": "x", "n": 2, "stream": True}, 400),
                ("/v1/completions", {"model": "tiny", "prompt": "x", "bogus": 1}, 400),
            ]
            for path, body, status in bad:
                r = await h.post(path, json=body)
                assert r.status_code == status, (body, r.text)
                assert r.json()["error"]["message"]
            r = await h.post(
                "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
            )
            assert r.status_code == 400 and r.json()["error"]["message"]
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="nope", messages=messages)
        with pytest.raises(openai.BadRequestError):
            await client.completions.create(model="tiny", prompt="x", max_tokens=5, temperature=7)
        await client.close()
    finally:
        await server.stop()


async def test_worker_crash_requests_retried_on_the_other_worker(engines: tuple[Any, Any, Any]) -> None:
    """Runs last in this module: it shuts engine b down."""
    a, b, _ = engines
    proxy = LLMProxy([WorkerHandle("a", a), WorkerHandle("b", b)], max_retries=1)
    tasks = [asyncio.create_task(proxy.generate(req(f"c{i}", 150))) for i in range(4)]

    async def b_busy() -> bool:
        return len(await b.progress()) >= 1 and min((await b.progress()).values()) >= 3

    await until(b_busy, what="requests running on b")
    on_b = set(await b.progress())
    await b.shutdown()  # the worker dies mid-request
    outs = await asyncio.gather(*tasks)
    assert all(o.finish_reason == "length" and len(o.token_ids) == 150 and o.worker == "a" for o in outs)
    assert on_b and not proxy.workers["b"].healthy and proxy.workers["b"].metrics.failures >= 1
    assert (await proxy.generate(req("after", 4))).worker == "a"  # the proxy keeps serving
    assert await proxy.check_health() == 0  # b stays out
    # a pool whose only worker is dead: the request fails after its retries with a clear error
    lone = LLMProxy([WorkerHandle("b", b)], max_retries=2, recover_wait_s=0.5, recover_poll_s=0.1)
    with pytest.raises(WorkerUnavailableError, match=r"none recovered within recover_wait_s"):
        await lone.generate(req("doomed", 4))
    assert json.dumps(await proxy.metrics())  # metrics still render with a dead worker
