"""What the Responses (:mod:`.responses_api`) and Messages (:mod:`.messages_api`) dialects share.

A dialect translates its request into the internal chat request (:class:`~.models.ChatBody`: chat
messages, function tools, sampling), lets the chat path serve it (:meth:`OpenAIServer._chat` with
``turns=True``: the same template rendering, splicing of earlier replies' sampled ids, admission,
session, recording), and translates the reply back: a JSON body from a :class:`Turn`, or its own
events from the chat path's stream (text deltas, then the complete :class:`Turn`; no chat chunk is
written and parsed in between).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Request
from pydantic import ValidationError

from rollart_proxy.server.chat_tokens import message_key
from rollart_proxy.server.guard import _ApiError
from rollart_proxy.server.models import ChatBody

if TYPE_CHECKING:
    from rollart_proxy.server.app import OpenAIServer

__all__ = [
    "EXTRA_SAMPLING",
    "Turn",
    "chat_body",
    "read_body",
    "remember_canonical",
    "sse",
    "turn_from_reply",
    "unsupported",
]

EXTRA_SAMPLING = ("top_k", "seed", "stop_token_ids", "allowed_token_ids")
"""vLLM-style sampling fields both dialects take besides their own (as Chat Completions does)."""


@dataclass
class Turn:
    """One generated reply in the chat form: ``calls`` as chat ``tool_calls`` (``arguments`` a JSON
    string), ``finish`` the chat finish reason (``stop``, ``length``, ``tool_calls``)."""

    text: str
    calls: list[dict[str, Any]]
    finish: str
    prompt_tokens: int
    completion_tokens: int
    rollart: dict[str, Any] = field(default_factory=dict)

    def history_message(self) -> dict[str, Any]:
        """The reply as the chat message a later turn's history holds."""
        message: dict[str, Any] = {"role": "assistant", "content": self.text}
        if self.calls:
            message["tool_calls"] = [
                {"id": c["id"], "type": "function", "function": dict(c["function"])} for c in self.calls
            ]
        return message


def turn_from_reply(reply: dict[str, Any]) -> Turn:
    """A chat completion's JSON reply as a :class:`Turn`."""
    choice = reply["choices"][0]
    message = choice["message"]
    usage = reply["usage"]
    return Turn(
        message.get("content") or "",
        list(message.get("tool_calls") or ()),
        choice["finish_reason"],
        usage["prompt_tokens"],
        usage["completion_tokens"],
        dict(reply.get("rollart") or {}),
    )


def sse(event: str, data: dict[str, Any]) -> str:
    """One server-sent event with its type named (both dialects name theirs)."""
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


async def read_body(request: Request) -> dict[str, Any]:
    """The request's JSON object (400 if it is not one)."""
    raw = await request.body()
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise _ApiError(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise _ApiError(400, "the body must be a JSON object")
    return body


def validation_error(e: ValidationError) -> _ApiError:
    err = e.errors()[0]
    where = ".".join(str(x) for x in err.get("loc", ()))
    return _ApiError(400, f"{where}: {err.get('msg')}", param=where or None)


def unsupported(feature: str, param: str) -> _ApiError:
    """The 400 of a feature of a dialect that this server does not serve, naming it."""
    return _ApiError(400, f"{param}: {feature} is not supported by this server (rollart-proxy)", param=param)


def chat_body(fields: dict[str, Any]) -> ChatBody:
    """The internal chat request (400 naming the field when a value is out of range). Streams ask
    for usage: a dialect reports it at the end."""
    fields = {k: v for k, v in fields.items() if v is not None}
    if fields.get("stream"):
        fields["stream_options"] = {"include_usage": True}
    try:
        return ChatBody.model_validate(fields)
    except ValidationError as e:
        raise validation_error(e) from None


def text_of(value: Any, where: str, kinds: tuple[str, ...]) -> str:
    """A string, or a list of text parts of the given ``type``s, as one string (400 otherwise)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _ApiError(400, f"{where} must be a string or a list of content parts", param=where)
    parts = []
    for j, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        kind = kind if isinstance(kind, str) else None  # a list or object is no type (nor hashable)
        if kind not in kinds or not isinstance(part.get("text"), str):
            if kind in IMAGE_KINDS:
                raise unsupported(f"{kind} content (images, files, audio)", f"{where}[{j}]")
            raise _ApiError(
                400, f"{where}[{j}]: expected a part of type {' or '.join(kinds)} with text", param=where
            )
        parts.append(part["text"])
    return "".join(parts)


IMAGE_KINDS = frozenset(
    {"image", "document", "input_image", "input_file", "input_audio", "image_url", "search_result"}
)


def canonical_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool calls with ``arguments`` as ``json.dumps(json.loads(arguments))``: the string a client
    that holds the arguments as an object (Anthropic's ``input``) writes back."""
    out = []
    for c in calls:
        fn = dict(c["function"])
        fn["arguments"] = json.dumps(json.loads(fn["arguments"]), ensure_ascii=False)
        out.append({**c, "function": fn})
    return out


def remember_canonical(server: OpenAIServer, session: str | None, turn: Turn) -> None:
    """Keep the reply's sampled ids also under its calls' canonical arguments (the chat path kept
    them under the parser's text), so a client that sends them back as an object is spliced too."""
    if not session or not turn.calls or "token_ids" not in turn.rollart:
        return
    canonical = canonical_calls(turn.calls)
    key = message_key(turn.text, canonical)
    if key != message_key(turn.text, turn.calls):
        server.generated.remember(session, key, turn.rollart["token_ids"])
