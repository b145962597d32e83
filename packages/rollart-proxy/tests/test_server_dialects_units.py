"""The Responses (``/v1/responses``) and Messages (``/v1/messages``) dialects with the official
``openai`` and ``anthropic`` SDKs, on an in-process fake engine (``ScriptedEngine``, named as such:
it answers each request with the next scripted text) behind the real proxy and the real endpoint
app (the tiny model's real chat template and tokenizer, vLLM's real ``hermes`` parser): tool calls
and their results over several turns, plain and streaming, each turn's prompt spliced from the
earlier replies' sampled ids (it extends the previous prompt + output exactly), a session that
mixes the three dialects, previous_response_id, and bad input in each dialect's own 4xx shape with
nothing recorded. The same against a real vLLM engine: ``integration/tests/test_proxy_dialects.py``."""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollart_core.types import GenerateOutput, GenerateRequest
from rollart_proxy import LLMProxy, WorkerHandle

CALL = '<tool_call>\n{"name":"add","arguments":{"a":2,"b":3}}\n</tool_call>'  # compact: unlike json.dumps
FN = {
    "name": "add",
    "description": "a + b",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
}
RESPONSES_TOOLS = [{"type": "function", **FN}]
MESSAGES_TOOLS = [{"name": "add", "description": "a + b", "input_schema": FN["parameters"]}]
CHAT_TOOLS = [{"type": "function", "function": FN}]


class ScriptedEngine:
    """A fake engine: each request gets the next text of ``script`` as token ids (plus the end of
    turn), logprob -0.25, version 3; ``seen`` keeps every request's prompt and output ids."""

    def __init__(self, encode: Any, eos: int) -> None:
        self.encode, self.eos = encode, eos
        self.script: list[str] = []
        self.seen: list[tuple[str | None, list[int], list[int]]] = []
        self.is_started = True

    async def start(self) -> str:
        return "scripted"

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        text = self.script.pop(0) if self.script else "ok"
        ids = [*self.encode(text), self.eos][: request.sampling.max_tokens]
        finish = "stop" if ids[-1] == self.eos else "length"
        self.seen.append((request.session_id, list(request.prompt_ids), ids))
        return GenerateOutput(request.request_id, ids, [-0.25] * len(ids), [3] * len(ids), finish, "scripted")

    async def generate_stream(self, request: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        out = await self.generate(request)
        for t in out.token_ids:
            yield GenerateOutput(out.request_id, [t], [-0.25], [3], "", out.worker)
        yield out

    async def abort(self, request_id: str) -> None:
        return None

    async def weight_version(self) -> int:
        return 3

    async def update_weights(self, version: int) -> float:
        return 0.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rollart_train.tiny import create_tiny_model

    return create_tiny_model(tmp_path_factory.mktemp("dialects") / "tiny")


@pytest.fixture
async def served(model_dir: Path) -> AsyncIterator[tuple[Any, ScriptedEngine, httpx.AsyncClient]]:
    from rollart_proxy.server import OpenAIServer
    from rollart_proxy.server.chat_template import ChatTemplate

    template = ChatTemplate(model_dir)
    assert template.eos_token_id is not None
    engine = ScriptedEngine(template.encode, template.eos_token_id)
    server = OpenAIServer(
        LLMProxy([WorkerHandle("scripted", engine)]), str(model_dir), served_model_name="tiny", api_key="k"
    )
    http = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=server.app),
        base_url="http://t",
        headers={"authorization": "Bearer k"},
    )
    try:
        yield server, engine, http
    finally:
        await http.aclose()


def openai_client(http: httpx.AsyncClient, session: str) -> Any:
    import openai

    return openai.AsyncOpenAI(
        base_url="http://t/v1",
        api_key="k",
        http_client=http,
        max_retries=0,
        default_headers={"X-Session-Id": session},
    )


def anthropic_client(server: Any, session: str) -> Any:
    """Anthropic's SDK over its own HTTP package (``httpx2``), in process."""
    import anthropic
    import httpx2

    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=server.app), base_url="http://t")
    return anthropic.AsyncAnthropic(
        base_url="http://t",
        api_key="k",
        http_client=http,
        max_retries=0,
        default_headers={"X-Session-Id": session},
    )


