"""Admission of a call: the checks a chat or completions request passes before it is generated
(model, tools, prompt and sampling within bounds, session access, ``n``): :class:`Admission`."""

from __future__ import annotations

import asyncio

from fastapi import Request
from pydantic import ValidationError

from rollart_core.serving import INT64_MAX
from rollart_core.types import SamplingParams
from rollart_proxy.server.chat_template import ChatTemplate
from rollart_proxy.server.guard import Access, _ApiError
from rollart_proxy.server.models import ChatBody, _Common
from rollart_proxy.server.sessions import _BOUND, SessionTableFull
from rollart_proxy.server.tools import ToolCallParser, ToolsError, check_tool_choice, check_tools

__all__ = ["Admission"]


class Admission(Access):
    """How :class:`~rollart_proxy.server.app.OpenAIServer` checks a call; it sets these attributes."""

    template: ChatTemplate
    tool_parser: ToolCallParser | None
    model_name: str
    _model_aliases: set[str]
    max_model_len: int | None
    default_max_tokens: int
    session_header: str
    max_n: int
    refused: dict[str, int]

    async def _check_tools(self, body: ChatBody) -> None:
        try:
            if body.tools:
                check_tools(body.tools, body.tools_key())
            check_tool_choice(body.tool_choice, body.tools)
            if body.tools_active():
                if self.tool_parser is None:
                    raise ToolsError(
                        "this server has no tool parser (tool_parser=None): tools are not served", "tools"
                    )
                if not self.tool_parser.loaded:  # the first tools request imports vLLM: seconds
                    await asyncio.to_thread(self.tool_parser.load)
        except ToolsError as e:
            raise _ApiError(400, str(e), param=e.param) from None

    def _check_model(self, model: str) -> None:
        if model not in self._model_aliases:
            raise _ApiError(
                404,
                f"The model {model!r} does not exist (served: {self.model_name!r})",
                "model_not_found",
                "model",
            )

    def _admit(
        self, body: _Common, prompt_ids: list[int], max_tokens: int | None, request: Request
    ) -> tuple[SamplingParams, str | None]:
        """Check a request's prompt, sampling and session: ``(sampling, session)`` or an _ApiError."""
        if not prompt_ids:
            raise _ApiError(400, "empty prompt", param="prompt")
        if self.max_model_len is not None and len(prompt_ids) >= self.max_model_len:
            raise _ApiError(
                400,
                f"prompt of {len(prompt_ids)} tokens exceeds the context of {self.max_model_len}",
                "context_length_exceeded",
                "prompt",
            )
        self._check_token_ids(body, prompt_ids)
        request.state.rollart_prompt_tokens = len(prompt_ids)  # for a dialect's stream head
        if max_tokens is None:
            room = (self.max_model_len - len(prompt_ids)) if self.max_model_len else self.default_max_tokens
            max_tokens = max(1, min(self.default_max_tokens, room))
        elif self.max_model_len is not None:
            if max_tokens > self.max_model_len:
                raise _ApiError(
                    400,
                    f"max_tokens {max_tokens} exceeds the context of {self.max_model_len} tokens",
                    "context_length_exceeded",
                    "max_tokens",
                )
            # the engine stops at the context anyway: say so in the request, not only in the result
            max_tokens = min(max_tokens, self.max_model_len - len(prompt_ids))
        try:
            sampling = SamplingParams(
                max_tokens=max_tokens,
                temperature=body.temperature,
                top_p=body.top_p,
                top_k=body.top_k,
                stop=body.stops(),
                stop_token_ids=tuple(body.stop_token_ids or ()),
                allowed_token_ids=tuple(body.allowed_token_ids)
                if body.allowed_token_ids is not None
                else None,
                seed=body.seed,
            )
        except ValidationError as e:
            raise _ApiError(400, f"invalid sampling parameters: {e.errors()[0].get('msg')}") from None
        session = request.headers.get(self.session_header) or None
        principal = self._principal(request)
        if principal is not None and principal.startswith(_BOUND) and session != principal[len(_BOUND) :]:
            bound = principal[len(_BOUND) :]
            self.refused[bound] = self.refused.get(bound, 0) + 1
            raise _ApiError(
                403,
                f"this client is bound to session {bound!r}; it may not call session {session!r}",
                "permission_denied",
            )
        if body.n > 1:
            self._check_n(body, session)
        is_bound = principal is not None and principal.startswith(_BOUND)  # to this session (checked above)
        if session is not None and not is_bound and not self.recorder.claim(session, principal):
            raise _ApiError(403, f"session {session!r} belongs to another API key", "permission_denied")
        return sampling, session

    def _check_token_ids(self, body: _Common, prompt_ids: list[int]) -> None:
        """Every token id of a request (prompt, ``stop_token_ids``, ``allowed_token_ids``) is in the
        vocabulary: an id beyond it would reach the engine (400 naming the field otherwise)."""
        vocab = self.template.vocab_size
        for field, ids in (
            ("prompt", prompt_ids),
            ("stop_token_ids", body.stop_token_ids or ()),
            ("allowed_token_ids", body.allowed_token_ids or ()),
        ):
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise _ApiError(
                    400, f"{field}: token id {bad} is outside the vocabulary (0 to {vocab - 1})", param=field
                )

    def _check_n(self, body: _Common, session: str | None) -> None:
        if session is not None:
            raise _ApiError(
                400,
                f"n > 1 is not supported with a session ({self.session_header}): one call is one turn of "
                "one trajectory; without the header, n > 1 samples n sibling trajectories of one group",
                param="n",
            )
        if body.n > self.max_n:
            raise _ApiError(400, f"n = {body.n} exceeds this server's maximum of {self.max_n}", param="n")
        if body.stream:
            raise _ApiError(400, "n > 1 is not supported with stream: true", param="n")
        if body.seed is not None and body.seed + body.n - 1 > INT64_MAX:
            raise _ApiError(400, "seed + n - 1 must fit in 64 bits (the choices use seed + i)", param="seed")
        if not self.recorder.has_room(body.n):
            raise SessionTableFull(
                f"no room for {body.n} new sessions (max_sessions={self.recorder.max_sessions}): end "
                "sessions (DELETE /v1/sessions/{id}) or retry later"
            )
