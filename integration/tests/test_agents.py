"""Agent tasks on a real vLLM CPU engine with the real ``openai`` SDK: an OpenAI-SDK agent with a tool
becomes one trajectory whose tokens are exactly what the engine saw and produced; a history
rewrite gives two segments; tool calls come back as ``tool_calls`` (plain and streaming); bad
agents get their fate and the run goes on; bad requests get 4xx.

A random tiny model does not write tool calls. ``Forcing`` (below) makes chosen replies say a
given text *through the real engine*: one engine call per token, ``max_tokens=1`` and
``allowed_token_ids`` the next token of the text (so ids, logprobs and versions are the engine's).
What this proves: the server's template, splicing, vLLM's hermes parser and SSE on real engine
output; not that a model chooses to call tools.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from rollart_core.control.runner import run_trajectory
from rollart_core.types import Fate, GenerateOutput, GenerateRequest, SamplingParams, Trajectory

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(600),
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]

HERE = Path(__file__).resolve()
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            },
        },
    }
]
ENUM_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "string", "enum": ["12", "7"]},
                    "op": {"type": "string", "enum": ["+", "-", "*"]},
                    "b": {"type": "string", "enum": ["12", "7"]},
                },
            },
        },
    }
]
CALL = '<tool_call>\n{"name":"add","arguments":{"a":2,"b":3}}\n</tool_call>'  # compact: unlike the template's


class Forcing:
    """The real proxy, plus: the next replies in ``script`` are forced token by token (see module
    doc). Every request's prompt and output as the engine saw them are kept in ``seen``."""

    def __init__(self, proxy: Any, encode: Any, eos: int) -> None:
        self.proxy, self.encode, self.eos = proxy, encode, eos
        self.script: list[str] = []
        self.seen: list[tuple[str | None, list[int], list[int]]] = []

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        if not self.script:
            out = await self.proxy.generate(request)
        else:
            target = [*self.encode(self.script.pop(0)), self.eos]
            ids: list[int] = []
            lps: list[float] = []
            vs: list[int] = []
            for k, tok in enumerate(target):
                sp = request.sampling.model_copy(
                    update={"max_tokens": 1, "allowed_token_ids": (tok,), "stop_token_ids": ()}
                )
                one = await self.proxy.generate(
                    GenerateRequest(
                        f"{request.request_id}-{k}",
                        request.prompt_ids + ids,
                        sp,
                        request.session_id,
                        request.task,
                    )
                )
                ids += one.token_ids
                lps += one.logprobs
                vs += one.versions
            out = GenerateOutput(request.request_id, ids, lps, vs, "stop", one.worker)
        self.seen.append((request.session_id, list(request.prompt_ids), list(out.token_ids)))
        return out

    async def generate_stream(self, request: GenerateRequest) -> AsyncIterator[GenerateOutput]:
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

    return create_tiny_model(tmp_path_factory.mktemp("agents") / "tiny", dtype="float32")


@pytest.fixture(scope="module")
async def forcing(model_dir: Path) -> AsyncIterator[Forcing]:
    from rollart_proxy import LLMProxy, WorkerHandle
    from rollart_proxy.engines.vllm_engine import VllmEngine, VllmEngineConfig
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
    try:
        t = ChatTemplate(model_dir)
        assert t.eos_token_id is not None
        yield Forcing(LLMProxy([WorkerHandle("a", engine)]), t.encode, t.eos_token_id)
    finally:
        await engine.shutdown()


def env(model_dir: Path, fn: str, **options: Any) -> Any:
    from rollart_env.agent import AgentEnv

    entry = fn if ":" in fn else f"{HERE}:{fn}"  # an agent of this file, or "path.py:fn"
    return AgentEnv(AgentEnv.Config(entry=entry, model=str(model_dir), max_model_len=1024, **options))


