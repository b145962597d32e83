"""The Responses and Messages dialects on a real vLLM CPU engine behind the proxy's uvicorn server on
127.0.0.1, with the official ``openai`` (``client.responses``) and ``anthropic`` SDKs: a multi-turn
tool-using session in each dialect, plain and streaming, whose drained records are exactly the
engine's prompts and outputs and assemble into one token-exact trajectory; a stream the client
drops is closed down to the proxy's stream (whose closing aborts the request) and records nothing;
malformed input gets the dialect's 4xx.

A random tiny model does not write tool calls: ``Forcing`` makes the scripted replies come out of
the real engine one token at a time (``max_tokens=1``, ``allowed_token_ids`` the next token of the
text), so ids, logprobs and versions are the engine's; unscripted turns are sampled freely.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from pathlib import Path
from typing import Any

import pytest

from rollart_core.types import GenerateOutput, GenerateRequest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(600),
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
RESPONSES_TOOLS = [{"type": "function", "name": "add", "description": "a + b", "parameters": SCHEMA}]
MESSAGES_TOOLS = [{"name": "add", "description": "a + b", "input_schema": SCHEMA}]
NO_EOS = list(range(10, 300))  # no special token among them: generation runs to max_tokens


class Forcing:
    """The real proxy; the next replies in ``script`` are forced through the engine token by token.
    ``seen`` keeps every request's session, prompt and output as the engine saw them."""

    def __init__(self, proxy: Any, encode: Any, eos: int) -> None:
        self.proxy, self.encode, self.eos = proxy, encode, eos
        self.script: list[str] = []
        self.seen: list[tuple[str | None, list[int], list[int]]] = []
        self.closed: list[str | None] = []
        """Sessions whose engine stream ended (finished or closed by the server)."""

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        if not self.script:
            out = await self.proxy.generate(request)
        else:
            ids: list[int] = []
            lps: list[float] = []
            vs: list[int] = []
            for k, tok in enumerate([*self.encode(self.script.pop(0)), self.eos]):
                step = request.sampling.model_copy(
                    update={"max_tokens": 1, "allowed_token_ids": (tok,), "stop_token_ids": ()}
                )
                one = await self.proxy.generate(
                    GenerateRequest(
                        f"{request.request_id}-{k}", request.prompt_ids + ids, step, request.session_id
                    )
                )
                ids += one.token_ids
                lps += one.logprobs
                vs += one.versions
            out = GenerateOutput(request.request_id, ids, lps, vs, "stop", one.worker)
        self.seen.append((request.session_id, list(request.prompt_ids), list(out.token_ids)))
        return out

    async def generate_stream(self, request: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        if not self.script:  # the engine's own stream; closing this one closes it (which aborts)
            try:
                async with aclosing(self.proxy.generate_stream(request)) as parts:
                    async for part in parts:
                        if part.finish_reason:
                            self.seen.append(
                                (request.session_id, list(request.prompt_ids), list(part.token_ids))
                            )
                        yield part
            finally:
                self.closed.append(request.session_id)
            return
        out = await self.generate(request)
        for i, t in enumerate(out.token_ids):
            yield GenerateOutput(out.request_id, [t], [out.logprobs[i]], [out.versions[i]], "", out.worker)
        yield out

    async def abort(self, request_id: str) -> int:
        return int(await self.proxy.abort(request_id))

    def end_session(self, session_id: str) -> None:
        self.proxy.end_session(session_id)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rollart_train.tiny import create_tiny_model

    return create_tiny_model(tmp_path_factory.mktemp("dialects") / "tiny", dtype="float32")


@pytest.fixture(scope="module")
async def served(model_dir: Path) -> AsyncIterator[tuple[Any, Forcing, Any, str]]:
    from rollart_proxy import LLMProxy, WorkerHandle
    from rollart_proxy.engines.vllm_engine import VllmEngine, VllmEngineConfig
    from rollart_proxy.server import OpenAIServer
    from rollart_proxy.server.chat_template import ChatTemplate
    from rollart_weightsync import MemoryWeightStore

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    engine = VllmEngine(
        VllmEngineConfig(max_model_len=1024, dtype="float32", max_num_seqs=16, kv_cache_gib=1),
        model_path=str(model_dir),
        weight_store=MemoryWeightStore(),
        name="a",
    )
    await engine.start()
    server = None
    try:
        t = ChatTemplate(model_dir)
        assert t.eos_token_id is not None
        forcing = Forcing(LLMProxy([WorkerHandle("a", engine)]), t.encode, t.eos_token_id)
        server = OpenAIServer(
            forcing,  # type: ignore[arg-type]
            str(model_dir),
            served_model_name="tiny",
            max_model_len=1024,
            api_key="key-1",
            admin_key="",
        )
        port = await server.start("127.0.0.1", 0)
        yield server, forcing, engine, f"http://127.0.0.1:{port}"
    finally:
        if server is not None:
            await server.stop()
        await engine.shutdown()


async def test_responses_tool_session_is_the_engines_exact_tokens(served: Any, model_dir: Path) -> None:
    import openai

    server, forcing, _, base = served
    client = openai.AsyncOpenAI(
        base_url=f"{base}/v1", api_key="key-1", max_retries=0, default_headers={"X-Session-Id": "resp-e"}
    )
    forcing.script = [CALL]
    ask = {"model": "tiny", "instructions": "use the tool", "tools": RESPONSES_TOOLS}
    r = await client.responses.create(**ask, input="2 + 3?", max_output_tokens=200)
    assert [o.type for o in r.output] == ["function_call"]
    assert json.loads(r.output[0].arguments) == {"a": 2, "b": 3}
    history: list[Any] = [
        {"role": "user", "content": "2 + 3?"},
        *r.output,
        {"type": "function_call_output", "call_id": r.output[0].call_id, "output": "5"},
    ]
    forcing.script = ["the sum is 5"]
    async with client.responses.stream(**ask, input=history, max_output_tokens=200) as stream:
        r2 = await stream.get_final_response()
    assert r2.output_text == "the sum is 5" and r2.usage is not None
    history += [*r2.output, {"role": "user", "content": "again"}]
    # free sampling from the engine's own stream: token deltas as they come
    events = [
        e
        async for e in await client.responses.create(
            **ask, input=history, max_output_tokens=12, stream=True, extra_body={"allowed_token_ids": NO_EOS}
        )
    ]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    final = events[-1]
    assert final.type == "response.incomplete" and final.response.usage.output_tokens == 12
    # with tools the text is only known at the end (it might hold a call): it comes in one delta
    assert "".join(deltas) == final.response.output_text
    calls = _check_records(server, forcing, "resp-e", 3)
    _one_sequence(calls, model_dir)
    await client.close()


async def test_messages_tool_session_is_the_engines_exact_tokens(served: Any, model_dir: Path) -> None:
    import anthropic

    server, forcing, _, base = served
    client = anthropic.AsyncAnthropic(
        base_url=base, api_key="key-1", max_retries=0, default_headers={"X-Session-Id": "msg-e"}
    )
    ask = {"model": "tiny", "system": "use the tool", "tools": MESSAGES_TOOLS, "max_tokens": 200}
    forcing.script = ["Adding." + CALL]
    async with client.messages.stream(**ask, messages=[{"role": "user", "content": "2 + 3?"}]) as stream:
        m = await stream.get_final_message()
    assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["text", "tool_use"]
    assert m.content[1].input == {"a": 2, "b": 3}
    messages: list[Any] = [
        {"role": "user", "content": "2 + 3?"},
        {"role": "assistant", "content": m.content},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": m.content[1].id, "content": "5"}],
        },
    ]
    forcing.script = ["five"]
    m2 = await client.messages.create(**ask, messages=messages)
    assert m2.stop_reason == "end_turn" and m2.content[0].text == "five"
    assert m2.usage.input_tokens == len(forcing.seen[-1][1])
    messages += [{"role": "assistant", "content": m2.content}, {"role": "user", "content": "again"}]
    m3 = await client.messages.create(
        **{**ask, "max_tokens": 12}, messages=messages, extra_body={"allowed_token_ids": NO_EOS}
    )
    assert m3.stop_reason == "max_tokens" and m3.usage.output_tokens == 12
    calls = _check_records(server, forcing, "msg-e", 3)
    _one_sequence(calls, model_dir)
    await client.close()


