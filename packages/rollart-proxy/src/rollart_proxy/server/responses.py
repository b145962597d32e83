"""The answers of the endpoint: one JSON body (:meth:`Responses._response`) or a stream
(:meth:`Responses._stream`) written as server-sent events (:meth:`Responses._sse`) or handed to a
dialect (:meth:`Responses._turns`), with the call recorded for the trainer and the reply's token ids
kept for the next turn. :class:`~rollart_proxy.server.app.OpenAIServer` inherits them."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, TypeVar

from rollart_core.types import GenerateOutput, SamplingParams
from rollart_proxy.server.chat_template import ChatTemplate
from rollart_proxy.server.chat_tokens import GeneratedMessages, message_key
from rollart_proxy.server.dialect import Turn
from rollart_proxy.server.forced_call import CallPlan, ForcedCall
from rollart_proxy.server.models import ChatBody, _Common
from rollart_proxy.server.sessions import SessionRecorder
from rollart_proxy.server.tools import ToolCallParser

__all__ = ["INLINE_CHARS", "INLINE_TOKENS", "Responses", "StreamDelta", "StreamEnd", "off_loop"]

T = TypeVar("T")

INLINE_CHARS = 8192
"""Text up to this many characters is templated and tokenised on the event loop; longer text in a
worker thread. Why not always a thread: the tokenizer holds the GIL (two threads encoding run slower
than one), so a thread never runs it beside the loop; it only lets the loop in at the interpreter's
switch interval (5 ms). For an agent's typical turn (a ~2k-character prompt: ~1 ms of work) the hop
cost more than the work (~0.5 ms a hop at 32 concurrent requests on 2 cores); for a long
conversation the slices keep other requests' streams flowing."""
INLINE_TOKENS = 2048
"""Outputs up to this many tokens are detokenised (and tool-parsed) on the event loop."""