async def run(
    forcing: Forcing,
    model_dir: Path,
    fn: str,
    traj_id: str,
    sampling: SamplingParams | None = None,
    **options: Any,
) -> Trajectory:
    from rollart_proxy.chat import ChatMLFormat
    from rollart_reward.builtin import SuccessReward
    from rollart_reward.executor import InlineExecutor

    traj = Trajectory(traj_id, "agent", "agent", "g0", 7, 0)
    return await asyncio.wait_for(
        run_trajectory(
            traj,
            env=env(model_dir, fn, **options),
            generator=forcing,
            chat=ChatMLFormat(model_dir),
            scorer=InlineExecutor(SuccessReward()),
            sampling=sampling or SamplingParams(max_tokens=16),
            max_turns=1,
        ),
        300,
    )


# agents (loaded by the AgentEnv from this file) --------------------------------------------------


async def tool_agent(client: Any, task: Any) -> Any:
    from rollart_env.agent import AgentResult

    messages: list[Any] = [
        {"role": "system", "content": "use the tool"},
        {"role": "user", "content": "2 + 3?"},
    ]
    for _ in range(3):
        r = await client.chat.completions.create(
            model=task.model, messages=messages, tools=TOOLS, max_tokens=12
        )
        msg = r.choices[0].message
        messages.append(msg)  # the SDK's message object, sent back unchanged
        if not msg.tool_calls:
            return AgentResult(answer=msg.content, info={"success": True})
        for call in msg.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": "5"})
    raise AssertionError("the agent never finished")


async def rewriting_agent(client: Any, task: Any) -> Any:
    first = await client.chat.completions.create(
        model=task.model, max_tokens=6, messages=[{"role": "user", "content": "plan"}]
    )
    edited = (first.choices[0].message.content or "") + " (edited)"
    await client.chat.completions.create(
        model=task.model,
        max_tokens=6,
        messages=[
            {"role": "user", "content": "plan"},
            {"role": "assistant", "content": edited},
            {"role": "user", "content": "go"},
        ],
    )
    return "done"


async def raising_agent(client: Any, task: Any) -> Any:
    await client.chat.completions.create(
        model=task.model, max_tokens=2, messages=[{"role": "user", "content": "x"}]
    )
    raise RuntimeError("agent bug")


async def hanging_agent(client: Any, task: Any) -> Any:
    await asyncio.Event().wait()


async def silent_agent(client: Any, task: Any) -> Any:
    return "nothing asked"


async def foreign_agent(client: Any, task: Any) -> Any:
    import openai

    try:
        await client.chat.completions.create(
            model=task.model,
            max_tokens=2,
            messages=[{"role": "user", "content": "x"}],
            extra_headers={"X-Session-Id": "someone-else"},
        )
    except openai.PermissionDeniedError:
        pass  # even an agent that swallows the refusal does not get its trajectory trained
    return "sneaky"


async def enum_tool_agent(client: Any, task: Any) -> Any:
    """Names a tool whose arguments are enums: the endpoint writes the call, the model chooses the
    values; then sends the call and the tool's result back (with the same tools) and asks for a reply."""
    import json

    from rollart_env.agent import AgentResult

    messages: list[Any] = [{"role": "user", "content": "12 minus 7"}]
    r = await client.chat.completions.create(
        model=task.model,
        messages=messages,
        tools=ENUM_TOOLS,
        tool_choice={"type": "function", "function": {"name": "calc"}},
        max_tokens=128,  # the enforced call is ~80 tokens in the tiny tokenizer
    )
    msg = r.choices[0].message
    assert msg.tool_calls and r.choices[0].finish_reason == "tool_calls"
    args = json.loads(msg.tool_calls[0].function.arguments)
    messages += [msg, {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "5"}]
    # the same tools again (as an agent does): the prompt then extends the enforced call's sequence
    await client.chat.completions.create(model=task.model, messages=messages, tools=ENUM_TOOLS, max_tokens=3)
    return AgentResult(answer=json.dumps(args), reward=1.0, info={"args": args})


# tests ------------------------------------------------------------------------------------------