async def test_dropped_stream_records_nothing(served: Any) -> None:
    import anthropic

    server, forcing, _, base = served
    forcing.script = []
    client = anthropic.AsyncAnthropic(
        base_url=base, api_key="key-1", max_retries=0, default_headers={"X-Session-Id": "drop-1"}
    )
    async with client.messages.stream(
        model="tiny",
        max_tokens=900,
        messages=[{"role": "user", "content": "talk"}],
        extra_body={"allowed_token_ids": NO_EOS},
    ) as stream:
        deltas = 0
        async for event in stream:
            deltas += event.type == "content_block_delta"
            if deltas == 3:
                break  # token deltas as they are generated; then the client goes away mid-answer
    deadline = time.monotonic() + 60
    while "drop-1" not in forcing.closed:  # the server closed the generation when the client left
        assert time.monotonic() < deadline, "the dropped stream's generation was never closed"
        await asyncio.sleep(0.05)
    assert server.recorder.get("drop-1") == [] and not any(x[0] == "drop-1" for x in forcing.seen)
    await client.close()


async def test_malformed_input_gets_the_dialects_4xx(served: Any) -> None:
    import anthropic
    import openai

    server, forcing, _, base = served
    before = len(forcing.seen)
    oa = openai.AsyncOpenAI(
        base_url=f"{base}/v1", api_key="key-1", max_retries=0, default_headers={"X-Session-Id": "bad-e"}
    )
    an = anthropic.AsyncAnthropic(
        base_url=base, api_key="key-1", max_retries=0, default_headers={"X-Session-Id": "bad-e"}
    )
    with pytest.raises(openai.BadRequestError, match="call_id"):
        await oa.responses.create(
            model="tiny", input=[{"type": "function_call_output", "call_id": "call_x", "output": "5"}]
        )
    with pytest.raises(openai.BadRequestError, match="file_search"):
        await oa.responses.create(
            model="tiny", input="x", tools=[{"type": "file_search", "vector_store_ids": []}]
        )
    with pytest.raises(anthropic.BadRequestError, match="tool_use_id"):
        await an.messages.create(
            model="tiny",
            max_tokens=8,
            messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x"}]}],
        )
    with pytest.raises(anthropic.BadRequestError, match="thinking"):
        await an.messages.create(
            model="tiny",
            max_tokens=8,
            messages=[{"role": "user", "content": "x"}],
            thinking={"type": "enabled", "budget_tokens": 1024},
        )
    with pytest.raises(anthropic.AuthenticationError):
        await anthropic.AsyncAnthropic(base_url=base, api_key="wrong", max_retries=0).messages.create(
            model="tiny", max_tokens=8, messages=[{"role": "user", "content": "x"}]
        )
    assert len(forcing.seen) == before and server.recorder.get("bad-e") == []
    await oa.close()
    await an.close()