def assert_exact(server: Any, engine: ScriptedEngine, session: str, turns: int) -> None:
    """The session's records are the engine's prompts and outputs, and each prompt is the previous
    prompt + output + the new messages' tokens: one sequence, no earlier token re-tokenised."""
    calls = server.recorder.get(session)
    seen = [s for s in engine.seen if s[0] == session]
    assert [(c["prompt_ids"], c["output_ids"]) for c in calls] == [(p, o) for _, p, o in seen]
    assert len(calls) == turns
    for before, after in itertools.pairwise(calls):
        history = before["prompt_ids"] + before["output_ids"]
        assert after["prompt_ids"][: len(history)] == history
    assert all(c["versions"] == [3] * len(c["output_ids"]) for c in calls)


async def test_responses_tool_session_plain_and_streaming(served: Any) -> None:
    server, engine, http = served
    client = openai_client(http, "resp-1")
    engine.script = [CALL, "the sum is 5", CALL, "done"]
    r = await client.responses.create(
        model="tiny",
        instructions="use the tool",
        input="2 + 3?",
        tools=RESPONSES_TOOLS,
        max_output_tokens=256,
    )
    assert r.status == "completed" and [o.type for o in r.output] == ["function_call"]
    call = r.output[0]
    assert (call.name, json.loads(call.arguments)) == ("add", {"a": 2, "b": 3})
    assert r.usage is not None and r.usage.output_tokens == len(engine.seen[-1][2])
    history: list[Any] = [{"role": "user", "content": "2 + 3?"}, *r.output]
    history.append({"type": "function_call_output", "call_id": call.call_id, "output": "5"})
    r2 = await client.responses.create(
        model="tiny", instructions="use the tool", input=history, tools=RESPONSES_TOOLS, max_output_tokens=256
    )
    assert r2.output_text == "the sum is 5" and r2.output[0].type == "message"
    history += [*r2.output, {"role": "user", "content": "again"}]
    # streaming, through the SDK's own event accumulator
    async with client.responses.stream(
        model="tiny", instructions="use the tool", input=history, tools=RESPONSES_TOOLS, max_output_tokens=256
    ) as stream:
        kinds = [e.type async for e in stream]
        r3 = await stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.done" in kinds
    assert [o.type for o in r3.output] == ["function_call"]
    history += [*r3.output, {"type": "function_call_output", "call_id": r3.output[0].call_id, "output": "5"}]
    events = [
        e
        async for e in await client.responses.create(
            model="tiny", instructions="use the tool", input=history, tools=RESPONSES_TOOLS, stream=True
        )
    ]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "done" and events[-1].response.output_text == "done"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert_exact(server, engine, "resp-1", 4)
    await client.close()


async def test_messages_tool_session_plain_and_streaming(served: Any) -> None:
    server, engine, _ = served
    client = anthropic_client(server, "msg-1")
    engine.script = [CALL, "the sum is 5", "I will add." + CALL, "done"]
    messages: list[Any] = [{"role": "user", "content": "2 + 3?"}]
    m = await client.messages.create(
        model="tiny", system="use the tool", messages=messages, tools=MESSAGES_TOOLS, max_tokens=256
    )
    assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["tool_use"]
    use = m.content[0]
    assert (use.name, use.input) == ("add", {"a": 2, "b": 3})
    assert m.usage.input_tokens == len(engine.seen[-1][1]) and m.usage.output_tokens == len(
        engine.seen[-1][2]
    )
    messages += [
        {"role": "assistant", "content": m.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "5"}]},
    ]
    m2 = await client.messages.create(
        model="tiny", system="use the tool", messages=messages, tools=MESSAGES_TOOLS, max_tokens=256
    )
    assert m2.stop_reason == "end_turn" and m2.content[0].text == "the sum is 5"
    messages += [{"role": "assistant", "content": m2.content}, {"role": "user", "content": "again"}]
    async with client.messages.stream(
        model="tiny", system="use the tool", messages=messages, tools=MESSAGES_TOOLS, max_tokens=256
    ) as stream:
        m3 = await stream.get_final_message()
    assert m3.stop_reason == "tool_use" and [b.type for b in m3.content] == ["text", "tool_use"]
    assert m3.content[1].input == {"a": 2, "b": 3} and m3.usage.input_tokens == len(engine.seen[-1][1])
    messages += [
        {"role": "assistant", "content": m3.content},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": m3.content[1].id, "content": "5"}],
        },
    ]
    raw = await client.messages.create(
        model="tiny",
        system="use the tool",
        messages=messages,
        tools=MESSAGES_TOOLS,
        max_tokens=256,
        stream=True,
    )
    events = [e async for e in raw]
    assert events[0].type == "message_start" and events[-1].type == "message_stop"
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == "done"
    assert_exact(server, engine, "msg-1", 4)
    await client.close()


