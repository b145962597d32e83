"""The OpenAI Responses dialect: ``POST /v1/responses`` on the chat path (:mod:`.dialect`).

What is served: ``input`` as a string or a list of items (messages of role ``user`` / ``system`` /
``developer`` / ``assistant`` with text parts, ``function_call`` and ``function_call_output``
items), ``instructions`` (a system message first), ``tools`` of type ``function``, ``tool_choice``
(``none`` / ``auto`` / ``required`` / a named function), ``parallel_tool_calls``,
``max_output_tokens``, ``temperature``, ``top_p``, ``previous_response_id`` (this server keeps the
latest :data:`MAX_STORED` responses, per API key, unless ``store: false``; ``GET`` and ``DELETE
/v1/responses/{id}`` read and drop them), ``stream`` (the
Responses event types: ``response.created`` … ``response.output_text.delta`` …
``response.function_call_arguments.done`` … ``response.completed`` / ``response.incomplete``), and
``usage``; plus vLLM's ``top_k``, ``seed``, ``stop``, ``stop_token_ids``, ``allowed_token_ids``.

An assistant ``message`` item and the ``function_call`` items right after it are one assistant turn:
sent back as this server wrote them, they are spliced in as their sampled ids (token-exact, as in
Chat Completions). A ``function_call_output`` whose ``call_id`` names no earlier ``function_call``
(of the input or of the previous response) is a 400, checked before anything is generated.

Refused with a 400 naming the feature: hosted tools (web search, file search, computer use, code
interpreter, MCP, image generation, shell, custom tools), images / files / audio, reasoning,
structured output (``text.format`` other than ``text``), ``include``, ``background``,
``conversation``, ``prompt`` templates, ``truncation: auto``, ``max_tool_calls``, logprobs.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rollart_proxy.server.dialect import (
    EXTRA_SAMPLING,
    Turn,
    chat_body,
    read_body,
    sse,
    text_of,
    turn_from_reply,
    unsupported,
    validation_error,
)
from rollart_proxy.server.guard import _ApiError
from rollart_proxy.server.models import INT32_MAX
from rollart_proxy.server.sessions import _ADMIN

if TYPE_CHECKING:
    from rollart_proxy.server.app import OpenAIServer

__all__ = ["MAX_STORED", "ResponsesBody", "add_responses_routes", "to_chat"]

MAX_STORED = 1024
"""Responses kept for ``previous_response_id`` (the oldest goes first)."""

HOSTED_ITEMS = frozenset(
    {
        "file_search_call",
        "web_search_call",
        "computer_call",
        "computer_call_output",
        "code_interpreter_call",
        "image_generation_call",
        "local_shell_call",
        "local_shell_call_output",
        "shell_call",
        "shell_call_output",
        "apply_patch_call",
        "apply_patch_call_output",
        "mcp_list_tools",
        "mcp_approval_request",
        "mcp_approval_response",
        "mcp_call",
        "custom_tool_call",
        "custom_tool_call_output",
        "tool_search_call",
        "tool_search_output",
    }
)
TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    input: str | list[Any]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None
    # vLLM's sampling fields (as Chat Completions takes them)
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None

    def check_supported(self) -> None:
        fmt = (self.text or {}).get("format") or {"type": "text"}
        if not isinstance(fmt, dict):
            raise _ApiError(400, "text.format must be an object", param="text")
        refused = [
            (self.truncation == "auto", "truncation 'auto'", "truncation"),
            (fmt.get("type") != "text", f"text.format {fmt.get('type')!r} (structured output)", "text"),
            (bool(self.reasoning and any(self.reasoning.values())), "reasoning", "reasoning"),
            (bool(self.include), f"include {self.include}", "include"),
            (bool(self.background), "background mode", "background"),
            (self.conversation is not None, "conversation", "conversation"),
            (self.prompt is not None, "prompt templates", "prompt"),
            (self.max_tool_calls is not None, "max_tool_calls", "max_tool_calls"),
            (bool(self.top_logprobs), "top_logprobs", "top_logprobs"),
        ]
        for bad, feature, param in refused:
            if bad:
                raise unsupported(feature, param)


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise unsupported(f"the hosted tool {kind!r}", f"tools[{i}].type")
        unknown = set(tool) - {"type", "name", "description", "parameters", "strict"}
        if unknown:
            raise _ApiError(400, f"tools[{i}]: unknown fields {sorted(unknown)}", param=f"tools[{i}]")
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise unsupported(f"tool_choice of type {choice.get('type')!r}", "tool_choice")


def input_messages(items: str | list[Any], known_calls: set[str]) -> list[dict[str, Any]]:
    """``input`` as chat messages. ``known_calls``: the call ids of earlier turns (the previous
    response's); the input's own ``function_call`` ids are added as they come."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    open_assistant = False  # the last message out is an assistant turn that calls may join
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _ApiError(400, f"{where} must be an object", param=where)
        kind = item.get("type", "message" if "role" in item else None)
        kind = kind if isinstance(kind, str) else None
        if kind == "message":
            _fields(item, {"type", "role", "content", "id", "status", "phase"}, where)
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _ApiError(
                    400, f"{where}.role must be user, system, developer or assistant", param=where
                )
            content = item.get("content")
            if isinstance(content, list):  # an assistant's refusal part holds its text as "refusal"
                content = [_refusal_as_text(p) for p in content]
            text = text_of(content, f"{where}.content", (*TEXT_PARTS, "refusal"))
            out.append({"role": "system" if role == "developer" else role, "content": text})
            open_assistant = role == "assistant"
        elif kind == "function_call":
            _fields(item, {"type", "call_id", "name", "arguments", "id", "status"}, where)
            call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments")
            if not (isinstance(call_id, str) and call_id and isinstance(name, str) and isinstance(args, str)):
                raise _ApiError(
                    400, f"{where}: a function_call needs call_id, name and arguments (strings)", param=where
                )
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            if not open_assistant:
                out.append({"role": "assistant", "content": ""})
                open_assistant = True
            out[-1].setdefault("tool_calls", []).append(call)
            known_calls.add(call_id)
        elif kind == "function_call_output":
            _fields(item, {"type", "call_id", "output", "id", "status"}, where)
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or call_id not in known_calls:
                raise _ApiError(
                    400,
                    f"{where}.call_id: no function_call with call_id {call_id!r} precedes this output",
                    param=f"{where}.call_id",
                )
            output = text_of(item.get("output"), f"{where}.output", ("input_text", "output_text", "text"))
            out.append({"role": "tool", "tool_call_id": call_id, "content": output})
            open_assistant = False
        elif kind in HOSTED_ITEMS:
            raise unsupported(f"the hosted tool item {kind!r}", f"{where}.type")
        elif kind in ("reasoning", "item_reference", "compaction"):
            raise unsupported(f"{kind} items", f"{where}.type")
        else:
            raise _ApiError(400, f"{where}.type: unknown item type {kind!r}", param=f"{where}.type")
    return out


def _refusal_as_text(part: Any) -> Any:
    if isinstance(part, dict) and part.get("type") == "refusal" and "text" not in part:
        return {"type": "refusal", "text": part.get("refusal")}
    return part


def _fields(item: dict[str, Any], allowed: set[str], where: str) -> None:
    unknown = set(item) - allowed
    if unknown:
        raise _ApiError(400, f"{where}: unknown fields {sorted(unknown)}", param=where)


def to_chat(
    body: ResponsesBody, history: list[dict[str, Any]]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``(chat request fields, the conversation to keep for a later previous_response_id)``:
    ``history`` is the previous response's conversation (its input and output, not its instructions)."""
    body.check_supported()
    known = {c["id"] for m in history for c in m.get("tool_calls") or ()}
    conversation = [*history, *input_messages(body.input, known)]
    if not conversation:
        raise _ApiError(400, "input: no items", param="input")
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    fields = {
        "model": body.model,
        "messages": [*system, *conversation],
        "tools": _tools(body.tools),
        "tool_choice": _tool_choice(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls,
        "max_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "stop": body.stop,
        "stream": body.stream,
        "user": body.user,
        **{k: getattr(body, k) for k in EXTRA_SAMPLING},
    }
    return fields, conversation


class _Reply:
    """The Response object of one call (ids fixed before the stream starts)."""

    def __init__(self, server: OpenAIServer, body: ResponsesBody) -> None:
        self.id = f"resp_{uuid.uuid4().hex}"
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.created = time.time()
        self.server, self.body = server, body

    def message_item(self, text: str, status: str) -> dict[str, Any]:
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": content if status != "in_progress" else [],
        }

    def output(self, turn: Turn) -> list[dict[str, Any]]:
        status = "incomplete" if turn.finish == "length" else "completed"
        items = [self.message_item(turn.text, status)] if turn.text else []
        for c in turn.calls:
            items.append(
                {
                    "id": f"fc_{c['id']}",
                    "type": "function_call",
                    "call_id": c["id"],
                    "name": c["function"]["name"],
                    "arguments": c["function"]["arguments"],
                    "status": "completed",
                }
            )
        return items

    def response(self, turn: Turn | None) -> dict[str, Any]:
        body = self.body
        status = "in_progress" if turn is None else "incomplete" if turn.finish == "length" else "completed"
        usage = None
        if turn is not None:
            usage = {
                "input_tokens": turn.prompt_tokens,
                "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                "output_tokens": turn.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": turn.prompt_tokens + turn.completion_tokens,
            }
        reply: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": self.server.model_name,
            "output": self.output(turn) if turn is not None else [],
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "temperature": body.temperature if body.temperature is not None else 1.0,
            "top_p": body.top_p if body.top_p is not None else 1.0,
            "tool_choice": body.tool_choice or "auto",
            "tools": body.tools or [],
            "text": {"format": {"type": "text"}},
            "truncation": "disabled",
            "store": body.store is not False,
            "metadata": body.metadata or {},
            "user": body.user,
            "usage": usage,
        }
        if turn is not None:
            reply["rollart"] = turn.rollart
        return reply

    async def events(
        self, stream: AsyncGenerator[str | Turn, None], done: Callable[[Turn, dict[str, Any]], None]
    ) -> AsyncIterator[str]:
        """The Responses stream of the chat stream; ``done(turn, response)`` runs once the turn is
        complete, with the final Response object."""
        seq = 0

        def event(kind: str, **data: Any) -> str:
            nonlocal seq
            seq += 1
            return sse(kind, {"type": kind, "sequence_number": seq - 1, **data})

        yield event("response.created", response=self.response(None))
        yield event("response.in_progress", response=self.response(None))
        text: list[str] = []
        part = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        try:
            async with aclosing(stream):
                async for piece in stream:
                    if isinstance(piece, str):
                        if not text:
                            yield event(
                                "response.output_item.added",
                                output_index=0,
                                item=self.message_item("", "in_progress"),
                            )
                            yield event(
                                "response.content_part.added",
                                **part,
                                part={"type": "output_text", "text": "", "annotations": []},
                            )
                        text.append(piece)
                        yield event("response.output_text.delta", **part, delta=piece, logprobs=[])
                        continue
                    turn = piece
                    final = self.response(turn)
                    done(turn, final)
                    items = final["output"]
                    if text:
                        full = items[0]
                        yield event("response.output_text.done", **part, text=turn.text, logprobs=[])
                        yield event("response.content_part.done", **part, part=full["content"][0])
                        yield event("response.output_item.done", output_index=0, item=full)
                    for k, item in enumerate(items[1 if text else 0 :], start=1 if text else 0):
                        yield event(
                            "response.output_item.added",
                            output_index=k,
                            item={**item, "arguments": "", "status": "in_progress"},
                        )
                        ids = {"item_id": item["id"], "output_index": k}
                        yield event("response.function_call_arguments.delta", **ids, delta=item["arguments"])
                        yield event(
                            "response.function_call_arguments.done",
                            **ids,
                            name=item["name"],
                            arguments=item["arguments"],
                        )
                        yield event("response.output_item.done", output_index=k, item=item)
                    kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
                    yield event(kind, response=final)
        except Exception as e:  # after the 200: the dialect's failure event, not a cut connection
            failed = {
                **self.response(None),
                "status": "failed",
                "error": {"code": "server_error", "message": str(e)},
            }
            yield event("response.failed", response=failed)


@dataclass(slots=True)
class _Stored:
    principal: str | None
    conversation: list[dict[str, Any]]
    """The chat messages up to and including this response (what ``previous_response_id`` continues)."""
    response: dict[str, Any]
    """The Response object as it was returned (``GET /v1/responses/{id}``)."""


class _Store:
    """Recent responses, per principal (bounded): their conversations for ``previous_response_id``,
    their objects for ``GET`` / ``DELETE /v1/responses/{id}``. Another principal's response is
    answered as unknown (its existence is not disclosed)."""

    def __init__(self, size: int = MAX_STORED) -> None:
        self.size = size
        self._items: OrderedDict[str, _Stored] = OrderedDict()

    def find(self, response_id: str, principal: str | None) -> _Stored | None:
        kept = self._items.get(response_id)
        if kept is None or (principal != _ADMIN and kept.principal != principal):
            return None
        return kept

    def get(self, response_id: str, principal: str | None) -> list[dict[str, Any]]:
        kept = self.find(response_id, principal)
        if kept is None:
            raise _ApiError(
                400,
                f"previous_response_id: no response {response_id!r} (unknown, not stored or too old)",
                param="previous_response_id",
            )
        return list(kept.conversation)

    def put(self, response_id: str, stored: _Stored) -> None:
        self._items[response_id] = stored
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def delete(self, response_id: str, principal: str | None) -> bool:
        if self.find(response_id, principal) is None:
            return False
        del self._items[response_id]
        return True


def _not_found(response_id: str) -> _ApiError:
    return _ApiError(
        404, f"no response {response_id!r} (unknown, not stored or too old)", param="response_id"
    )


def add_responses_routes(app: FastAPI, server: OpenAIServer) -> None:
    """``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}`` on ``app``."""
    store = _Store()

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str, request: Request) -> Any:
        kept = store.find(response_id, server._principal(request))
        if kept is None:
            raise _not_found(response_id)
        return kept.response

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str, request: Request) -> Any:
        if not store.delete(response_id, server._principal(request)):
            raise _not_found(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    @app.post("/v1/responses")
    async def responses(request: Request) -> Any:
        try:
            body = ResponsesBody.model_validate(await read_body(request))
        except ValidationError as e:
            raise validation_error(e) from None
        server._check_model(body.model)
        principal = server._principal(request)
        history = store.get(body.previous_response_id, principal) if body.previous_response_id else []
        fields, conversation = to_chat(body, history)
        reply = _Reply(server, body)

        def done(turn: Turn, response: dict[str, Any]) -> None:
            if body.store is not False:  # the object returned, built once
                store.put(reply.id, _Stored(principal, [*conversation, turn.history_message()], response))

        result = await server._chat(chat_body(fields), request, turns=True)
        if not isinstance(result, dict):  # the stream's text deltas, then its Turn
            return StreamingResponse(reply.events(result, done), media_type="text/event-stream")
        turn = turn_from_reply(result)
        response = reply.response(turn)
        done(turn, response)
        return response