def _check_records(server: Any, forcing: Forcing, session: str, turns: int) -> list[dict[str, Any]]:
    """Drain the session: its records are exactly the engine's prompts and outputs."""
    calls = server.recorder.drain(session)
    seen = [s for s in forcing.seen if s[0] == session]
    assert len(calls) == len(seen) == turns
    assert [(c["prompt_ids"], c["output_ids"]) for c in calls] == [(p, o) for _, p, o in seen]
    assert all(len(c["output_ids"]) == len(c["logprobs"]) == len(c["versions"]) > 0 for c in calls)
    return calls


def _one_sequence(calls: list[dict[str, Any]], model_dir: Path) -> None:
    """The trainer's trajectory of the session: one sequence (no earlier turn re-tokenised), exactly
    the last prompt + output, every output trained."""
    from rollart_proxy.chat import ChatMLFormat
    from rollart_proxy.server import group_trajectories

    [traj] = group_trajectories(
        [{"session_id": "s", "index": 0, "calls": calls}], "g", ChatMLFormat(model_dir)
    )
    assert traj.info["segments"] == 1
    assert traj.token_ids() == calls[-1]["prompt_ids"] + calls[-1]["output_ids"]
    assert [t.output_ids for t in traj.turns] == [c["output_ids"] for c in calls]
    assert sum(traj.loss_mask()) == sum(len(c["output_ids"]) for c in calls)