async def test_one_session_mixes_the_three_dialects(served: Any) -> None:
    """Chat → Messages → Responses in one session: each sends the earlier replies back in its own
    form, and the prompts stay one token-exact sequence."""
    server, engine, http = served
    oa, an = openai_client(http, "mix-1"), anthropic_client(server, "mix-1")
    engine.script = [CALL, "five", "ok"]
    chat = await oa.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "2 + 3?"}], tools=CHAT_TOOLS, max_tokens=256
    )
    tc = chat.choices[0].message.tool_calls[0]
    content = chat.choices[0].message.content or ""
    assistant = [{"type": "tool_use", "id": tc.id, "name": "add", "input": json.loads(tc.function.arguments)}]
    if content:
        assistant.insert(0, {"type": "text", "text": content})
    m = await an.messages.create(
        model="tiny",
        max_tokens=256,
        tools=MESSAGES_TOOLS,
        messages=[
            {"role": "user", "content": "2 + 3?"},
            {"role": "assistant", "content": assistant},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tc.id, "content": "5"}]},
        ],
    )
    assert m.content[0].text == "five"
    r = await oa.responses.create(
        model="tiny",
        tools=RESPONSES_TOOLS,
        input=[
            {"role": "user", "content": "2 + 3?"},
            *(
                [{"role": "assistant", "content": [{"type": "output_text", "text": content}]}]
                if content
                else []
            ),
            {"type": "function_call", "call_id": tc.id, "name": "add", "arguments": tc.function.arguments},
            {"type": "function_call_output", "call_id": tc.id, "output": "5"},
            {"role": "assistant", "content": "five"},
            {"role": "user", "content": "thanks"},
        ],
    )
    assert r.output_text == "ok"
    assert_exact(server, engine, "mix-1", 3)
    assert [c["endpoint"] for c in server.recorder.get("mix-1")] == ["chat"] * 3


async def test_previous_response_id_continues_the_conversation(served: Any) -> None:
    server, engine, http = served
    client = openai_client(http, "prev-1")
    engine.script = [CALL, "five"]
    r = await client.responses.create(model="tiny", input="2 + 3?", tools=RESPONSES_TOOLS)
    r2 = await client.responses.create(
        model="tiny",
        previous_response_id=r.id,
        tools=RESPONSES_TOOLS,
        input=[{"type": "function_call_output", "call_id": r.output[0].call_id, "output": "5"}],
    )
    assert r2.output_text == "five" and r2.previous_response_id == r.id
    assert_exact(server, engine, "prev-1", 2)
    # another API key's client may not continue it; store=false keeps nothing
    import openai

    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        await client.responses.create(model="tiny", previous_response_id="resp_nope", input="x")
    r3 = await client.responses.create(model="tiny", input="x", store=False)
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        await client.responses.create(model="tiny", previous_response_id=r3.id, input="y")
    await client.close()


