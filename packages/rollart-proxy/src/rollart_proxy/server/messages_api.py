"""The Anthropic Messages dialect: ``POST /v1/messages`` on the chat path (:mod:`.dialect`).

What is served: ``system`` (a string or text blocks), ``messages`` of role ``user`` / ``assistant``
whose content is a string or blocks of type ``text``, ``tool_use`` (assistant) and ``tool_result``
(user; its content a string or text blocks), ``tools`` (client tools: ``name``, ``description``,
``input_schema``), ``tool_choice`` (``auto`` / ``any`` / ``tool`` / ``none``,
``disable_parallel_tool_use``), ``max_tokens``, ``stop_sequences``, ``temperature``, ``top_p``,
``top_k``, ``stream`` (``message_start``, ``content_block_start`` / ``_delta`` (``text_delta``,
``input_json_delta``) / ``_stop``, ``message_delta``, ``message_stop``), ``usage``; plus vLLM's
``seed``, ``stop_token_ids``, ``allowed_token_ids``. The API key may come as ``x-api-key`` (as
Anthropic's SDKs send it) or ``Authorization: Bearer``; errors have Anthropic's shape
(``{"type": "error", "error": {"type", "message"}}``).

A ``tool_use`` block's ``input`` is an object: this server's replies are kept under the canonical
JSON text of their calls' arguments as well, so an assistant turn sent back as it was given is
spliced in as its sampled ids (token-exact). A ``tool_result`` whose ``tool_use_id`` names no
earlier ``tool_use`` is a 400, checked before anything is generated. ``is_error`` and
``cache_control`` are accepted and not shown to the model.

Refused with a 400 naming the feature: server tools (web search, code execution, bash, text editor,
computer use, …), images and documents, extended thinking, MCP servers, containers.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rollart_proxy.server.dialect import (
    EXTRA_SAMPLING,
    IMAGE_KINDS,
    Turn,
    chat_body,
    read_body,
    remember_canonical,
    sse,
    text_of,
    turn_from_reply,
    unsupported,
    validation_error,
)
from rollart_proxy.server.guard import _ApiError
from rollart_proxy.server.models import INT32_MAX

if TYPE_CHECKING:
    from rollart_proxy.server.app import OpenAIServer

__all__ = ["MessagesBody", "add_messages_routes", "to_chat"]


class MessagesBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    messages: list[Any] = Field(min_length=1)
    max_tokens: int = Field(ge=1, le=INT32_MAX)
    system: str | list[Any] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    thinking: dict[str, Any] | None = None
    mcp_servers: list[Any] | None = None
    container: Any = None
    context_management: Any = None
    # vLLM's sampling fields (as Chat Completions takes them)
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None

    def check_supported(self) -> None:
        thinking = (self.thinking or {}).get("type", "disabled")
        refused = [
            (thinking != "disabled", "extended thinking", "thinking"),
            (bool(self.mcp_servers), "MCP servers", "mcp_servers"),
            (self.container is not None, "containers", "container"),
            (self.context_management is not None, "context management", "context_management"),
        ]
        for bad, feature, param in refused:
            if bad:
                raise unsupported(feature, param)


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type", "custom")
        if kind != "custom":
            raise unsupported(f"the server tool {kind!r}", f"tools[{i}].type")
        unknown = set(tool) - {"type", "name", "description", "input_schema", "cache_control"}
        if unknown:
            raise _ApiError(400, f"tools[{i}]: unknown fields {sorted(unknown)}", param=f"tools[{i}]")
        if not isinstance(tool.get("input_schema"), dict):
            raise _ApiError(400, f"tools[{i}].input_schema: an object is required", param=f"tools[{i}]")
        # in the order Chat Completions and Responses declare them: the template writes them as given
        fn = {"name": tool.get("name")}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        fn["parameters"] = tool["input_schema"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: dict[str, Any] | None) -> tuple[str | dict[str, Any] | None, bool | None]:
    """``(chat tool_choice, parallel_tool_calls)``."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise _ApiError(400, f"tool_choice: unknown type {kind!r} (auto, any, tool, none)", param="tool_choice")


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise _ApiError(400, f"{where}.content must be a string or a list of content blocks", param=where)
    return content


