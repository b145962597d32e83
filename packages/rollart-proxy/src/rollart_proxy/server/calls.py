"""The call path of chat and completions: admit, generate (one output, an enforced tool call, or the
``n`` sibling trajectories of a group) and answer: :class:`Calls`."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from rollart_core.types import GenerateOutput, GenerateRequest, SamplingParams
from rollart_proxy.proxy import LLMProxy
from rollart_proxy.server.admission import Admission
from rollart_proxy.server.chat_tokens import message_key, splice_encode
from rollart_proxy.server.dialect import Turn, turn_from_reply
from rollart_proxy.server.forced_call import CallPlan, generate_call, plan_call
from rollart_proxy.server.guard import _ApiError
from rollart_proxy.server.models import ChatBody, _Common, _message_dict
from rollart_proxy.server.responses import INLINE_CHARS, INLINE_TOKENS, Responses, off_loop
from rollart_proxy.server.tools import ToolsError, template_messages

__all__ = ["Calls"]


class Calls(Admission, Responses):
    """How :class:`~rollart_proxy.server.app.OpenAIServer` serves a call; it sets these attributes."""

    proxy: LLMProxy
    task_header: str
    _eot: tuple[int, str] | None

    async def _serve(
        self,
        endpoint: str,
        body: _Common,
        prompt_ids: list[int],
        max_tokens: int | None,
        request: Request,
        *,
        turns: bool = False,
    ) -> Any:
        """The reply as a dict, or a stream: chat or completions server-sent events, or with ``turns``
        (a dialect's call) text deltas and the :class:`~.dialect.Turn` (:meth:`_turns`)."""
        sampling, session = self._admit(body, prompt_ids, max_tokens, request)
        if body.n > 1:
            return await self._serve_group(endpoint, body, prompt_ids, sampling, request)
        rid = f"{session or 'anon'}-{uuid.uuid4().hex[:12]}"
        req = GenerateRequest(
            rid, prompt_ids, sampling, session_id=session, task=request.headers.get(self.task_header) or None
        )
        if body.stream:
            # Validate and route before the 200 goes out: errors up to the first token stay 4xx/503.
            parts = self.proxy.generate_stream(req)
            try:
                first = await anext(parts)
            except BaseException:
                await parts.aclose()  # type: ignore[attr-defined]
                raise
            events = self._stream(endpoint, body, first, parts, prompt_ids, session, sampling)
            if turns:
                return self._turns(events)
            return StreamingResponse(
                self._sse(endpoint, body, first.request_id, events), media_type="text/event-stream"
            )
        out = await self.proxy.generate(req)
        self._record(session, endpoint, prompt_ids, out, sampling)
        reply = await off_loop(  # detokenises
            len(out.token_ids), INLINE_TOKENS, self._response, endpoint, body, out, prompt_ids
        )
        if endpoint == "chat":
            message = reply["choices"][0]["message"]
            self._remember(session, message.get("content"), message.get("tool_calls"), out)
        return reply

    async def _serve_call(
        self, body: ChatBody, plan: CallPlan, prompt_ids: list[int], request: Request, turns: bool = False
    ) -> Any:
        """An enforced tool call (:mod:`.forced_call`): one engine call per undecided token."""
        if body.n > 1:
            raise _ApiError(400, "n > 1 cannot be combined with an enforced tool_choice", param="n")
        if body.allowed_token_ids is not None:
            raise _ApiError(
                400, "allowed_token_ids cannot be combined with an enforced tool_choice", param="tool_choice"
            )
        limit = body.max_completion_tokens or body.max_tokens
        if limit is not None and limit < plan.max_tokens:
            raise _ApiError(
                400,
                f"max_tokens {limit} is too small for the enforced call of {plan.function!r} "
                f"(up to {plan.max_tokens} tokens)",
                param="max_tokens",
            )
        sampling, session = self._admit(body, prompt_ids, plan.max_tokens, request)
        task = request.headers.get(self.task_header) or None

        async def generate(ids: list[int], step: SamplingParams) -> GenerateOutput:
            rid = f"{session or 'anon'}-{uuid.uuid4().hex[:12]}"
            out = await self.proxy.generate(GenerateRequest(rid, ids, step, session_id=session, task=task))
            self._record(session, "chat", ids, out, step)
            return out

        call = await generate_call(plan, prompt_ids, sampling, generate)
        reply = self._call_response(body, plan, call, prompt_ids)
        message = reply["choices"][0]["message"]
        if session:
            self.generated.remember(
                session, message_key(message["content"], message["tool_calls"]), call.token_ids
            )
        if body.stream:
            if turns:
                return _complete(turn_from_reply(reply))
            return StreamingResponse(self._call_sse(body, reply), media_type="text/event-stream")
        return reply

    async def _chat(self, body: ChatBody, request: Request, *, turns: bool = False) -> Any:
        """One chat call (the Responses and Messages dialects come here too, translated, with
        ``turns``): the reply as a dict, or a stream: a ``StreamingResponse`` of chat chunks, or
        with ``turns`` an async generator of text deltas and then the complete
        :class:`~.dialect.Turn`."""
        self._check_model(body.model)
        try:
            msgs = [_message_dict(m) for m in body.messages]
        except ValueError as e:
            raise _ApiError(400, str(e), param="messages") from None
        await self._check_tools(body)
        session = request.headers.get(self.session_header) or None
        splices: dict[int, list[int]] = {}
        if session is not None:
            for i, m in enumerate(msgs):
                if m["role"] == "assistant":
                    ids = self.generated.lookup(session, message_key(m["content"], m.get("tool_calls")))
                    if ids is not None:
                        splices[i] = ids
        kwargs: dict[str, Any] = {"tools": body.tools} if body.tools and body.tool_choice != "none" else {}
        size = sum(len(m["content"]) for m in msgs) + (len(body.tools_key()) if kwargs else 0)
        try:
            prompt_ids, _ = await off_loop(
                size,
                INLINE_CHARS,
                splice_encode,
                lambda ms: self.template.render(template_messages(ms), **kwargs),
                self.template.encode,
                msgs,
                splices,
                self._eot,
            )
        except Exception as e:  # the model's template refused these messages (raise_exception, bad roles)
            raise _ApiError(400, f"chat template: {e}", param="messages") from None
        if body.tools_active():
            try:
                plan = await off_loop(
                    size,
                    INLINE_CHARS,
                    plan_call,
                    self.template.render,
                    self.template.encode,
                    self._eot[1] if self._eot else None,
                    msgs,
                    body.tools,
                    body.tool_choice,
                )
            except ToolsError as e:
                raise _ApiError(400, str(e), param=e.param) from None
            if plan is not None:
                return await self._serve_call(body, plan, prompt_ids, request, turns)
        return await self._serve(
            "chat", body, prompt_ids, body.max_completion_tokens or body.max_tokens, request, turns=turns
        )

    async def _serve_group(
        self, endpoint: str, body: _Common, prompt_ids: list[int], sampling: SamplingParams, request: Request
    ) -> dict[str, Any]:
        """``n`` samples of one prompt as ``n`` sibling trajectories of one group: each choice is
        generated as its own request (a client's seed becomes ``seed + i``: vLLM's CPU engine fails on a
        seeded ``n > 1`` request), recorded under its own session ``<group_id>-<i>`` (which the
        client may continue) and listed in the group (``GET /v1/groups/{group_id}``). Recorded only
        when all ``n`` succeeded: a failed one aborts the others and nothing is kept."""
        n = body.n
        group_id = f"group-{uuid.uuid4().hex[:16]}"
        members = [f"{group_id}-{i}" for i in range(n)]
        task = request.headers.get(self.task_header) or None
        samplings = [
            sampling if sampling.seed is None else sampling.model_copy(update={"seed": sampling.seed + i})
            for i in range(n)
        ]
        jobs = [
            asyncio.ensure_future(
                self.proxy.generate(
                    GenerateRequest(f"{m}-{uuid.uuid4().hex[:12]}", prompt_ids, sp, session_id=m, task=task)
                )
            )
            for m, sp in zip(members, samplings, strict=True)
        ]
        try:
            outs = await asyncio.gather(*jobs)
        except BaseException:
            for job in jobs:  # a cancelled generate aborts its request on the engine
                job.cancel()
            await asyncio.gather(*jobs, return_exceptions=True)
            for m in members:
                self.proxy.end_session(m)
            raise
        principal = self._principal(request)
        for i, (m, out, sp) in enumerate(zip(members, outs, samplings, strict=True)):
            self.recorder.claim(m, principal)
            self.recorder.record(m, endpoint, prompt_ids, out, sp, group=(group_id, i, n))
        self.recorder.add_group(group_id, members)
        replies = [
            await off_loop(len(out.token_ids), INLINE_TOKENS, self._response, endpoint, body, out, prompt_ids)
            for out in outs
        ]
        choices = []
        for i, (m, out, reply) in enumerate(zip(members, outs, replies, strict=True)):
            choice = {**reply["choices"][0], "index": i}
            choices.append(choice)
            if endpoint == "chat":
                self._remember(m, choice["message"].get("content"), choice["message"].get("tool_calls"), out)
        completion = sum(len(out.token_ids) for out in outs)
        return {
            **replies[0],
            "id": group_id,
            "choices": choices,
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": completion,
                "total_tokens": len(prompt_ids) + completion,
            },
            "rollart": {
                "group_id": group_id,
                "sessions": members,
                "prompt_token_ids": prompt_ids,
                "choices": [
                    {k: v for k, v in r["rollart"].items() if k != "prompt_token_ids"} for r in replies
                ],
            },
        }


async def _complete(turn: Turn) -> AsyncGenerator[str | Turn, None]:
    """A reply complete before its stream starts (an enforced call), as a dialect's stream."""
    yield turn