async def test_stored_responses_are_retrieved_and_deleted(served: Any) -> None:
    """``GET /v1/responses/{id}`` gives back the Response object as returned (plain and streamed);
    ``DELETE`` drops it (retrieve and ``previous_response_id`` then fail); ``store: false``, an
    unknown id and another principal's response are 404s."""
    import openai

    server, engine, http = served
    client = openai_client(http, "store-1")
    engine.script = [CALL, "five", "hello"]
    r = await client.responses.create(model="tiny", input="2 + 3?", tools=RESPONSES_TOOLS)
    got = await client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    async with client.responses.stream(model="tiny", input="say five") as stream:
        streamed = await stream.get_final_response()
    kept = await client.responses.retrieve(streamed.id)  # the SDK's stream adds its own "parsed" fields
    assert (kept.id, kept.status, kept.output_text, kept.usage) == (
        streamed.id, streamed.status, "five", streamed.usage,
    )  # fmt: skip
    assert [(o.id, o.type) for o in kept.output] == [(o.id, o.type) for o in streamed.output]
    # another principal (a token bound to another session) does not see it
    token = server.bind_session("store-2")
    other = openai.AsyncOpenAI(
        base_url="http://t/v1", api_key=token, http_client=http, max_retries=0,
        default_headers={"X-Session-Id": "store-2"},
    )  # fmt: skip
    with pytest.raises(openai.NotFoundError, match=r.id):
        await other.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        await other.responses.delete(r.id)
    await client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.delete(r.id)
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        await client.responses.create(model="tiny", previous_response_id=r.id, input="x")
    unstored = await client.responses.create(model="tiny", input="x", store=False)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError, match="resp_nope"):
        await client.responses.retrieve("resp_nope")
    server.release_session(token)
    await other.close()
    await client.close()


BAD_RESPONSES = [
    ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "5"}]}, "call_id"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "web_search"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input_image"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "reasoning"),
    ({"input": [{"type": "web_search_call", "id": "w"}]}, "hosted tool"),
    ({"input": [{"role": "robot", "content": "x"}]}, "role"),
    ({"input": [{"type": "function_call", "call_id": "c"}]}, "function_call"),
    ({"input": [{"role": "user", "content": "x", "bogus": 1}]}, "unknown fields"),
    ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "structured output"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": "x", "bogus": 1}, "bogus"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": 5}, "input"),
]
BAD_MESSAGES = [
    (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "5"}],
                }
            ]
        },
        "tool_use_id",
    ),
    (
        {
            "messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "web_search_20250305", "name": "w"}],
        },
        "server tool",
    ),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
    (
        {"messages": [{"role": "user", "content": "x"}], "thinking": {"type": "enabled", "budget_tokens": 9}},
        "thinking",
    ),
    ({"messages": [{"role": "system", "content": "x"}]}, "role"),
    (
        {
            "messages": [
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t", "name": "add", "input": "x"}],
                }
            ]
        },
        "input",
    ),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": 1.5}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "sometimes"}}, "tool_choice"),
]


async def test_bad_input_gets_each_dialects_4xx_and_records_nothing(served: Any) -> None:
    server, engine, http = served
    hdr = {"X-Session-Id": "bad-1"}
    for body, words in BAD_RESPONSES:
        r = await http.post("/v1/responses", json={"model": "tiny", **body}, headers=hdr)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert words in err["message"] and err["type"] == "invalid_request_error", (body, err)
    for body, words in BAD_MESSAGES:
        r = await http.post("/v1/messages", json={"model": "tiny", "max_tokens": 8, **body}, headers=hdr)
        assert r.status_code == 400, (body, r.text)
        reply = r.json()
        assert reply["type"] == "error" and reply["error"]["type"] == "invalid_request_error", reply
        assert words in reply["error"]["message"], (body, reply)
    assert engine.seen == [] and server.recorder.get("bad-1") == []
    # unknown model, bad JSON, missing key: each dialect's shape
    r = await http.post(
        "/v1/messages",
        json={"model": "nope", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]},
    )
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = await http.post("/v1/messages", content=b"{nope", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["type"] == "error"
    r = await http.post("/v1/responses", content=b"[1]", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=server.app), base_url="http://t") as anon:
        r = await anon.post("/v1/messages", json={})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = await anon.post("/v1/messages", json={}, headers={"x-api-key": "wrong"})
        assert r.status_code == 401
    # the SDKs raise their own errors on them
    import anthropic
    import openai

    an = anthropic_client(server, "bad-2")
    with pytest.raises(anthropic.BadRequestError, match="image"):
        await an.messages.create(
            model="tiny",
            max_tokens=8,
            messages=[
                {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}
            ],
        )
    oa = openai_client(http, "bad-2")
    with pytest.raises(openai.BadRequestError, match="web_search"):
        await oa.responses.create(model="tiny", input="x", tools=[{"type": "web_search"}])
    assert engine.seen == []
