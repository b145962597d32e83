"""SmolLM2-135M-Instruct served by vLLM: the engine's logprobs against the trainer's forward, and tool
calls through rollart's OpenAI endpoint: its template renders no tools, so
rollart writes them into the system prompt (the Hermes / Qwen2.5 form) and vLLM's ``hermes`` parser reads
the model's calls; a 3-turn agent session with tool calls trains on exactly the engine's tokens."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch

from rollart_core.config import ModelConfig
from rollart_core.types import GenerateRequest, SamplingParams

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]


# the real engine on the converted model (one per module: the three-turn session below uses it too)


@pytest.fixture(scope="module")
async def engine(smollm2: ModelConfig) -> AsyncIterator[Any]:
    from rollart_proxy.engines.vllm_engine import VllmEngine, VllmEngineConfig

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    e = VllmEngine(
        VllmEngineConfig(max_model_len=512, dtype="float32"), model_path=str(smollm2.path), name="smol"
    )
    try:
        await e.start()
        yield e
    finally:
        await e.shutdown()


@pytest.mark.vllm
async def test_engine_logprobs_match_the_trainer_forward(smollm2: ModelConfig, engine: Any) -> None:
    """The step-0 importance ratio: the engine's logprobs of the tokens it sampled against the
    trainer's forward over the same ids (both in float32 over the converted bf16 weights, as
    examples/smollm2_math.yaml runs on a CPU without bf16 arithmetic)."""
    from rollart_proxy.chat import ChatMLFormat
    from rollart_train import TorchTrainer, TorchTrainerConfig

    chat = ChatMLFormat(str(smollm2.path))
    prompt = chat.first_turn(None, "What is 7 + 8? Think step by step.")
    sampling = SamplingParams(max_tokens=48, temperature=1.0, stop_token_ids=chat.stop_token_ids())
    outs = await asyncio.gather(
        *(engine.generate(GenerateRequest(f"lp-{i}", prompt, sampling)) for i in range(4))
    )
    trainer = TorchTrainer(TorchTrainerConfig(), model_path=smollm2.path)
    diffs: list[float] = []
    for out in outs:
        assert len(out.token_ids) > 0 and len(out.logprobs) == len(out.token_ids)
        ours = trainer.logprobs(prompt + list(out.token_ids))[-len(out.token_ids) :]
        diffs += [a - b for a, b in zip(out.logprobs, ours, strict=True)]
    d = torch.tensor(diffs)
    # per token: two float32 implementations (vLLM's CPU kernels, transformers' SDPA) of one model
    assert d.abs().mean().item() < 1e-3, d.abs().mean()
    assert d.abs().max().item() < 2e-2, d.abs().max()
    # the mean per-token importance ratio exp(ours - engine) is 1 within 0.1%
    assert abs(torch.exp(-d).mean().item() - 1.0) < 1e-3


# tool calls through the OpenAI endpoint: SmolLM2's template renders no tools, rollart writes them
# (Hermes / Qwen2.5 form); no engine: the model's tokenizer, template and vLLM's hermes parser

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "Today's weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
]


@pytest.fixture(scope="module")
def smol_template(smollm2: ModelConfig) -> Any:
    from rollart_proxy.server.chat_template import ChatTemplate
    from rollart_proxy.server.tools import tojson

    t = ChatTemplate(str(smollm2.path))
    t._template.environment.filters["tojson"] = tojson  # as the endpoint sets it
    return t


@pytest.fixture(scope="module")
def smol_parser(smollm2: ModelConfig) -> Any:
    from rollart_proxy.server.tools import ToolCallParser

    p = ToolCallParser("hermes", str(smollm2.path))
    p.load()
    return p


def test_tools_are_written_into_the_system_prompt(smol_template: Any) -> None:
    from rollart_proxy.server.tools import hermes_tools_block

    t = smol_template
    assert not t.renders_tools
    user = [{"role": "user", "content": "What is 2 + 3?"}]
    text = t.render(user, tools=TOOLS)
    block = hermes_tools_block(TOOLS)
    assert text == (
        f"<|im_start|>system\n{block}<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    for tool in TOOLS:
        assert json.dumps(tool) in text
    assert "You may call one or more functions" in text and "within <tool_call></tool_call>" in text
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in text
    # the client's system message first, then the block; without tools: the template's own rendering
    own = t.render([{"role": "system", "content": "Be brief."}, *user], tools=TOOLS)
    assert own.startswith(f"<|im_start|>system\nBe brief.\n\n{block}<|im_end|>\n")
    assert t.render(user) == t._render(user, True) and "SmolLM" in t.render(user)
    assert t.render(user, tools=None) == t.render(user)


@pytest.mark.parametrize(
    "call_json",
    ['{"name": "add", "arguments": {"a": 2, "b": 3}}', '{"name":"add","arguments":{"a":2,"b":3}}'],
)
def test_a_tool_conversation_extends_each_turns_tokens(
    smol_template: Any, smol_parser: Any, call_json: str
) -> None:
    """user → assistant call → tool result → assistant answer: each prompt plus the ids the model
    sampled is a prefix of the next prompt (spliced, as the endpoint does); written in the block's
    own format, plain re-rendering gives the same ids too."""
    from rollart_proxy.server.chat_tokens import splice_encode
    from rollart_proxy.server.tools import template_messages

    t, parser = smol_template, smol_parser
    eos = t.eos_token_id
    eot = (eos, t.token_str(eos))

    def render(ms: list[dict[str, Any]]) -> str:
        return t.render(template_messages(ms), tools=TOOLS)

    msgs: list[dict[str, Any]] = [{"role": "user", "content": "What is 2 + 3?"}]
    p1, _ = splice_encode(render, t.encode, msgs, {}, eot)
    o1 = [*t.encode(f"<tool_call>\n{call_json}\n</tool_call>"), eos]
    content, calls, err = parser.parse(t.decode(o1), TOOLS, "auto")
    assert err is None and content is None and len(calls) == 1
    assert calls[0]["function"] == {"name": "add", "arguments": '{"a": 2, "b": 3}'}
    msgs += [
        {"role": "assistant", "content": content or "", "tool_calls": calls},
        {"role": "tool", "content": "5", "tool_call_id": calls[0]["id"]},
    ]
    p2, n = splice_encode(render, t.encode, msgs, {1: o1}, eot)
    assert n == 1 and p2[: len(p1) + len(o1)] == p1 + o1
    assert t.decode(p2[len(p1) + len(o1) :], skip_special_tokens=False) == (
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    o2 = [*t.encode("2 + 3 = 5."), eos]
    msgs += [{"role": "assistant", "content": "2 + 3 = 5."}, {"role": "user", "content": "Thanks!"}]
    p3, n = splice_encode(render, t.encode, msgs, {1: o1, 3: o2}, eot)
    assert n == 2 and p3[: len(p2) + len(o2)] == p2 + o2
    if call_json.startswith('{"name": '):  # the block's own spacing: no splice needed either
        assert t.encode(render(msgs)) == p3


MALFORMED_CALLS = {
    "invalid JSON": '<tool_call>\n{"name": "add", "arguments": {"a": 2,\n</tool_call>',
    "unknown tool": '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',
    "arguments a list": '<tool_call>\n{"name": "add", "arguments": [2, 3]}\n</tool_call>',
    "arguments a string": '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 2}"}\n</tool_call>',
    "no arguments": '<tool_call>\n{"name": "add"}\n</tool_call>',
    "name not a string": '<tool_call>\n{"name": 7, "arguments": {}}\n</tool_call>',
    "huge float": '<tool_call>\n{"name": "add", "arguments": {"a": 1e999, "b": 1}}\n</tool_call>',
    "NaN": '<tool_call>\n{"name": "add", "arguments": {"a": NaN, "b": 1}}\n</tool_call>',
    "huge integer": '<tool_call>\n{"name": "add", "arguments": {"a": '
    + "9" * 5000
    + ', "b": 1}}\n</tool_call>',
    "deep nesting": '<tool_call>\n{"name": "add", "arguments": ' + "[" * 100_000 + "\n</tool_call>",
}


@pytest.mark.parametrize("case", sorted(MALFORMED_CALLS))
def test_a_malformed_call_is_the_models_text(smol_template: Any, smol_parser: Any, case: str) -> None:
    """Through SmolLM2's tokenizer (the ids the engine would return, decoded as the endpoint does):
    no tool call, the whole text as content, and an error saying why; never an exception."""
    text = MALFORMED_CALLS[case]
    ids = smol_template.encode(text)
    decoded = smol_template.decode(ids)
    assert decoded == text
    records: list[logging.LogRecord] = []
    seen = logging.Handler()
    seen.emit = records.append  # type: ignore[method-assign]
    parser_log = logging.getLogger(smol_parser._cls.__module__)
    parser_log.addHandler(seen)
    try:
        content, calls, err = smol_parser.parse(decoded, TOOLS, "auto")
    finally:
        parser_log.removeHandler(seen)
    assert calls == [] and content == text and err, (case, err)
    # the error is returned, not logged with a traceback by vLLM's parser (hundreds a step in a run)
    assert not [r for r in records if "extracting tool call" in str(r.msg)], case


class ScriptedEngine:
    """Fake engine (named as such: no engine may start in this test): answers each request with the
    next scripted output's token ids, as if the model had sampled them, and keeps the prompts."""

    def __init__(self, outputs: list[list[int]]) -> None:
        self.name = "scripted"
        self.is_started = True
        self.outputs = outputs
        self.prompts: list[list[int]] = []

    async def start(self) -> str:
        return self.name

    async def generate(self, request: GenerateRequest) -> Any:
        from rollart_core.types import GenerateOutput

        self.prompts.append(list(request.prompt_ids))
        ids = self.outputs.pop(0)
        return GenerateOutput(request.request_id, ids, [-0.1] * len(ids), [0] * len(ids), "stop", self.name)

    async def abort(self, request_id: str) -> None:
        return None

    async def weight_version(self) -> int:
        return 0


