"""The OpenAI server keeps its promises at its edge, on an in-process fake engine (named as such)
behind the real proxy and the real endpoint app (the tiny model's real tokenizer): session
ownership survives eviction pressure (a full table refuses with 429; an idle session goes whole and
its id stays its owner's), every numeric field is bounded (seed to int64, max_tokens by the context,
token ids by the vocabulary) with a 400 naming it, and a declared-but-unsent body gets 408 on a real
socket. The same server over a real vLLM engine: ``test_server_guard.py``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollart_core.types import GenerateOutput, GenerateRequest
from rollart_proxy import LLMProxy, WorkerHandle

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


class FakeEngine:
    """Answers every request with ``max_tokens`` copies of token 42 (version 1); records requests."""

    def __init__(self) -> None:
        self.requests: list[GenerateRequest] = []
        self.is_started = True

    async def start(self) -> str:
        return "fake"

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        self.requests.append(request)
        n = request.sampling.max_tokens
        return GenerateOutput(request.request_id, [42] * n, [-0.5] * n, [1] * n, "length", "fake")

    async def abort(self, request_id: str) -> None:
        pass

    async def weight_version(self) -> int:
        return 1

    async def update_weights(self, version: int) -> float:
        return 0.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rollart_train.tiny import create_tiny_model

    return create_tiny_model(tmp_path_factory.mktemp("limits") / "tiny")


Make = Callable[..., Any]


@pytest.fixture
async def make(model_dir: Path) -> AsyncIterator[Make]:
    from rollart_proxy.server import OpenAIServer

    clients: list[httpx.AsyncClient] = []

    def build(**kw: Any) -> tuple[Any, FakeEngine, Callable[[str | None], httpx.AsyncClient]]:
        engine = FakeEngine()
        kw.setdefault("api_key", "")
        server = OpenAIServer(
            LLMProxy([WorkerHandle("fake", engine)]), str(model_dir), served_model_name="tiny", **kw
        )

        def client(key: str | None) -> httpx.AsyncClient:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            c = httpx.AsyncClient(
                transport=httpx.ASGITransport(app=server.app), base_url="http://proxy", headers=headers
            )
            clients.append(c)
            return c

        return server, engine, client

    try:
        yield build
    finally:
        for c in clients:
            await c.aclose()


async def chat(client: httpx.AsyncClient, session: str | None = None, **body: Any) -> httpx.Response:
    headers = {"X-Session-Id": session} if session else {}
    return await client.post("/v1/chat/completions", json={**CHAT, **body}, headers=headers)


async def test_a_full_session_table_refuses_and_never_hands_a_session_over(make: Make) -> None:
    server, _, client = make(api_key="key-a,key-b", max_sessions=3, session_ttl_s=None)
    alice, bob = client("key-a"), client("key-b")
    for i in range(3):
        assert (await chat(alice, f"a{i}")).status_code == 200
    r = await chat(bob, "b0")
    assert r.status_code == 429 and "max_sessions=3" in r.json()["error"]["message"]
    assert r.headers["Retry-After"]
    for i in range(3):  # under pressure, every one of alice's sessions is still hers
        assert (await bob.get(f"/v1/sessions/a{i}")).status_code == 403
        assert (await chat(bob, f"a{i}")).status_code == 403
        calls = (await alice.get(f"/v1/sessions/a{i}")).json()["calls"]
        assert len(calls) == 1 and calls[0]["output_ids"] == [42, 42]
    assert (await alice.delete("/v1/sessions/a0")).status_code == 200  # ending one makes room
    assert (await chat(bob, "b0")).status_code == 200
    assert server.recorder.refused == 1


async def test_an_idle_session_goes_whole_and_its_id_stays_its_owners(make: Make) -> None:
    server, _, client = make(api_key="key-a,key-b", max_sessions=2, session_ttl_s=0.2)
    alice, bob = client("key-a"), client("key-b")
    assert (await chat(alice, "old")).status_code == 200
    assert (await chat(alice, "busy")).status_code == 200
    await asyncio.sleep(0.3)
    assert (await chat(alice, "busy")).status_code == 200  # used again: not idle
    assert (await chat(bob, "new")).status_code == 200  # takes the place of the idle one
    assert server.recorder.sizes() == {"recorded_sessions": 2, "owned_sessions": 2}
    assert (server.recorder.evicted, server.recorder.refused) == (1, 0)
    # the evicted session went whole (its records with it) and bob cannot take its id over
    assert (await bob.get("/v1/sessions/old")).status_code == 403
    assert (await chat(bob, "old")).status_code == 403
    assert (await alice.get("/v1/sessions/old")).json()["calls"] == []
    await asyncio.sleep(0.3)
    assert (await chat(alice, "old")).status_code == 200  # its owner may start it again
    assert len((await alice.get("/v1/sessions/old")).json()["calls"]) == 1


async def test_a_bound_session_is_never_evicted(make: Make) -> None:
    server, _, client = make(max_sessions=1, session_ttl_s=0.1)
    token = server.bind_session("agent-1")
    await asyncio.sleep(0.2)
    r = await chat(client(None), "other")
    assert r.status_code == 429
    assert (await chat(client(token), "agent-1")).status_code == 200
    assert len(server.release_session(token)["calls"]) == 1
    assert (await chat(client(None), "other")).status_code == 200


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        ({"seed": 2**63}, "seed", "less than or equal"),
        ({"seed": -(2**63) - 1}, "seed", "greater than or equal"),
        ({"seed": 10**40}, "seed", "less than or equal"),
        ({"max_tokens": 2**31}, "max_tokens", "less than or equal"),
        ({"max_tokens": 513}, "max_tokens", "exceeds the context of 512"),
        ({"max_completion_tokens": 10**12}, "max_completion_tokens", "less than or equal"),
        ({"top_k": 2**40}, "top_k", "less than or equal"),
        ({"allowed_token_ids": [5, 10**9]}, "allowed_token_ids", "outside the vocabulary"),
        ({"allowed_token_ids": [-1]}, "allowed_token_ids", "outside the vocabulary"),
        ({"stop_token_ids": [2**40]}, "stop_token_ids", "outside the vocabulary"),
        ({"n": 2, "seed": 2**63 - 1}, "seed", "64 bits"),
    ],
)
async def test_numbers_out_of_range_are_400_naming_the_field(
    make: Make, body: dict[str, Any], field: str, words: str
) -> None:
    _, engine, client = make(max_model_len=512)
    r = await chat(client(None), **body)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert field in message or r.json()["error"]["param"] == field, message
    assert words in message, message
    assert engine.requests == []  # nothing reached the engine


async def test_prompt_token_ids_are_bounded_by_the_vocabulary(make: Make) -> None:
    server, engine, client = make(max_model_len=512)
    vocab = server.template.vocab_size
    body = {"model": "tiny", "max_tokens": 1}
    for ids in ([1, vocab], [-3], [2**63]):
        r = await client(None).post("/v1/completions", json={**body, "prompt": ids})
        assert r.status_code == 400 and "outside the vocabulary" in r.text, (ids, r.text)
    assert engine.requests == []
    r = await client(None).post("/v1/completions", json={**body, "prompt": [1, vocab - 1]})
    assert r.status_code == 200, r.text


async def test_max_tokens_within_the_context_is_clamped_to_the_room_left(make: Make) -> None:
    _, engine, client = make(max_model_len=512)
    assert (await chat(client(None), max_tokens=512, seed=2**63 - 1)).status_code == 200
    (request,) = engine.requests
    assert request.sampling.max_tokens == 512 - len(request.prompt_ids)
    assert request.sampling.seed == 2**63 - 1


async def test_a_declared_but_unsent_body_gets_408(model_dir: Path) -> None:
    from rollart_proxy.server import OpenAIServer

    server = OpenAIServer(
        LLMProxy([WorkerHandle("fake", FakeEngine())]),
        str(model_dir),
        served_model_name="tiny",
        api_key="",
        body_timeout_s=0.3,
    )
    port = await server.start("127.0.0.1", 0)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 500\r\n\r\n{"
        )
        await writer.drain()
        head = await asyncio.wait_for(reader.readline(), timeout=10)
        assert b" 408 " in head, head
        writer.close()
        await writer.wait_closed()
    finally:
        await server.stop()
