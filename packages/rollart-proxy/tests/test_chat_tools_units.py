"""Exact-token splicing and tool-call checks/parsing, without an engine: the tiny model's real
tokenizer and chat template, vLLM's real ``hermes`` parser."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollart_proxy.server.chat_template import ChatTemplate
from rollart_proxy.server.chat_tokens import GeneratedMessages, message_key, splice_encode
from rollart_proxy.server.tools import (
    ToolCallParser,
    ToolsError,
    check_tool_choice,
    check_tools,
    hermes_messages,
    hermes_tools_block,
    template_messages,
    tojson,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "a + b",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rollart_train.tiny import create_tiny_model

    return create_tiny_model(tmp_path_factory.mktemp("chat-tools") / "tiny")


@pytest.fixture(scope="module")
def template(model_dir: Path) -> ChatTemplate:
    t = ChatTemplate(model_dir)
    t._template.environment.filters["tojson"] = tojson
    return t


def test_spliced_prompt_extends_previous_prompt_and_output(template: ChatTemplate) -> None:
    eos = template.eos_token_id
    assert eos is not None
    eot = (eos, template.token_str(eos))
    render = lambda ms: template.render(template_messages(ms), tools=TOOLS)  # noqa: E731
    first = [{"role": "system", "content": "calc"}, {"role": "user", "content": "2 + 3?"}]
    p1, n = splice_encode(render, template.encode, first, {}, eot)
    assert n == 0 and p1 == template.encode(render(first))
    # sampled: compact JSON, as the model wrote it (the template would re-serialise it with spaces)
    raw = '<tool_call>\n{"name":"add","arguments":{"a":2,"b":3}}\n</tool_call>'
    o1 = [*template.encode(raw), eos]
    reply = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
        ],
    }
    second = [*first, reply, {"role": "tool", "content": "5", "tool_call_id": "c1"}]
    p2, n = splice_encode(render, template.encode, second, {2: o1}, eot)
    assert n == 1 and p2[: len(p1) + len(o1)] == p1 + o1
    assert template.decode(p2[len(p1) + len(o1) :], skip_special_tokens=False).startswith(
        "\n<|im_start|>tool\n5"
    )
    naive = template.encode(render(second))
    assert naive[: len(p1) + len(o1)] != p1 + o1  # re-tokenising would not give the sampled ids back
    # an output cut by max_tokens (no end-of-turn token): the template's own closing text stays
    o_cut = template.encode("hello")
    p3, _ = splice_encode(
        render, template.encode, [*first, {"role": "assistant", "content": "hello"}], {2: o_cut}, eot
    )
    assert p3[: len(p1) + len(o_cut)] == p1 + o_cut
    assert template.decode(p3[len(p1) + len(o_cut) :], skip_special_tokens=False).startswith("<|im_end|>")


def test_a_template_that_renders_tools_is_used_as_it_is(template: ChatTemplate) -> None:
    """The tiny model's template writes tools itself: nothing of the Hermes fallback is applied."""
    assert template.renders_tools
    history = template_messages(
        [
            {"role": "system", "content": "calc"},
            {"role": "user", "content": "2 + 3?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"id": "c1", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}],
            },
            {"role": "tool", "content": "5", "tool_call_id": "c1"},
        ]
    )
    for tools in (TOOLS, None):
        assert template.render(history, tools=tools) == template._render(history, True, tools=tools)
    text = template.render(history, tools=TOOLS)
    assert text.startswith("<|im_start|>system\ncalc\n\n<tools>\n") and "You may call" not in text
    assert "<|im_start|>tool\n5<|im_end|>" in text


def test_hermes_messages_write_tools_calls_and_results_as_chatml() -> None:
    plain = [{"role": "user", "content": "hi"}]
    assert hermes_messages(plain, None) == plain and hermes_messages(plain, []) == plain
    block = hermes_tools_block(TOOLS)
    assert block.startswith("# Tools\n\nYou may call one or more functions") and block.endswith(
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )
    call = {"id": "c1", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
    out = hermes_messages(
        [
            {"role": "system", "content": "calc"},
            {"role": "user", "content": "2 + 3? 4 + 4?"},
            {"role": "assistant", "content": "Adding.", "tool_calls": [call, {**call, "id": "c2"}]},
            {"role": "tool", "content": "5", "tool_call_id": "c1"},
            {"role": "tool", "content": "8", "tool_call_id": "c2"},
            {"role": "assistant", "content": "5 and 8"},
        ],
        TOOLS,
    )
    one = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    assert out == [
        {"role": "system", "content": f"calc\n\n{block}"},
        {"role": "user", "content": "2 + 3? 4 + 4?"},
        {"role": "assistant", "content": f"Adding.\n{one}\n{one}"},
        {
            "role": "user",
            "content": "<tool_response>\n5\n</tool_response>\n<tool_response>\n8\n</tool_response>",
        },
        {"role": "assistant", "content": "5 and 8"},
    ]
    # no system message: the block is the system message; a call's arguments that are not JSON stay as sent
    out = hermes_messages(
        [
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"function": {"name": "add", "arguments": "a=2"}}],
            }
        ],
        TOOLS,
    )
    assert out == [
        {"role": "system", "content": block},
        {"role": "assistant", "content": '<tool_call>\n{"name": "add", "arguments": a=2}\n</tool_call>'},
    ]