async def test_the_endpoint_serves_smollm2_tool_calls(smollm2: ModelConfig, smol_template: Any) -> None:
    """Over HTTP (in process): the prompt holds the tools block, a well-formed call comes back as
    ``tool_calls``, a malformed one as the model's text with ``tool_call_error``: 200 either way."""
    import httpx

    from rollart_proxy import LLMProxy, WorkerHandle
    from rollart_proxy.server.app import OpenAIServer
    from rollart_proxy.server.tools import hermes_tools_block

    t = smol_template
    good = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    bad = '<tool_call>\n{"name": "add", "arguments": [2, 3]}\n</tool_call>'
    engine = ScriptedEngine([[*t.encode(good), t.eos_token_id], [*t.encode(bad), t.eos_token_id]])
    server = OpenAIServer(LLMProxy([WorkerHandle("w", engine)]), str(smollm2.path), api_key="")
    body = {
        "model": server.model_name,
        "messages": [{"role": "user", "content": "What is 2 + 3?"}],
        "tools": TOOLS,
        "max_tokens": 64,
    }
    transport = httpx.ASGITransport(app=server.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://smol") as client:
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        reply = r.json()
        assert hermes_tools_block(TOOLS) in t.decode(engine.prompts[0], skip_special_tokens=False)
        choice = reply["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        assert [c["function"] for c in choice["message"]["tool_calls"]] == [
            {"name": "add", "arguments": '{"a": 2, "b": 3}'}
        ]
        assert "tool_call_error" not in reply["rollart"]
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        reply = r.json()
        choice = reply["choices"][0]
        assert choice["message"]["content"] == bad and not choice["message"].get("tool_calls")
        assert (
            choice["finish_reason"] == "stop" and "not a JSON object" in reply["rollart"]["tool_call_error"]
        )


def test_an_enforced_call_is_written_in_the_hermes_form(smol_template: Any) -> None:
    """``tool_choice`` naming a function with ``enum`` arguments: the call the endpoint writes is the
    block's own format, so the model's history holds calls as it was asked to write them."""
    from rollart_proxy.server.forced_call import plan_call

    t = smol_template
    tools = [
        {
            "type": "function",
            "function": {
                "name": "move",
                "parameters": {
                    "type": "object",
                    "properties": {"direction": {"type": "string", "enum": ["left", "right"]}},
                },
            },
        }
    ]
    choice = {"type": "function", "function": {"name": "move"}}
    plan = plan_call(t.render, t.encode, "<|im_end|>", [{"role": "user", "content": "Go."}], tools, choice)
    assert plan is not None and [s.values for s in plan.slots] == [("left", "right")]
    assert [t.decode(list(p), skip_special_tokens=False) for p in plan.pieces] == [
        '<tool_call>\n{"name": "move", "arguments": {"direction": "',
        '"}}\n</tool_call><|im_end|>',
    ]


# a 3-turn agent session with tool calls on the real engine: the trainer gets the engine's tokens


class RecordingGenerator:
    """The real proxy; each request's prompt ids and the engine's output, as it produced them."""

    def __init__(self, proxy: Any) -> None:
        self.proxy = proxy
        self.seen: list[tuple[str | None, list[int], Any]] = []

    async def generate(self, request: GenerateRequest) -> Any:
        out = await self.proxy.generate(request)
        self.seen.append((request.session_id, list(request.prompt_ids), out))
        return out

    async def abort(self, request_id: str) -> int:
        return int(await self.proxy.abort(request_id))

    def end_session(self, session_id: str) -> None:
        self.proxy.end_session(session_id)


def _tool_result(call: Any) -> str:
    try:
        args = json.loads(call.function.arguments)
    except ValueError:
        return "error: arguments are not JSON"
    if call.function.name == "add" and isinstance(args, dict):
        try:
            return str(int(args.get("a", 0)) + int(args.get("b", 0)))
        except (TypeError, ValueError):
            return "error: a and b must be integers"
    return "sunny, 21 C" if call.function.name == "weather" else f"error: no tool {call.function.name!r}"


# SmolLM2-135M asked to use a tool answers in prose (greedy, seen here with several prompts, with
# and without a worked example); asked to copy a call, it writes it, compact JSON included, which
# the template would re-render with spaces: re-tokenising the history would change the tokens
COMPACT_CALL = '<tool_call>\n{"name":"add","arguments":{"a":17,"b":25}}\n</tool_call>'


async def smol_tool_agent(client: Any, task: Any) -> Any:
    """Three model calls with the tools; after each of the first two, the tools' results. The SDK's
    message goes back unchanged; where the model wrote no call, the client answers anyway (as an
    agent that reports a tool's output unasked), so that turns 2 and 3 follow tool messages."""
    from rollart_env.agent import AgentResult

    messages: list[Any] = [{"role": "user", "content": f"Copy this line exactly: {COMPACT_CALL}"}]
    sent: list[list[dict[str, Any]]] = []  # each call's messages as plain dicts, for the test
    for k in range(3):
        sent.append([m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in messages])
        r = await client.chat.completions.create(
            model=task.model, messages=messages, tools=TOOLS, max_tokens=task.max_tokens, temperature=0.0
        )
        msg = r.choices[0].message
        if k == 2:
            return AgentResult(answer=msg.content, reward=1.0, info={"sent": sent})
        messages.append(msg)
        for call in msg.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": _tool_result(call)})
        if not msg.tool_calls:
            messages.append({"role": "tool", "tool_call_id": f"client-{k}", "content": "42"})
    raise AssertionError("unreachable")


@pytest.mark.vllm
async def test_a_three_turn_tool_session_trains_on_the_engines_tokens(
    smollm2: ModelConfig, engine: Any
) -> None:
    """An OpenAI-SDK agent with tools, three calls through the proxy's endpoint on the real engine:
    the trajectory the trainer packs is one sequence whose generated spans are exactly the engine's
    ids (and logprobs), earlier turns never re-tokenised, and the prompt tokens between turns are the
    chat template's rendering of the tool messages and the next assistant header."""
    from transformers import AutoTokenizer

    from rollart_core.control.runner import run_trajectory
    from rollart_core.types import Fate, Trajectory
    from rollart_env.agent import AgentEnv
    from rollart_proxy import LLMProxy, WorkerHandle
    from rollart_proxy.chat import ChatMLFormat
    from rollart_proxy.server.tools import hermes_messages, template_messages
    from rollart_reward.builtin import SuccessReward
    from rollart_reward.executor import InlineExecutor
    from rollart_train._packing import seq_data, split_sequences

    model = str(smollm2.path)
    gen = RecordingGenerator(LLMProxy([WorkerHandle("smol", engine)]))
    env = AgentEnv(AgentEnv.Config(entry=f"{Path(__file__).resolve()}:smol_tool_agent", model=model))
    traj = await asyncio.wait_for(
        run_trajectory(
            Trajectory("smol-tools-1", "agent", "agent", "g0", 0, 0),
            env=env,
            generator=gen,
            chat=ChatMLFormat(model),
            scorer=InlineExecutor(SuccessReward()),
            sampling=SamplingParams(max_tokens=40, temperature=0.0),
            max_turns=1,
        ),
        240,
    )
    assert traj.fate is Fate.FINISHED, traj.error
    seen = [(p, o) for s, p, o in gen.seen if s == "smol-tools-1"]
    assert len(seen) == traj.info["agent_calls"] == 3 and traj.info["segments"] == 1
    # each call's prompt extends the previous prompt + the engine's output: nothing re-tokenised
    for (p0, o0), (p1, _) in itertools.pairwise(seen):
        assert p1[: len(p0) + len(o0.token_ids)] == p0 + list(o0.token_ids)
    # per turn: the engine's ids, logprobs and versions; the context is what the engine was prompted with
    assert [t.output_ids for t in traj.turns] == [list(o.token_ids) for _, o in seen]
    assert [t.output_logprobs for t in traj.turns] == [list(o.logprobs) for _, o in seen]
    assert [t.output_versions for t in traj.turns] == [list(o.versions) for _, o in seen]
    assert traj.turns[0].context_ids == seen[0][0]

    # what the trainer packs: one sequence, the engine's last prompt + output, loss on generated ids only
    seqs, _ = split_sequences([traj], [1.0])
    assert len(seqs) == 1
    packed = seq_data(seqs[0], 1.0, match_sampling=True)
    assert packed.ids == seen[-1][0] + list(seen[-1][1].token_ids)
    trained = [i for i, m in enumerate(packed.mask) if m]
    starts = [len(p) for p, _ in seen]
    assert trained == [s + j for s, (_, o) in zip(starts, seen, strict=True) for j in range(len(o.token_ids))]
    assert [packed.behaviour[i] for i in trained] == [lp for _, o in seen for lp in o.logprobs]

    # between turns: the chat template's rendering of the new tool messages and the next assistant
    # header (SmolLM2's template renders no tools: rollart's Hermes form, hermes_messages), after the
    # assistant turn's end (the engine's own <|im_end|>, or the template's after a cut-off reply)
    hf = AutoTokenizer.from_pretrained(model)
    eos = hf.convert_tokens_to_ids("<|im_end|>")

    def render(messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        msgs = hermes_messages(template_messages(messages), TOOLS)
        text: str = hf.apply_chat_template(msgs, add_generation_prompt=generation_prompt, tokenize=False)
        return text

    sent = traj.info["sent"]
    for k in (1, 2):
        before, now = sent[k - 1], sent[k]
        n_assistant = len(before) + 1  # the call's messages, then the reply sent back unchanged
        assert now[len(before)]["role"] == "assistant" and now[n_assistant:]
        assert {m["role"] for m in now[n_assistant:]} == {"tool"}
        closed, full = render(now[:n_assistant], False), render(now, True)
        assert full.startswith(closed) and closed.endswith("<|im_end|>\n")
        new_messages = full[len(closed) :]
        assert new_messages.startswith("<|im_start|>user\n<tool_response>\n")
        out = list(seen[k - 1][1].token_ids)
        head = "\n" if out and out[-1] == eos else "<|im_end|>\n"
        expected = hf(head + new_messages, add_special_tokens=False)["input_ids"]
        assert traj.turns[k].context_ids == expected, (
            hf.decode(traj.turns[k].context_ids, skip_special_tokens=False),
            head + new_messages,
        )

    # the model's own call (it copies it, see COMPACT_CALL): parsed, its result sent back, and its
    # sampled ids kept where the template's re-rendering would have written other tokens
    first = sent[1][1]
    if first.get("tool_calls"):
        assert [c["function"] for c in first["tool_calls"]] == [
            {"name": "add", "arguments": '{"a": 17, "b": 25}'}
        ]
        assert sent[1][2]["content"] == "42"
        assert hf.decode(traj.turns[0].output_ids, skip_special_tokens=False) == COMPACT_CALL + "<|im_end|>"
        retokenised = hf(render(sent[1], True), add_special_tokens=False)["input_ids"]
        assert retokenised != seen[1][0] and len(retokenised) > len(seen[1][0])
