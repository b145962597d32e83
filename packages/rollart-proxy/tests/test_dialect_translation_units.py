"""The Responses and Messages dialects' translation to the chat request, without a server or an
engine: items and blocks to chat messages, tools and tool choices, call-id checks, the error shapes,
and the canonical-arguments key of a reply's calls."""

from __future__ import annotations

from typing import Any

import pytest

from rollart_proxy.server.chat_tokens import GeneratedMessages, message_key
from rollart_proxy.server.dialect import Turn, remember_canonical
from rollart_proxy.server.guard import _ApiError, error_body
from rollart_proxy.server.messages_api import MessagesBody
from rollart_proxy.server.messages_api import to_chat as messages_to_chat
from rollart_proxy.server.responses_api import ResponsesBody
from rollart_proxy.server.responses_api import to_chat as responses_to_chat

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
CALL = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}


def test_responses_items_become_chat_messages() -> None:
    body = ResponsesBody.model_validate(
        {
            "model": "m",
            "instructions": "be brief",
            "tools": [{"type": "function", "name": "add", "parameters": SCHEMA, "strict": None}],
            "tool_choice": {"type": "function", "name": "add"},
            "max_output_tokens": 9,
            "input": [
                {"role": "developer", "content": "dev"},
                {
                    "role": "user",
                    "content": [{"type": "input_text", "text": "2 + "}, {"type": "input_text", "text": "3"}],
                },
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "calling"}],
                },
                {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 2}'},
                {"type": "function_call_output", "call_id": "c1", "output": "5"},
                {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
            ],
        }
    )
    fields, conversation = responses_to_chat(body, [])
    assert fields["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "system", "content": "dev"},
        {"role": "user", "content": "2 + 3"},
        {"role": "assistant", "content": "calling", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
        {"role": "assistant", "content": "no"},
    ]
    assert conversation == fields["messages"][1:]  # kept for previous_response_id: no instructions
    assert fields["tools"] == [{"type": "function", "function": {"name": "add", "parameters": SCHEMA}}]
    assert fields["tool_choice"] == {"type": "function", "function": {"name": "add"}}
    assert fields["max_tokens"] == 9
    # a function_call_output may answer a call of the previous response's conversation
    later = ResponsesBody.model_validate(
        {"model": "m", "input": [{"type": "function_call_output", "call_id": "c1", "output": "5"}]}
    )
    fields, _ = responses_to_chat(later, conversation[:3])
    assert fields["messages"][-1] == {"role": "tool", "tool_call_id": "c1", "content": "5"}


def test_messages_blocks_become_chat_messages() -> None:
    body = MessagesBody.model_validate(
        {
            "model": "m",
            "max_tokens": 5,
            "system": [{"type": "text", "text": "be brief"}],
            "tools": [{"name": "add", "description": "sum", "input_schema": SCHEMA}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "stop_sequences": ["END"],
            "messages": [
                {"role": "user", "content": "2 + 3"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": "calling", "citations": None},
                        {"type": "tool_use", "id": "c1", "name": "add", "input": {"a": 2}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "c1",
                            "content": [{"type": "text", "text": "5"}],
                        },
                        {"type": "text", "text": "and?"},
                    ],
                },
            ],
        }
    )
    fields = messages_to_chat(body)
    assert fields["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "2 + 3"},
        {"role": "assistant", "content": "calling", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
        {"role": "user", "content": "and?"},
    ]
    assert fields["tools"] == [
        {"type": "function", "function": {"name": "add", "description": "sum", "parameters": SCHEMA}}
    ]
    assert (fields["tool_choice"], fields["parallel_tool_calls"]) == ("required", False)
    assert fields["stop"] == ["END"] and fields["max_tokens"] == 5


@pytest.mark.parametrize(
    "items, words",
    [
        ([{"type": "function_call_output", "call_id": "c9", "output": "5"}], "no function_call"),
        ([{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}], "not supported"),
        ([{"type": "image_generation_call", "id": "i"}], "hosted tool"),
        ([{"type": "mystery"}], "unknown item type"),
        (["text"], "must be an object"),
    ],
)
def test_bad_responses_items(items: list[Any], words: str) -> None:
    with pytest.raises(_ApiError, match=words) as e:
        responses_to_chat(ResponsesBody.model_validate({"model": "m", "input": items}), [])
    assert e.value.status == 400


@pytest.mark.parametrize(
    "messages, words",
    [
        ([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c9"}]}], "no tool_use"),
        ([{"role": "user", "content": [{"type": "document", "source": {}}]}], "not supported"),
        ([{"role": "assistant", "content": [{"type": "thinking", "thinking": "x"}]}], "extended thinking"),
        ([{"role": "user", "content": [{"type": "web_search_tool_result"}]}], "server tool"),
        (
            [{"role": "user", "content": [{"type": "tool_use", "id": "x", "name": "f", "input": {}}]}],
            "misplaced",
        ),
        ([{"role": "user", "content": 5}], "content"),
    ],
)
def test_bad_messages_blocks(messages: list[Any], words: str) -> None:
    with pytest.raises(_ApiError, match=words) as e:
        messages_to_chat(MessagesBody.model_validate({"model": "m", "max_tokens": 1, "messages": messages}))
    assert e.value.status == 400


def test_error_shapes_follow_the_path() -> None:
    assert error_body(429, "slow down", "rate_limit_exceeded", path="/v1/messages") == {
        "type": "error",
        "error": {"type": "rate_limit_error", "message": "slow down"},
    }
    assert error_body(404, "no", "model_not_found", "model", path="/v1/responses") == {
        "error": {"message": "no", "type": "model_not_found", "param": "model", "code": 404}
    }
    assert error_body(403, "x", path="/v1/messages/count_tokens")["error"]["type"] == "permission_error"


def test_remember_canonical_keys_the_calls_as_an_object_client_writes_them() -> None:
    class Server:
        generated = GeneratedMessages()

    compact = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a":1,"é":2}'}}
    turn = Turn("", [compact], "tool_calls", 3, 2, {"token_ids": [7, 8]})
    remember_canonical(Server(), "s", turn)  # type: ignore[arg-type]
    written_back = {**compact, "function": {"name": "f", "arguments": '{"a": 1, "é": 2}'}}
    assert Server.generated.lookup("s", message_key("", [written_back])) == [7, 8]
    assert Server.generated.lookup("s", message_key("", [compact])) is None  # the chat path keeps that one


# any JSON: a 400 naming what is wrong, never another exception (the server would answer 500) ------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from pydantic import ValidationError  # noqa: E402

_WORDS = ["type", "role", "content", "text", "call_id", "tool_use_id", "id", "name", "input", "arguments",
          "output", "refusal", "function", "message", "user", "assistant", "tool_use", "tool_result",
          "function_call", "function_call_output", "input_text", "output_text", "image", "format"]  # fmt: skip
_leaf = st.none() | st.booleans() | st.integers(-3, 3) | st.sampled_from(_WORDS) | st.text(max_size=3)
_json = st.recursive(
    _leaf,
    lambda s: st.lists(s, max_size=3) | st.dictionaries(st.sampled_from(_WORDS), s, max_size=4),
    max_leaves=12,
)


def _items(shapes: dict[str, list[str]]) -> Any:
    """Objects of each ``type`` with any of its fields, each field any JSON; now and then a stray field."""
    return st.one_of(
        *(
            st.fixed_dictionaries(
                {"type": st.just(kind) | _json}, optional={k: _json for k in [*fields, "role", "bogus"]}
            )
            | st.fixed_dictionaries({"type": st.just(kind)}, optional={k: _json for k in fields})
            for kind, fields in shapes.items()
        )
    )


RESPONSES_ITEMS = {
    "message": ["role", "content", "id", "status"],
    "function_call": ["call_id", "name", "arguments", "id", "status"],
    "function_call_output": ["call_id", "output", "id"],
    "reasoning": ["summary"],
}
MESSAGES_BLOCKS = {
    "text": ["text", "citations"],
    "tool_use": ["id", "name", "input"],
    "tool_result": ["tool_use_id", "content", "is_error"],
    "image": ["source"],
}


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(
    items=st.lists(_items(RESPONSES_ITEMS), max_size=4) | _json,
    extra=st.dictionaries(
        st.sampled_from(["tools", "tool_choice", "text", "reasoning", "instructions"]), _json
    ),
)
def test_any_responses_input_is_served_or_a_400(items: Any, extra: dict[str, Any]) -> None:
    try:
        body = ResponsesBody.model_validate({"model": "m", "input": items, **extra})
        responses_to_chat(body, [])
    except (ValidationError, _ApiError):
        pass


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(
    messages=st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "assistant"]) | _json},
            optional={"content": st.lists(_items(MESSAGES_BLOCKS)) | _json},
        ),
        min_size=1,
        max_size=4,
    ),
    extra=st.dictionaries(st.sampled_from(["tools", "tool_choice", "system", "thinking"]), _json),
)
def test_any_messages_input_is_served_or_a_400(messages: Any, extra: dict[str, Any]) -> None:
    try:
        body = MessagesBody.model_validate({"model": "m", "max_tokens": 1, "messages": messages, **extra})
        messages_to_chat(body)
    except (ValidationError, _ApiError):
        pass
