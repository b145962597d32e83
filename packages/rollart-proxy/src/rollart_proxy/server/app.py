"""The OpenAI-compatible server: :class:`OpenAIServer` (its routes, access checks, and serving in the
running event loop). What the endpoints do and how access is closed by default: :mod:`rollart_proxy.server`."""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import socket
import time
import uuid
from collections.abc import Sequence
from typing import Any, cast

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from rollart_core.errors import ConfigError, EngineError
from rollart_core.serving import INT64_MAX, ApiKeys, bearer_token, is_loopback
from rollart_core.types import GenerateOutput, GenerateRequest, SamplingParams
from rollart_proxy.errors import ProxyOverloadedError, WorkerUnavailableError
from rollart_proxy.proxy import LLMProxy
from rollart_proxy.server.chat_template import ChatTemplate
from rollart_proxy.server.chat_tokens import GeneratedMessages, message_key, splice_encode
from rollart_proxy.server.forced_call import CallPlan, generate_call, plan_call
from rollart_proxy.server.guard import _ApiError, _error, _Guard
from rollart_proxy.server.messages_api import add_messages_routes
from rollart_proxy.server.models import (
    ChatBody,
    CompletionBody,
    ReleaseBody,
    UpdateWeightsBody,
    _Common,
    _message_dict,
)
from rollart_proxy.server.responses import INLINE_CHARS, INLINE_TOKENS, Responses, off_loop
from rollart_proxy.server.responses_api import add_responses_routes
from rollart_proxy.server.sessions import _ADMIN, _BOUND, SessionRecorder, SessionTableFull
from rollart_proxy.server.tools import (
    ToolCallParser,
    ToolsError,
    check_tool_choice,
    check_tools,
    template_messages,
    tojson,
)

__all__ = ["API_KEY_ENV", "ADMIN_KEY_ENV", "OpenAIServer"]

log = logging.getLogger(__name__)

API_KEY_ENV = "ROLLART_PROXY_API_KEY"
ADMIN_KEY_ENV = "ROLLART_PROXY_ADMIN_KEY"