async def off_loop(size: int, limit: int, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on the loop when ``size <= limit``, else in a worker thread (see INLINE_CHARS)."""
    if size <= limit:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


@dataclass(slots=True)
class StreamDelta:
    """New text of a stream (possibly empty) and the tokens generated since the last delta."""

    text: str
    token_ids: list[int]
    logprobs: list[float]


@dataclass(slots=True)
class StreamEnd:
    """The end of a stream: the text and tokens not yet sent, the tool calls (chat ``tool_calls``),
    why a call the output seems to hold was not returned, the finish reason, usage and ``rollart``."""

    rest: StreamDelta
    calls: list[dict[str, Any]]
    error: str | None
    finish: str
    usage: dict[str, int]
    rollart: dict[str, Any]


class Responses:
    """How :class:`~rollart_proxy.server.app.OpenAIServer` answers a call; it sets these attributes."""

    template: ChatTemplate
    tool_parser: ToolCallParser | None
    model_name: str
    recorder: SessionRecorder
    generated: GeneratedMessages

    def _record(
        self,
        session: str | None,
        endpoint: str,
        prompt_ids: list[int],
        out: GenerateOutput,
        sampling: SamplingParams | None = None,
    ) -> None:
        if session:
            self.recorder.record(session, endpoint, prompt_ids, out, sampling)

    def _remember(
        self,
        session: str | None,
        content: str | None,
        tool_calls: list[dict[str, Any]] | None,
        out: GenerateOutput,
    ) -> None:
        """Keep the reply's sampled ids: the client may send this assistant message back."""
        if session:
            self.generated.remember(session, message_key(content, tool_calls), out.token_ids)

    def _tool_reply(self, body: ChatBody, text: str) -> tuple[str | None, list[dict[str, Any]], str | None]:
        assert self.tool_parser is not None and body.tools  # checked by _check_tools
        return self.tool_parser.parse(
            text, body.tools, body.tool_choice, body.parallel_tool_calls is not False, body.tools_key()
        )

    def _text(self, out: GenerateOutput, stops: tuple[str, ...]) -> tuple[str, str]:
        text = self.template.decode(out.token_ids)
        finish = "length" if out.finish_reason == "length" else "stop"
        for s in stops:  # the engine stopped on it; OpenAI excludes it from the text
            i = text.find(s)
            if i >= 0:
                text = text[:i]
        return text, finish

    def _extra(self, out: GenerateOutput, prompt_ids: list[int]) -> dict[str, Any]:
        return {
            "prompt_token_ids": prompt_ids,
            "token_ids": out.token_ids,
            "versions": out.versions,
            "worker": out.worker,
            "engine_finish_reason": out.finish_reason,
        }

    def _response(
        self, endpoint: str, body: _Common, out: GenerateOutput, prompt_ids: list[int]
    ) -> dict[str, Any]:
        text, finish = self._text(out, body.stops())
        usage = {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": len(out.token_ids),
            "total_tokens": len(prompt_ids) + len(out.token_ids),
        }
        base: dict[str, Any] = {  # the JSON response body
            "id": out.request_id,
            "created": int(time.time()),
            "model": self.model_name,
            "usage": usage,
            "rollart": self._extra(out, prompt_ids),
        }
        toks = [self.template.token_str(t) for t in out.token_ids]
        lp: dict[str, Any] | None = None  # the choice's JSON "logprobs" object
        if endpoint == "chat":
            if getattr(body, "logprobs", False):
                lp = {
                    "content": [
                        {"token": t, "logprob": p, "bytes": list(t.encode()), "top_logprobs": []}
                        for t, p in zip(toks, out.logprobs, strict=True)
                    ]
                }
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if isinstance(body, ChatBody) and body.tools_active():
                content, calls, error = self._tool_reply(body, text)
                message["content"] = content
                if calls:
                    message["tool_calls"] = calls
                    finish = "tool_calls" if finish == "stop" else finish
                if error:
                    base["rollart"]["tool_call_error"] = error
            return {
                **base,
                "object": "chat.completion",
                "choices": [{"index": 0, "message": message, "logprobs": lp, "finish_reason": finish}],
            }
        if getattr(body, "logprobs", None) is not None:
            lp = {"tokens": toks, "token_logprobs": out.logprobs, "top_logprobs": None, "text_offset": None}
        return {
            **base,
            "object": "text_completion",
            "choices": [{"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}],
        }

    def _call_response(
        self, body: ChatBody, plan: CallPlan, call: ForcedCall, prompt_ids: list[int]
    ) -> dict[str, Any]:
        """The reply of an enforced tool call (:mod:`.forced_call`): the call, no content. Logprobs
        are the engine's for the model's choices and 0.0 for the fixed text (it had probability 1)."""
        lp = None
        if body.logprobs:
            toks = [self.template.token_str(t) for t in call.token_ids]
            lp = {
                "content": [
                    {"token": t, "logprob": p, "bytes": list(t.encode()), "top_logprobs": []}
                    for t, p in zip(toks, call.logprobs, strict=True)
                ]
            }
        tool_call = {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": plan.function, "arguments": json.dumps(call.arguments, ensure_ascii=False)},
        }
        last = call.outputs[-1] if call.outputs else None
        return {
            "id": last.request_id if last else f"call-{uuid.uuid4().hex[:12]}",
            "created": int(time.time()),
            "model": self.model_name,
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": len(call.token_ids),
                "total_tokens": len(prompt_ids) + len(call.token_ids),
            },
            "rollart": {
                "prompt_token_ids": prompt_ids,
                "token_ids": call.token_ids,
                "versions": call.versions,
                "worker": last.worker if last else "",
                "engine_finish_reason": "stop",
                "engine_calls": len(call.outputs),
                "enforced_tool_call": True,
            },
            "object": "chat.completion",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": None, "tool_calls": [tool_call]},
                    "logprobs": lp,
                    "finish_reason": "tool_calls",
                }
            ],
        }

    async def _call_sse(self, body: ChatBody, reply: dict[str, Any]) -> AsyncIterator[str]:
        """An enforced call's reply as server-sent events (it is complete before the first event)."""
        head = {"id": reply["id"], "created": reply["created"], "model": reply["model"]}
        choice = reply["choices"][0]
        calls = [{"index": i, **c} for i, c in enumerate(choice["message"]["tool_calls"])]
        delta = {"role": "assistant", "content": None, "tool_calls": calls}
        chunks: list[dict[str, Any]] = [
            {"index": 0, "delta": delta, "logprobs": choice["logprobs"], "finish_reason": None},
            {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "tool_calls"},
        ]
        for c in chunks:
            yield f"data: {json.dumps({**head, 'object': 'chat.completion.chunk', 'choices': [c]})}\n\n"
        if (body.stream_options or {}).get("include_usage"):
            tail = {"choices": [], "usage": reply["usage"], "rollart": reply["rollart"]}
            yield f"data: {json.dumps({**head, 'object': 'chat.completion.chunk', **tail})}\n\n"
        yield "data: [DONE]\n\n"

    async def _stream(
        self,
        endpoint: str,
        body: _Common,
        first: GenerateOutput,
        parts: AsyncIterator[GenerateOutput],
        prompt_ids: list[int],
        session: str | None,
        sampling: SamplingParams | None = None,
    ) -> AsyncGenerator[StreamDelta | StreamEnd, None]:
        """A streamed output as :class:`StreamDelta`\ s (text detokenised incrementally), then its
        :class:`StreamEnd`; the call is recorded (and a chat reply's ids kept) before the end.
        Chat and completions write it as their server-sent events (:meth:`_sse`), the dialects as
        theirs (:meth:`_turns`): one pass, no chunk serialised and parsed again.

        Text that could still turn out to be the start of a stop string (or half a UTF-8
        character) is held back until the next delta or the end. Closing this generator (the client
        went away) aborts the request on its engine (closing ``parts`` cancels it).
        """
        stops = body.stops()
        hold = max((len(x) for x in stops), default=1) - 1
        tools = isinstance(body, ChatBody) and body.tools_active()
        ids: list[int] = []
        lps: list[float] = []
        sent_text = 0
        sent_tokens = 0
        started = False  # completions send a chunk for every part (its tokens), chat only with new text
        every = endpoint != "chat"
        try:
            part: GenerateOutput | None = first
            while part is not None and not part.finish_reason:
                ids += part.token_ids
                lps += part.logprobs
                # a tool call is only known once the output is complete: all text comes at the end,
                # and there is nothing to decode before it
                text = "" if tools else await off_loop(len(ids), INLINE_TOKENS, self.template.decode, ids)
                safe = len(text) - hold
                while safe > sent_text and text[safe - 1] == "\ufffd":  # an incomplete UTF-8 sequence
                    safe -= 1
                if safe > sent_text or not started or every:
                    yield StreamDelta(
                        text[sent_text : max(safe, sent_text)], ids[sent_tokens:], lps[sent_tokens:]
                    )
                    sent_text = max(safe, sent_text)
                    sent_tokens = len(ids)
                    started = True
                part = await anext(parts, None)
        finally:
            await parts.aclose()  # type: ignore[attr-defined]
        if part is None:  # the proxy always ends with the complete output
            raise RuntimeError(f"stream of {first.request_id} ended without a complete output")
        out = part
        self._record(session, endpoint, prompt_ids, out, sampling)
        text, finish = await off_loop(len(out.token_ids), INLINE_TOKENS, self._text, out, stops)
        calls: list[dict[str, Any]] = []
        error: str | None = None
        content: str | None = text
        if tools:
            assert isinstance(body, ChatBody)
            content, calls, error = await off_loop(len(text), INLINE_CHARS, self._tool_reply, body, text)
            text = content or ""
        if endpoint == "chat":
            self._remember(session, content, calls or None, out)
        if calls:
            finish = "tool_calls" if finish == "stop" else finish
        usage = {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": len(out.token_ids),
            "total_tokens": len(prompt_ids) + len(out.token_ids),
        }
        yield StreamEnd(
            StreamDelta(text[sent_text:], out.token_ids[sent_tokens:], out.logprobs[sent_tokens:]),
            calls,
            error,
            finish,
            usage,
            self._extra(out, prompt_ids),
        )

    async def _sse(
        self,
        endpoint: str,
        body: _Common,
        request_id: str,
        events: AsyncGenerator[StreamDelta | StreamEnd, None],
    ) -> AsyncIterator[str]:
        """A stream (:meth:`_stream`) as chat or completions server-sent events: one chunk per delta."""
        head = {"id": request_id, "created": int(time.time()), "model": self.model_name}
        obj = "chat.completion.chunk" if endpoint == "chat" else "text_completion"
        want_lp = (
            bool(getattr(body, "logprobs", False))
            if endpoint == "chat"
            else getattr(body, "logprobs", None) is not None
        )
        role_sent = False

        def chunk(text: str, new_ids: list[int], new_lps: list[float], finish: str | None) -> str:
            nonlocal role_sent
            lp: dict[str, Any] | None = None
            if want_lp and new_ids:
                toks = [self.template.token_str(t) for t in new_ids]
                lp = (
                    {
                        "content": [
                            {"token": t, "logprob": p, "bytes": list(t.encode()), "top_logprobs": []}
                            for t, p in zip(toks, new_lps, strict=True)
                        ]
                    }
                    if endpoint == "chat"
                    else {
                        "tokens": toks,
                        "token_logprobs": new_lps,
                        "top_logprobs": None,
                        "text_offset": None,
                    }
                )
            if endpoint == "chat":
                delta: dict[str, Any] = {"content": text} if text or finish is None else {}
                if not role_sent:
                    delta["role"], role_sent = "assistant", True
                c: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}
            else:
                c = {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}
            return f"data: {json.dumps({**head, 'object': obj, 'choices': [c]})}\n\n"

        async with aclosing(events):
            async for event in events:
                if isinstance(event, StreamDelta):
                    yield chunk(event.text, event.token_ids, event.logprobs, None)
                    continue
                rest = event.rest
                if rest.text or rest.token_ids:
                    yield chunk(rest.text, rest.token_ids, rest.logprobs, None)
                if event.calls:
                    deltas = [{"index": i, **c} for i, c in enumerate(event.calls)]
                    yield f"data: {json.dumps({**head, 'object': obj, 'choices': [{'index': 0, 'delta': {'tool_calls': deltas}, 'logprobs': None, 'finish_reason': None}]})}\n\n"
                if event.error:
                    yield f"data: {json.dumps({**head, 'object': obj, 'choices': [], 'rollart': {'tool_call_error': event.error}})}\n\n"
                yield chunk("", [], [], event.finish)
                if (body.stream_options or {}).get("include_usage"):
                    yield f"data: {json.dumps({**head, 'object': obj, 'choices': [], 'usage': event.usage, 'rollart': event.rollart})}\n\n"
        yield "data: [DONE]\n\n"

    @staticmethod
    async def _turns(
        events: AsyncGenerator[StreamDelta | StreamEnd, None],
    ) -> AsyncGenerator[str | Turn, None]:
        """A chat stream (:meth:`_stream`) as the dialects take it: its text deltas, then the
        complete :class:`~.dialect.Turn`. Closing this closes the stream (which aborts the request
        on its engine, and records nothing)."""
        text: list[str] = []
        async with aclosing(events):
            async for event in events:
                delta = event if isinstance(event, StreamDelta) else event.rest
                if delta.text:
                    text.append(delta.text)
                    yield delta.text
                if isinstance(event, StreamEnd):
                    rollart = {"tool_call_error": event.error} if event.error else {}
                    usage = event.usage
                    yield Turn(
                        "".join(text),
                        event.calls,
                        event.finish,
                        usage["prompt_tokens"],
                        usage["completion_tokens"],
                        {**rollart, **event.rollart},
                    )
