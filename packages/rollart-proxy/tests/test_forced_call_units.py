"""Enforced tool calls without an engine: plans from the tiny model's real chat template and
tokenizer; :func:`generate_call` over a scripted in-process generator (a fake standing in for the
engine, which the integration test in ``integration/tests/test_agents.py`` uses for real)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from rollart_core.errors import EngineError
from rollart_core.types import GenerateOutput, SamplingParams
from rollart_proxy.server.chat_template import ChatTemplate
from rollart_proxy.server.forced_call import generate_call, plan_call
from rollart_proxy.server.tools import ToolsError, tojson


def calc_tool(a: list[str], op: list[str], b: list[str] | None = None) -> list[dict[str, Any]]:
    props: dict[str, Any] = {"a": {"enum": a}, "op": {"enum": op}}
    if b is not None:
        props["b"] = {"enum": b}
    return [
        {
            "type": "function",
            "function": {"name": "calc", "parameters": {"type": "object", "properties": props}},
        }
    ]


NAMED = {"type": "function", "function": {"name": "calc"}}
MSGS = [{"role": "user", "content": "12 minus 7"}]


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> ChatTemplate:
    from rollart_train.tiny import create_tiny_model

    t = ChatTemplate(create_tiny_model(tmp_path_factory.mktemp("forced") / "tiny"))
    t._template.environment.filters["tojson"] = tojson
    return t


def plan(template: ChatTemplate, tools: list[dict[str, Any]], choice: Any = NAMED) -> Any:
    eos = template.token_str(template.eos_token_id or 0)
    return plan_call(template.render, template.encode, eos, MSGS, tools, choice)


class ScriptedGenerator:
    """Fake engine: answers each one-token request with the allowed token at ``picks[k]`` (an index
    into the sorted allowed ids), logprob -0.5, version 3; records every request."""

    def __init__(self, picks: list[int]) -> None:
        self.picks = picks
        self.requests: list[tuple[list[int], SamplingParams]] = []

    async def __call__(self, prompt: list[int], sampling: SamplingParams) -> GenerateOutput:
        self.requests.append((list(prompt), sampling))
        assert sampling.allowed_token_ids is not None
        tok = sorted(sampling.allowed_token_ids)[self.picks[len(self.requests) - 1]]
        return GenerateOutput(f"r{len(self.requests)}", [tok], [-0.5], [3], "length", "w")


def test_plan_writes_the_templates_call_around_the_choices(template: ChatTemplate) -> None:
    tools = calc_tool(["12", "7"], ["+", "-", "*"], ["12", "7"])
    p = plan(template, tools)
    assert p.function == "calc" and [s.name for s in p.slots] == ["a", "op", "b"]
    # filled with one choice per slot, the plan is the template's own rendering of that call
    args = {"a": "12", "op": "-", "b": "7"}
    ids: list[int] = []
    for piece, slot in zip(p.pieces, [*p.slots, None], strict=True):
        ids += piece
        if slot is not None:
            ids += slot.value_ids[slot.values.index(args[slot.name])]
    call = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "calc", "arguments": args}}],
    }
    prompt = template.render(MSGS, tools=tools)
    full = template.render([*MSGS, call], add_generation_prompt=False, tools=tools)
    assert template.decode(ids, skip_special_tokens=False) == full[len(prompt) :].removesuffix("\n")
    assert ids[-1] == template.eos_token_id
    # "required" with a single tool is the same call; auto / none / several tools are not enforced
    assert plan(template, tools, "required") is not None
    assert plan(template, tools, "auto") is None and plan(template, tools, None) is None
    two = [*tools, {"type": "function", "function": {"name": "other", "parameters": {}}}]
    assert plan(template, two, "required") is None


def test_only_enum_arguments_are_enforced(template: ChatTemplate) -> None:
    free = [
        {
            "type": "function",
            "function": {
                "name": "calc",
                "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
            },
        }
    ]
    assert plan(template, free) is None
    ints = [
        {
            "type": "function",
            "function": {
                "name": "calc",
                "parameters": {"type": "object", "properties": {"a": {"enum": [1, 2]}}},
            },
        }
    ]
    assert plan(template, ints) is None
    # a value whose tokens start another's ("12" and "12" "3"): the model could not say which it chose
    assert template.encode("123")[:1] == template.encode("12")
    with pytest.raises(ToolsError, match="prefix"):
        plan(template, calc_tool(["12", "123"], ["+"]))


def test_generate_call_samples_only_the_undecided_tokens(template: ChatTemplate) -> None:
    tools = calc_tool(["12", "7"], ["+", "-", "*"], ["12", "7"])
    p = plan(template, tools)
    gen = ScriptedGenerator([1, 1, 0])  # a: the higher id of {"12", "7"} first tokens, ...
    prompt = template.encode(template.render(MSGS, tools=tools))
    call = asyncio.run(generate_call(p, prompt, SamplingParams(temperature=0.7, seed=5), gen))
    n = len(gen.requests)
    assert n == 3 and len(call.outputs) == 3  # one engine call per choice, nothing for fixed text
    for k, (req_prompt, sp) in enumerate(gen.requests):
        # each request continues the prompt with everything written so far, fixed text included
        assert req_prompt == prompt + call.token_ids[: len(req_prompt) - len(prompt)]
        assert sp.max_tokens == 1 and sp.temperature == 0.7 and sp.seed == 5 + k and not sp.stop_token_ids
        assert len(sp.allowed_token_ids or ()) == len(p.slots[k].values)
    sampled = [i for i, v in enumerate(call.versions) if v == 3]
    assert len(sampled) == 3 and [call.logprobs[i] for i in sampled] == [-0.5] * 3
    assert all(call.logprobs[i] == 0.0 for i in range(len(call.token_ids)) if i not in sampled)
    json.dumps(call.arguments)
    assert call.arguments["op"] == sorted("+-*", key=lambda o: template.encode(o)[0])[1]
    text = template.decode(call.token_ids)
    assert f'"op": "{call.arguments["op"]}"' in text and call.token_ids[-1] == template.eos_token_id


def test_single_value_and_multi_token_values(template: ChatTemplate) -> None:
    # "a" has one value: fed, no engine call; "add" / "sub" are several tokens each: the first
    # token decides, the rest is fed
    assert len(template.encode("add")) > 1 and len(template.encode("sub")) > 1
    p = plan(template, calc_tool(["5"], ["add", "sub"]))
    gen = ScriptedGenerator([0])
    call = asyncio.run(generate_call(p, [1, 2], SamplingParams(), gen))
    assert len(gen.requests) == 1 and call.arguments["a"] == "5"
    assert call.arguments["op"] == min(["add", "sub"], key=lambda v: template.encode(v)[0])
    assert f'"op": "{call.arguments["op"]}"' in template.decode(call.token_ids)


def test_a_wrong_engine_token_fails(template: ChatTemplate) -> None:
    p = plan(template, calc_tool(["5"], ["+", "-"]))

    async def wrong(prompt: list[int], sampling: SamplingParams) -> GenerateOutput:
        return GenerateOutput("x", [], [], [], "abort")

    with pytest.raises(EngineError, match="allowed"):
        asyncio.run(generate_call(p, [1, 2], SamplingParams(), wrong))