def chat_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """``messages`` as chat messages: a user turn's ``tool_result`` blocks become tool messages
    (in place: text before and after them stays in user messages), an assistant's ``tool_use``
    blocks its ``tool_calls``."""
    out: list[dict[str, Any]] = []
    known: set[str] = set()
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise _ApiError(400, f"{where}.role must be 'user' or 'assistant'", param=where)
        unknown = set(m) - {"role", "content"}
        if unknown:
            raise _ApiError(400, f"{where}: unknown fields {sorted(unknown)}", param=where)
        blocks = _blocks(m.get("content"), where)
        if m["role"] == "assistant":
            out.append(_assistant(blocks, where, known))
            continue
        texts: list[str] = []
        for j, b in enumerate(blocks):
            at = f"{where}.content[{j}]"
            kind = b.get("type")
            if kind == "text":
                texts.append(_text_block(b, at))
            elif kind == "tool_result":
                if texts:
                    out.append({"role": "user", "content": "".join(texts)})
                    texts = []
                out.append(_tool_result(b, at, known))
            else:
                _refuse_block(kind, at)
        if texts or not blocks:
            out.append({"role": "user", "content": "".join(texts)})
    return out


def _text_block(b: dict[str, Any], at: str) -> str:
    if set(b) - {"type", "text", "cache_control", "citations"} or not isinstance(b.get("text"), str):
        raise _ApiError(400, f"{at}: a text block is {{type, text}} with text a string", param=at)
    if b.get("citations"):
        raise unsupported("citations", f"{at}.citations")
    return str(b["text"])


def _tool_result(b: dict[str, Any], at: str, known: set[str]) -> dict[str, Any]:
    unknown = set(b) - {"type", "tool_use_id", "content", "is_error", "cache_control"}
    if unknown:
        raise _ApiError(400, f"{at}: unknown fields {sorted(unknown)}", param=at)
    call_id = b.get("tool_use_id")
    if not isinstance(call_id, str) or call_id not in known:
        raise _ApiError(
            400, f"{at}.tool_use_id: no tool_use with id {call_id!r} precedes this tool_result", param=at
        )
    content = text_of(b.get("content", ""), f"{at}.content", ("text",))
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def _assistant(blocks: list[dict[str, Any]], where: str, known: set[str]) -> dict[str, Any]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, b in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = b.get("type")
        if kind == "text":
            texts.append(_text_block(b, at))
        elif kind == "tool_use":
            if set(b) - {"type", "id", "name", "input", "cache_control", "caller"}:
                raise _ApiError(400, f"{at}: unknown fields in a tool_use block", param=at)
            call_id, name, args = b.get("id"), b.get("name"), b.get("input")
            if not (
                isinstance(call_id, str) and call_id and isinstance(name, str) and isinstance(args, dict)
            ):
                raise _ApiError(
                    400, f"{at}: a tool_use needs id, name (strings) and input (an object)", param=at
                )
            arguments = json.dumps(args, ensure_ascii=False)
            calls.append(
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            )
            known.add(call_id)
        else:
            _refuse_block(kind, at)
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["tool_calls"] = calls
    return message


def _refuse_block(kind: Any, at: str) -> None:
    kind = kind if isinstance(kind, str) else None
    if kind in IMAGE_KINDS:
        raise unsupported(f"{kind} blocks (images, documents)", f"{at}.type")
    if kind in ("thinking", "redacted_thinking"):
        raise unsupported("extended thinking", f"{at}.type")
    if isinstance(kind, str) and (kind.startswith("server_tool") or kind.endswith("_tool_result")):
        raise unsupported(f"server tool blocks ({kind!r})", f"{at}.type")
    raise _ApiError(400, f"{at}.type: unknown or misplaced content block {kind!r}", param=f"{at}.type")


def to_chat(body: MessagesBody) -> dict[str, Any]:
    """The chat request fields of a Messages request (400 naming what it cannot serve)."""
    body.check_supported()
    system = []
    if body.system:
        system = [{"role": "system", "content": text_of(body.system, "system", ("text",))}]
    tool_choice, parallel = _tool_choice(body.tool_choice)
    return {
        "model": body.model,
        "messages": [*system, *chat_messages(body.messages)],
        "tools": _tools(body.tools),
        "tool_choice": tool_choice,
        "parallel_tool_calls": parallel,
        "max_tokens": body.max_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "stop": body.stop_sequences or None,
        "stream": body.stream,
        **{k: getattr(body, k) for k in EXTRA_SAMPLING},
    }