def test_generated_messages_are_bounded_and_keyed_by_content_and_calls() -> None:
    g = GeneratedMessages(max_sessions=2, max_per_session=2)
    calls = [{"id": "x", "function": {"name": "add", "arguments": "{}"}}]
    g.remember("s", message_key("", calls), [1, 2])
    assert g.lookup(
        "s", message_key(None, [{"id": "other-id", "function": {"name": "add", "arguments": "{}"}}])
    ) == [1, 2]
    assert g.lookup("s", message_key("", None)) is None
    for i in range(3):
        g.remember("s", message_key(str(i), None), [i])
    assert g.lookup("s", message_key("0", None)) is None and g.lookup("s", message_key("2", None)) == [2]
    g.remember("t", "k", [1])
    g.remember("u", "k", [1])
    assert len(g) == 2 and g.lookup("s", message_key("2", None)) is None


@pytest.mark.parametrize(
    ("tools", "field"),
    [
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
            "tools[0].function.parameters",
        ),
        (
            [
                {
                    "type": "function",
                    "function": {"name": "f", "parameters": {"properties": {"a": {"minimum": "x"}}}},
                }
            ],
            "tools[0].function.parameters",
        ),
        ([{"type": "function", "function": {"name": "bad name"}}], "tools[0].function.name"),
        ([{"type": "retrieval"}], "tools[0].type"),
        ([*TOOLS, *TOOLS], "tools[1].function.name"),
    ],
)
def test_invalid_tools_name_the_field(tools: list[dict], field: str) -> None:
    with pytest.raises(ToolsError) as e:
        check_tools(tools)
    assert e.value.param == field and field in str(e.value)


def test_tool_choice() -> None:
    check_tools(TOOLS)
    for ok in ("none", "auto", "required", {"type": "function", "function": {"name": "add"}}):
        check_tool_choice(ok, TOOLS)
    for bad in ("always", {"type": "function", "function": {"name": "mul"}}, {"type": "function"}):
        with pytest.raises(ToolsError):
            check_tool_choice(bad, TOOLS)


def test_hermes_parser_plain_parallel_and_malformed(model_dir: Path) -> None:
    p = ToolCallParser("hermes", str(model_dir))
    text = (
        'thinking <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
        '<tool_call>{"name":"add","arguments":{"a":3,"b":4}}</tool_call>'
    )
    content, calls, err = p.parse(text, TOOLS, "auto")
    assert err is None and content == "thinking "
    assert [c["function"]["arguments"] for c in calls] == ['{"a": 1, "b": 2}', '{"a": 3, "b": 4}']
    assert len({c["id"] for c in calls}) == 2
    _, calls, err = p.parse(text, TOOLS, "auto", parallel=False)
    assert len(calls) == 1 and err and "parallel" in err
    content, calls, err = p.parse(
        '<tool_call>{"name": "add", "arguments": {"a": 1,</tool_call>', TOOLS, "auto"
    )
    assert calls == [] and err and "malformed" in err and content and content.startswith("<tool_call>")
    _, calls, err = p.parse('<tool_call>{"name": "rm", "arguments": {}}</tool_call>', TOOLS, "auto")
    assert calls == [] and err and "undeclared" in err
    for args, why in (("[1, 2]", "not a JSON object"), ('{"a": 1e999}', "not strict JSON")):
        text = f'<tool_call>{{"name": "add", "arguments": {args}}}</tool_call>'
        content, calls, err = p.parse(text, TOOLS, "auto")
        assert calls == [] and content == text and err and why in err  # the model's text, as it wrote it
    content, calls, err = p.parse("no call here", TOOLS, "required")
    assert calls == [] and content == "no call here" and err is not None and "asks for a tool call" in err
    with pytest.raises(ToolsError):
        ToolCallParser("no-such-parser", str(model_dir)).load()