async def test_tool_agent_is_one_trajectory_of_the_engines_exact_tokens(
    forcing: Forcing, model_dir: Path
) -> None:
    forcing.script = [CALL, "the answer is 5"]
    forcing.seen.clear()
    traj = await run(forcing, model_dir, "tool_agent", "tool-1")
    assert traj.fate is Fate.FINISHED, traj.error
    assert traj.reward == 1.0 and traj.info["agent_calls"] == 2 and traj.info["segments"] == 1
    seen = [s for s in forcing.seen if s[0] == "tool-1"]
    assert len(seen) == 2 and [len(t.output_ids) for t in traj.turns] == [len(s[2]) for s in seen]
    # one sequence: exactly the engine's last prompt + output, and each turn's output is the engine's
    assert traj.token_ids() == seen[-1][1] + seen[-1][2]
    assert [t.output_ids for t in traj.turns] == [s[2] for s in seen]
    assert traj.turns[0].context_ids == seen[0][1]
    mask = traj.loss_mask()
    assert sum(mask) == sum(len(s[2]) for s in seen) and len(mask) == len(traj.token_ids())
    assert all(len(t.output_logprobs) == len(t.output_versions) == len(t.output_ids) for t in traj.turns)
    assert "tool_call" in traj.turns[0].action_text and traj.info["answer"] == "the answer is 5"


async def test_history_rewrite_gives_two_segments(forcing: Forcing, model_dir: Path) -> None:
    forcing.script, forcing.seen = [], []
    traj = await run(forcing, model_dir, "rewriting_agent", "rewrite-1")
    assert traj.fate is Fate.FINISHED and traj.info["segments"] == 2
    assert [t.new_sequence for t in traj.turns] == [False, True]
    seqs = traj.sequences()
    assert [s.token_ids() for s in seqs] == [p + o for _, p, o in forcing.seen]


async def test_tool_calls_plain_and_streaming(forcing: Forcing, model_dir: Path) -> None:
    import httpx
    import openai

    from rollart_proxy.server import OpenAIServer

    server = OpenAIServer(
        forcing, str(model_dir), served_model_name="tiny", max_model_len=1024, api_key="", admin_key=""
    )
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=server.app), base_url="http://t")
    client = openai.AsyncOpenAI(
        base_url="http://t/v1",
        api_key="x",
        http_client=http,
        max_retries=0,
        default_headers={"X-Session-Id": "tc-1"},
    )
    msgs = [{"role": "user", "content": "add"}]
    try:
        forcing.script = [CALL + CALL.replace('"a":2', '"a":7')]  # two parallel calls
        r = await client.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, max_tokens=8)
        calls = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and calls is not None
        assert [(c.function.name, c.function.arguments) for c in calls] == [
            ("add", '{"a": 2, "b": 3}'),
            ("add", '{"a": 7, "b": 3}'),
        ]
        forcing.script = [CALL]
        stream = await client.chat.completions.create(
            model="tiny",
            messages=msgs,
            tools=TOOLS,
            stream=True,
            tool_choice={"type": "function", "function": {"name": "add"}},
        )
        chunks = [c async for c in stream]
        deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()]
        assert [(d.function.name, d.function.arguments) for d in deltas] == [("add", '{"a": 2, "b": 3}')]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        # malformed tool call from the model: a reply without calls and a clear error, not a crash
        forcing.script = ['<tool_call>{"name": "add", "arguments": {"a": </tool_call>']
        r = await client.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS)
        assert (
            not r.choices[0].message.tool_calls and "malformed" in r.model_extra["rollart"]["tool_call_error"]
        )
        # bad requests: 400 naming the field; n > 1 says to use sessions
        bad_tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "objekt"}}}]
        with pytest.raises(openai.BadRequestError, match=r"tools\[0\]\.function\.parameters"):
            await client.chat.completions.create(model="tiny", messages=msgs, tools=bad_tools)  # type: ignore[arg-type]
        with pytest.raises(openai.BadRequestError, match="session"):
            await client.chat.completions.create(model="tiny", messages=msgs, n=2)
        with pytest.raises(openai.BadRequestError, match="tool_choice"):
            await client.chat.completions.create(
                model="tiny",
                messages=msgs,
                tools=TOOLS,
                tool_choice={"type": "function", "function": {"name": "mul"}},
            )
    finally:
        await client.close()
        await http.aclose()