class _Reply:
    def __init__(self, server: OpenAIServer, body: MessagesBody) -> None:
        self.id = f"msg_{uuid.uuid4().hex}"
        self.server, self.body = server, body

    def stop(self, turn: Turn) -> tuple[str, str | None]:
        """``(stop_reason, stop_sequence)``."""
        if turn.finish == "tool_calls":
            return "tool_use", None
        if turn.finish == "length":
            return "max_tokens", None
        stops = self.body.stop_sequences or []
        if stops and "token_ids" in turn.rollart:
            text = self.server.template.decode(turn.rollart["token_ids"])
            found = [(text.find(s), s) for s in stops if s in text]
            if found:
                return "stop_sequence", min(found)[1]
        return "end_turn", None

    def content(self, turn: Turn) -> list[dict[str, Any]]:
        blocks: list[dict[str, Any]] = [{"type": "text", "text": turn.text}] if turn.text else []
        for c in turn.calls:
            fn = c["function"]
            blocks.append(
                {"type": "tool_use", "id": c["id"], "name": fn["name"], "input": json.loads(fn["arguments"])}
            )
        return blocks

    def message(self, turn: Turn | None, input_tokens: int) -> dict[str, Any]:
        reason, sequence = self.stop(turn) if turn is not None else (None, None)
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.server.model_name,
            "content": self.content(turn) if turn is not None else [],
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": {
                "input_tokens": input_tokens,
                "output_tokens": turn.completion_tokens if turn is not None else 0,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0,
            },
            **({"rollart": turn.rollart} if turn is not None else {}),
        }

    async def events(
        self, stream: AsyncGenerator[str | Turn, None], input_tokens: int, session: str | None
    ) -> AsyncIterator[str]:
        def event(kind: str, **data: Any) -> str:
            return sse(kind, {"type": kind, **data})

        yield event("message_start", message=self.message(None, input_tokens))
        text_open = False
        try:
            async with aclosing(stream):
                async for piece in stream:
                    if isinstance(piece, str):
                        if not text_open:
                            yield event(
                                "content_block_start", index=0, content_block={"type": "text", "text": ""}
                            )
                            text_open = True
                        yield event(
                            "content_block_delta", index=0, delta={"type": "text_delta", "text": piece}
                        )
                        continue
                    turn = piece
                    remember_canonical(self.server, session, turn)
                    if text_open:
                        yield event("content_block_stop", index=0)
                    blocks = self.content(turn)
                    for k, block in enumerate(blocks[1 if text_open else 0 :], start=1 if text_open else 0):
                        yield event("content_block_start", index=k, content_block={**block, "input": {}})
                        delta: dict[str, Any] = {
                            "type": "input_json_delta",
                            "partial_json": json.dumps(block["input"], ensure_ascii=False),
                        }
                        yield event("content_block_delta", index=k, delta=delta)
                        yield event("content_block_stop", index=k)
                    reason, sequence = self.stop(turn)
                    usage = {"input_tokens": turn.prompt_tokens, "output_tokens": turn.completion_tokens}
                    stop = {"stop_reason": reason, "stop_sequence": sequence}
                    yield event("message_delta", delta=stop, usage=usage, rollart=turn.rollart)
                    yield event("message_stop")
        except Exception as e:  # after the 200: the dialect's error event, not a cut connection
            yield event("error", error={"type": "api_error", "message": str(e)})


def add_messages_routes(app: FastAPI, server: OpenAIServer) -> None:
    """``POST /v1/messages`` on ``app``."""

    @app.post("/v1/messages")
    async def messages(request: Request) -> Any:
        try:
            body = MessagesBody.model_validate(await read_body(request))
        except ValidationError as e:
            raise validation_error(e) from None
        server._check_model(body.model)
        reply = _Reply(server, body)
        session = request.headers.get(server.session_header) or None
        result = await server._chat(chat_body(to_chat(body)), request, turns=True)
        if not isinstance(result, dict):  # the stream's text deltas, then its Turn
            input_tokens = int(getattr(request.state, "rollart_prompt_tokens", 0))
            events = reply.events(result, input_tokens, session)
            return StreamingResponse(events, media_type="text/event-stream")
        turn = turn_from_reply(result)
        remember_canonical(server, session, turn)
        return reply.message(turn, turn.prompt_tokens)