class OpenAIServer(Responses):
    """``OpenAIServer(proxy, model_path).app`` is the FastAPI app; :meth:`start` serves it in the
    running event loop (same loop as the proxy's engines)."""

    def __init__(
        self,
        proxy: LLMProxy,
        model_path: str,
        *,
        served_model_name: str | None = None,
        max_model_len: int | None = None,
        default_max_tokens: int = 256,
        session_header: str = "X-Session-Id",
        task_header: str = "X-Rollart-Task",
        api_key: str | Sequence[str] | None = None,
        admin_key: str | None = None,
        enable_admin: bool = False,
        max_body_bytes: int = 8 << 20,
        max_sessions: int = 100_000,
        tool_parser: str | None = "hermes",
        max_n: int = 16,
        session_ttl_s: float | None = 3600.0,
        body_timeout_s: float = 30.0,
    ) -> None:
        """``api_key`` / ``admin_key``: None reads ``ROLLART_PROXY_API_KEY`` (comma-separated) /
        ``ROLLART_PROXY_ADMIN_KEY``; an empty string or list means none. ``enable_admin``: admin
        endpoints without an admin token, on a loopback bind only (see the module doc).
        ``tool_parser``: the vLLM tool-call parser for ``tools`` requests (None: tools refused).
        ``max_n``: the largest ``n`` of a call (n sibling trajectories of one group); above: 400.
        ``max_sessions`` / ``session_ttl_s``: at most this many sessions; a new one beyond takes the
        place of one idle for ``session_ttl_s`` (evicted whole), else gets 429 (:class:`SessionRecorder`).
        ``body_timeout_s``: a request body not received within it gets 408."""
        from pathlib import Path

        self._api_keys = ApiKeys(api_key, API_KEY_ENV)
        if admin_key is None:
            admin_key = os.environ.get(ADMIN_KEY_ENV, "")
        self._admin_key = admin_key.encode() if admin_key else None
        if self._admin_key is not None and self._api_keys.matches(self._admin_key):
            raise ConfigError("the admin key must differ from every API key")
        self.enable_admin = enable_admin
        if max_body_bytes < 1:
            raise ConfigError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
        self.max_body_bytes = max_body_bytes
        if body_timeout_s <= 0:
            raise ConfigError(f"body_timeout_s must be > 0, got {body_timeout_s}")
        self.body_timeout_s = body_timeout_s
        if max_n < 1:
            raise ConfigError(f"max_n must be >= 1, got {max_n}")
        self.max_n = max_n
        self.proxy = proxy
        self.template = ChatTemplate(model_path)
        # Hugging Face templates expect its tojson (no HTML escaping): Jinja looks filters up at render time
        self.template._template.environment.filters["tojson"] = tojson
        self._eot = self._end_of_turn()
        self.tool_parser = ToolCallParser(tool_parser, str(model_path)) if tool_parser else None
        self.generated = GeneratedMessages(max_sessions)
        self._bound: dict[bytes, str] = {}
        """Session-bound client tokens (:meth:`bind_session`) → their session."""
        self.refused: dict[str, int] = {}
        """Bound session → calls refused because they named another session."""
        self.model_name = served_model_name or Path(model_path).name
        self._model_aliases = {self.model_name, str(model_path)}
        self.max_model_len = max_model_len
        self.default_max_tokens = default_max_tokens
        self.session_header = session_header
        self.task_header = task_header
        self.recorder = SessionRecorder(max_sessions, idle_ttl_s=session_ttl_s, on_evict=self._evicted)
        self._server: Any = None
        self._socket: socket.socket | None = None
        self._task: asyncio.Task[None] | None = None
        self.app = self._build()

    def _end_of_turn(self) -> tuple[int, str] | None:
        eos = self.template.eos_token_id
        return None if eos is None else (eos, self.template.token_str(eos))

    # session-bound clients ---------------------------------------------------------------------

    def bind_session(self, session_id: str) -> str:
        """A client token that may call only ``session_id`` (as ``Authorization: Bearer <token>``):
        calls naming another session (or none) get 403 and are counted in ``refused``. For agent
        episodes: the agent gets a client bound to its trajectory. Over HTTP:
        ``POST /v1/sessions/{id}/bind`` (by the session's owner; not with a bound token) and
        ``POST /v1/sessions/{id}/release`` ``{"token"}``."""
        token = "rollart-session-" + uuid.uuid4().hex
        self._bound[token.encode()] = session_id
        self.refused.setdefault(session_id, 0)
        # unowned: nobody else may read it; owned (by the caller of POST .../bind): stays theirs
        self.recorder.claim(session_id, _BOUND + session_id)
        self.recorder.pin(session_id)  # never evicted while the token is out
        return token

    def _evicted(self, session_id: str) -> None:
        """An idle session went whole to make room: what the server and the proxy keep of it goes too."""
        self.generated.forget(session_id)
        self.proxy.end_session(session_id)
        self.refused.pop(session_id, None)

    def release_session(self, token: str) -> dict[str, Any]:
        """Revoke a bound token and end its session: returns its records, refusals and nothing else
        kept (records, remembered messages, routing state, ownership)."""
        session_id = self._bound.pop(token.encode(), None)
        if session_id is None:
            return {"calls": [], "refused": 0}
        calls = self.recorder.drain(session_id)
        self.recorder.forget(session_id)
        self.generated.forget(session_id)
        return {"calls": calls, "refused": self.refused.pop(session_id, 0)}

    # serving -----------------------------------------------------------------------------------

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Serve in the running loop; returns the bound port."""
        import uvicorn

        loopback = is_loopback(host)
        if self.enable_admin and self._admin_key is None and not loopback:
            raise ConfigError(
                f"admin endpoints without an admin key are only served on loopback, not on {host!r}: "
                f"set an admin key (--admin-key / {ADMIN_KEY_ENV})"
            )
        if not loopback and not self._api_keys:
            log.warning(
                "rollart-proxy binds %s (beyond loopback) without an API key: anyone who reaches it can "
                "generate and read sessions; set --api-key / %s",
                host,
                API_KEY_ENV,
            )

        # Bind here: a bind error is a plain OSError (uvicorn would sys.exit inside the serving task,
        # which escapes the host's event loop).
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
        except OSError:
            sock.close()
            raise
        config = uvicorn.Config(self.app, host=host, port=port, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._socket = sock
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        deadline = time.monotonic() + 30
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise RuntimeError("uvicorn exited before it started")
            if time.monotonic() > deadline:
                raise TimeoutError("uvicorn did not start within 30 s")
            await asyncio.sleep(0.02)
        return int(sock.getsockname()[1])

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await asyncio.wait_for(self._task, 30)
            self._server = self._task = None
        if self._socket is not None:
            self._socket.close()
            self._socket = None

    # app ---------------------------------------------------------------------------------------

    def _build(self) -> FastAPI:
        app = FastAPI(title="rollart-proxy", docs_url=None, redoc_url=None, openapi_url=None)
        app.add_middleware(_Guard, server=self)

        @app.exception_handler(_ApiError)
        async def _api_error(r: Request, e: _ApiError) -> JSONResponse:
            return _error(e.status, e.message, e.code, e.param, path=r.url.path)

        @app.exception_handler(RequestValidationError)
        async def _invalid(r: Request, e: RequestValidationError) -> JSONResponse:
            msgs = "; ".join(
                f"{'.'.join(str(x) for x in err.get('loc', ()))}: {err.get('msg')}" for err in e.errors()
            )
            return _error(400, f"invalid request: {msgs}", path=r.url.path)

        @app.exception_handler(ProxyOverloadedError)
        async def _overloaded(r: Request, e: ProxyOverloadedError) -> JSONResponse:
            return _error(429, str(e), "rate_limit_exceeded", path=r.url.path)

        @app.exception_handler(SessionTableFull)
        async def _sessions_full(r: Request, e: SessionTableFull) -> JSONResponse:
            response = _error(429, str(e), "rate_limit_exceeded", path=r.url.path)
            response.headers["Retry-After"] = "5"
            return response

        @app.exception_handler(Exception)
        async def _internal(r: Request, e: Exception) -> JSONResponse:
            log.exception("internal error: %r", e)
            return _error(500, f"internal error: {type(e).__name__}", "internal_error", path=r.url.path)

        @app.exception_handler(WorkerUnavailableError)
        async def _unavailable(r: Request, e: WorkerUnavailableError) -> JSONResponse:
            return _error(503, str(e), "service_unavailable", path=r.url.path)

        @app.exception_handler(EngineError)
        async def _engine(r: Request, e: EngineError) -> JSONResponse:
            return _error(400, str(e), path=r.url.path)

        @app.get("/health")
        async def health() -> dict[str, str]:
            return {"status": "ok"}

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {
                "object": "list",
                "data": [
                    {
                        "id": self.model_name,
                        "object": "model",
                        "owned_by": "rollart",
                        "max_model_len": self.max_model_len,
                    }
                ],
            }

        @app.post("/v1/completions")
        async def completions(body: CompletionBody, request: Request) -> Any:
            self._check_model(body.model)
            if isinstance(body.prompt, list) and body.prompt and isinstance(body.prompt[0], str):
                if len(body.prompt) != 1:
                    raise _ApiError(400, "only one prompt per request is supported", param="prompt")
                prompt_ids = await off_loop(
                    len(body.prompt[0]), INLINE_CHARS, self.template.encode, body.prompt[0]
                )
            elif isinstance(body.prompt, str):
                prompt_ids = await off_loop(len(body.prompt), INLINE_CHARS, self.template.encode, body.prompt)
            else:
                # token ids (or []): pydantic keeps one element type per list, and a list of
                # strings took the first branch; checked against the vocabulary in _admit
                prompt_ids = list(cast("list[int]", body.prompt))
            return await self._serve("completions", body, prompt_ids, body.max_tokens, request)

        @app.post("/v1/chat/completions")
        async def chat(body: ChatBody, request: Request) -> Any:
            return await self._chat(body, request)

        add_responses_routes(app, self)
        add_messages_routes(app, self)

        @app.get("/v1/sessions/{session_id}")
        async def session(session_id: str, request: Request) -> dict[str, Any]:
            self._check_owner(session_id, request)
            return {"session_id": session_id, "calls": self.recorder.get(session_id)}

        @app.post("/v1/sessions/{session_id}/drain")
        async def drain(session_id: str, request: Request) -> dict[str, Any]:
            self._check_owner(session_id, request)
            return {"session_id": session_id, "calls": self.recorder.drain(session_id)}

        @app.get("/v1/groups/{group_id}")
        async def group(group_id: str, request: Request) -> dict[str, Any]:
            members = self._check_group(group_id, request)
            return {
                "group_id": group_id,
                "members": [
                    {"session_id": m, "index": i, "calls": self.recorder.get(m)}
                    for i, m in enumerate(members)
                ],
            }

        @app.post("/v1/groups/{group_id}/drain")
        async def drain_group(group_id: str, request: Request) -> dict[str, Any]:
            self._check_group(group_id, request)
            return {"group_id": group_id, "members": self.recorder.drain_group(group_id)}

        @app.post("/v1/sessions/{session_id}/bind")
        async def bind(session_id: str, request: Request) -> dict[str, Any]:
            principal = self._principal(request)
            if principal is not None and principal.startswith(_BOUND):
                raise _ApiError(403, "a session-bound token may not bind sessions", "permission_denied")
            if not self.recorder.claim(session_id, principal):
                raise _ApiError(
                    403, f"session {session_id!r} belongs to another API key", "permission_denied"
                )
            if len(self._bound) >= self.recorder.max_sessions:
                raise _ApiError(429, "too many session-bound tokens; release some", "rate_limit_exceeded")
            return {
                "session_id": session_id,
                "token": self.bind_session(session_id),
                "session_header": self.session_header,
                "task_header": self.task_header,
                "model": self.model_name,
            }

        @app.post("/v1/sessions/{session_id}/release")
        async def release(session_id: str, body: ReleaseBody, request: Request) -> dict[str, Any]:
            self._check_owner(session_id, request)
            if self._bound.get(body.token.encode()) != session_id:
                raise _ApiError(404, f"no token bound to session {session_id!r} is that one", param="token")
            return {"session_id": session_id, **self.release_session(body.token)}

        @app.post("/v1/sessions/{session_id}/abort")
        async def abort(session_id: str, request: Request) -> dict[str, Any]:
            self._check_owner(session_id, request)
            return {"session_id": session_id, "aborted": await self.proxy.abort(session_id)}

        @app.delete("/v1/sessions/{session_id}")
        async def end(session_id: str, request: Request) -> dict[str, Any]:
            self._check_owner(session_id, request)
            self.proxy.end_session(session_id)
            self.recorder.forget(session_id)
            return {"session_id": session_id, "calls": len(self.recorder.drain(session_id))}

        @app.post("/admin/suspend")
        async def suspend() -> dict[str, Any]:
            await self.proxy.suspend()
            return {"suspended": True}

        @app.post("/admin/resume")
        async def resume() -> dict[str, Any]:
            await self.proxy.resume()
            return {"suspended": False}

        @app.post("/admin/update_weights")
        async def update(body: UpdateWeightsBody) -> dict[str, Any]:
            return {"version": body.version, "paused_s": await self.proxy.update_weights(body.version)}

        @app.get("/admin/weight_versions")
        async def versions() -> dict[str, int]:
            return await self.proxy.weight_versions()

        @app.get("/metrics")
        async def metrics() -> dict[str, Any]:
            return await self.proxy.metrics()

        return app

    # access ---------------------------------------------------------------------------------------

    def _authorize(self, path: str, authorization: str | None) -> tuple[str | None, tuple[int, str] | None]:
        """``(principal, None)`` or ``(None, (status, message))`` for a request to ``path``."""
        token = bearer_token(authorization)
        is_admin = (
            token is not None and self._admin_key is not None and hmac.compare_digest(token, self._admin_key)
        )
        if path == "/admin" or path.startswith("/admin/"):
            if self._admin_key is not None:
                if is_admin:
                    return _ADMIN, None
                return None, (
                    401 if token is None else 403,
                    "admin endpoints need the admin token (Authorization: Bearer <admin key>)",
                )
            if not self.enable_admin:
                return None, (
                    403,
                    f"admin endpoints are disabled: start the server with an admin key (--admin-key "
                    f"or {ADMIN_KEY_ENV}), or with --enable-admin on a loopback address",
                )
        if is_admin:
            return _ADMIN, None
        if token is not None and token in self._bound:
            return _BOUND + self._bound[token], None
        principal, denied = self._api_keys.check(token)
        return (principal, None) if denied is None else (None, (401, denied))

    @staticmethod
    def _principal(request: Request) -> str | None:
        return getattr(request.state, "rollart_principal", None)

    def _check_owner(self, session_id: str, request: Request) -> None:
        if not self.recorder.may_access(session_id, self._principal(request)):
            raise _ApiError(403, f"session {session_id!r} belongs to another API key", "permission_denied")

    def _check_group(self, group_id: str, request: Request) -> list[str]:
        members = self.recorder.group(group_id)
        if members is None:
            raise _ApiError(404, f"no group {group_id!r} (unknown, drained or dropped)", param="group_id")
        if not all(self.recorder.may_access(m, self._principal(request)) for m in members):
            raise _ApiError(403, f"group {group_id!r} belongs to another API key", "permission_denied")
        return members

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

    async def _serve(
        self, endpoint: str, body: _Common, prompt_ids: list[int], max_tokens: int | None, request: Request
    ) -> Any:
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
            return StreamingResponse(
                self._sse(endpoint, body, first, parts, prompt_ids, session, sampling),
                media_type="text/event-stream",
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
        self, body: ChatBody, plan: CallPlan, prompt_ids: list[int], request: Request
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
            return StreamingResponse(self._call_sse(body, reply), media_type="text/event-stream")
        return reply

    async def _chat(self, body: ChatBody, request: Request) -> Any:
        """One chat call (the Responses and Messages dialects come here too, translated): the reply
        as a dict, or a ``StreamingResponse`` of chat chunks."""
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
                return await self._serve_call(body, plan, prompt_ids, request)
        return await self._serve(
            "chat", body, prompt_ids, body.max_completion_tokens or body.max_tokens, request
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