async def test_bad_agents_get_their_fate_and_the_run_goes_on(forcing: Forcing, model_dir: Path) -> None:
    forcing.script = []
    cases = {
        "raising_agent": (Fate.ENV_FAILED, "agent bug"),
        "silent_agent": (Fate.ENV_FAILED, "no model call"),
        "foreign_agent": (Fate.ENV_FAILED, "another session"),
        "hanging_agent": (Fate.TIMED_OUT, "episode_timeout"),
    }
    trajs = await asyncio.gather(
        *(run(forcing, model_dir, fn, f"bad-{fn}", episode_timeout_s=5) for fn in cases)
    )
    for traj, (fate, words) in zip(trajs, cases.values(), strict=True):
        assert traj.fate is fate and traj.error and words in traj.error, (traj.traj_id, traj.fate, traj.error)
    assert not any(s[0] == "someone-else" for s in forcing.seen)  # the foreign call never reached the engine
    forcing.script = [CALL, "5"]
    after = await run(forcing, model_dir, "tool_agent", "after-bad")
    assert after.fate is Fate.FINISHED and after.info["segments"] == 1


async def test_enforced_enum_tool_call_trains_only_the_models_choices(
    forcing: Forcing, model_dir: Path
) -> None:
    """tool_choice naming a tool with enum arguments (rollart_proxy.server.forced_call) on the real
    engine: the reply's call holds valid values; the trajectory has one turn per choice, each one
    engine token drawn under the restriction to the values' tokens (what the trainer recomputes),
    the call's fixed text is context, and the next call continues the same sequence."""
    from rollart_proxy.server.chat_template import ChatTemplate

    forcing.script, forcing.seen = [], []
    traj = await run(forcing, model_dir, "enum_tool_agent", "enum-1")
    assert traj.fate is Fate.FINISHED, traj.error
    args = traj.info["args"]
    assert args["a"] in ("12", "7") and args["op"] in ("+", "-", "*") and args["b"] in ("12", "7")
    seen = [s for s in forcing.seen if s[0] == "enum-1"]
    assert len(seen) == 4 and len(traj.turns) == 4 and traj.info["segments"] == 1  # 3 choices + reply
    t = ChatTemplate(model_dir)
    choices = [("12", "7"), ("+", "-", "*"), ("12", "7")]
    for turn, values, (_, _, out) in zip(traj.turns, choices, seen, strict=False):
        assert turn.output_ids == out and len(out) == 1
        assert sorted(turn.allowed_token_ids or ()) == sorted(t.encode(v)[0] for v in values)
        assert out[0] in (turn.allowed_token_ids or ())
    assert [t.decode(turn.output_ids) for turn in traj.turns[:3]] == [args["a"], args["op"], args["b"]]
    assert traj.turns[3].allowed_token_ids is None  # the reply after the tool result: free text
    # one sequence, exactly the engine's: the fixed text of the call is context between the choices
    assert traj.token_ids() == seen[-1][1] + seen[-1][2]
    # the call as the template writes it, between the question and the tool's result
    last_prompt = t.decode(seen[-1][1], skip_special_tokens=False)
    assert last_prompt.endswith(
        '12 minus 7<|im_end|>\n<|im_start|>assistant\n\n<tool_call>\n{"name": "calc", "arguments": '
        f'{{"a": "{args["a"]}", "op": "{args["op"]}", "b": "{args["b"]}"}}}}\n</tool_call><|im_end|>\n'
        "<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    ), last_prompt


async def test_agent_over_http_keeps_its_session_binding(
    forcing: Forcing, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``base_url``: the agent's client talks to a real uvicorn server on 127.0.0.1 with a token the
    env got from ``POST /v1/sessions/{id}/bind`` (API key from the env variable); the trajectory holds
    the engine's exact tokens (the agent calls the model name the bind answered), a call naming another
    session is refused and fails the trajectory, and the bound token cannot bind other sessions."""
    import httpx

    from rollart_proxy.server import OpenAIServer

    server = OpenAIServer(
        forcing, str(model_dir), served_model_name="tiny-http", max_model_len=1024, api_key="k-agents"
    )
    port = await server.start("127.0.0.1", 0)
    monkeypatch.setenv("ROLLART_TEST_AGENT_KEY", "k-agents")
    http = {"base_url": f"http://127.0.0.1:{port}/v1", "api_key_env": "ROLLART_TEST_AGENT_KEY"}
    try:
        forcing.script, forcing.seen = [CALL, "the answer is 5"], []
        traj = await run(forcing, model_dir, "tool_agent", "http-1", **http)
        assert traj.fate is Fate.FINISHED, traj.error
        assert traj.info["agent_calls"] == 2 and traj.info["segments"] == 1
        seen = [s for s in forcing.seen if s[0] == "http-1"]
        assert traj.token_ids() == seen[-1][1] + seen[-1][2]
        assert [t.output_ids for t in traj.turns] == [s[2] for s in seen]

        foreign = await run(forcing, model_dir, "foreign_agent", "http-2", **http)
        assert foreign.fate is Fate.ENV_FAILED and "another session" in (foreign.error or "")
        assert not any(s[0] == "someone-else" for s in forcing.seen)

        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", trust_env=False) as c:
            key = {"Authorization": "Bearer k-agents"}
            bound = (await c.post("/v1/sessions/http-3/bind", headers=key)).json()
            as_bound = {"Authorization": f"Bearer {bound['token']}"}
            assert (await c.post("/v1/sessions/x/bind", headers=as_bound)).status_code == 403
            assert (await c.post("/v1/sessions/http-3/bind")).status_code == 401  # no key
            other = await c.post("/v1/sessions/http-3/release", json={"token": "nope"}, headers=key)
            assert other.status_code == 404
            done = await c.post("/v1/sessions/http-3/release", json={"token": bound["token"]}, headers=key)
            assert done.json() == {"session_id": "http-3", "calls": [], "refused": 0}
    finally:
        await server.stop()


async def test_the_calculator_agent_in_each_dialect_is_the_same_trajectory(
    forcing: Forcing, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """examples/agents/: the calculator agent written against Chat Completions, Responses (``openai``
    SDK) and Messages (``anthropic`` SDK, ``sdk: anthropic``, in-process and over HTTP) on the real
    engine, greedy: every dialect's trajectory holds the same engine tokens, the same restricted
    choices and the same answer, so a harness trains the same whichever API it speaks."""
    from rollart_proxy.server import OpenAIServer

    agents = HERE.parents[2] / "examples" / "agents"
    server = OpenAIServer(forcing, str(model_dir), max_model_len=1024, api_key="k-dialects")
    port = await server.start("127.0.0.1", 0)
    monkeypatch.setenv("ROLLART_TEST_AGENT_KEY", "k-dialects")
    http = {"base_url": f"http://127.0.0.1:{port}/v1", "api_key_env": "ROLLART_TEST_AGENT_KEY"}
    variants = {
        "chat": ("calculator_agent.py", {}),
        "responses": ("calculator_agent_responses.py", {}),
        "messages": ("calculator_agent_messages.py", {"sdk": "anthropic"}),
        "messages-http": ("calculator_agent_messages.py", {"sdk": "anthropic", **http}),
    }
    greedy = SamplingParams(max_tokens=128, temperature=0.0)  # the enforced call is ~80 tokens
    make_task = f"{agents / 'calculator_agent.py'}:make_task"
    forcing.script, forcing.seen = [], []
    trajs = {}
    try:
        for name, (file, options) in variants.items():
            trajs[name] = await run(
                forcing, model_dir, f"{agents / file}:solve", f"dialect-{name}", greedy,
                task_data_fn=make_task, **options,
            )  # fmt: skip
    finally:
        await server.stop()
    for name, traj in trajs.items():
        assert traj.fate is Fate.FINISHED, (name, traj.error)
        assert traj.info["agent_calls"] == 1 and len(traj.turns) == 1, name  # one choice: the operator
        seen = [s for s in forcing.seen if s[0] == f"dialect-{name}"]
        assert traj.token_ids() == seen[-1][1] + seen[-1][2], name  # the engine's exact tokens
    chat = trajs["chat"]
    for name, traj in trajs.items():
        assert traj.token_ids() == chat.token_ids(), name
        assert traj.turns[0].allowed_token_ids == chat.turns[0].allowed_token_ids, name
        assert traj.info["call"] == chat.info["call"] and traj.reward == chat.reward, name
