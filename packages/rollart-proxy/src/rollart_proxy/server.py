"""OpenAI-compatible HTTP endpoint served by the proxy (FastAPI + uvicorn, bound to 127.0.0.1).

Black-box agents (anything speaking the OpenAI API) are trained through it: every call made with
a session header (``X-Session-Id: <trajectory id>``) is routed as one turn of that trajectory
(sticky worker, task pool from ``X-Rollart-Task``) and recorded with its prompt token ids, output
token ids, logprobs and the policy version of every token, for the trainer to fetch.

Endpoints:

- ``POST /v1/chat/completions``, ``POST /v1/completions`` (``stream: true`` too), ``GET /v1/models``
- ``GET /v1/sessions/{id}`` (records of a session), ``POST /v1/sessions/{id}/drain`` (take them),
  ``POST /v1/sessions/{id}/abort`` (abort the trajectory's in-flight request),
  ``DELETE /v1/sessions/{id}`` (end the session: records and stickiness dropped)
- ``POST /admin/suspend``, ``POST /admin/resume``, ``POST /admin/update_weights`` ``{"version"}``,
  ``GET /admin/weight_versions``, ``GET /metrics`` (per worker), ``GET /health``

Bad input gets a 4xx with an OpenAI-style ``{"error": {"message", "type", "code"}}`` body: unknown
model 404, malformed body / invalid sampling parameters / prompt longer than the context 400, a body
over ``max_body_bytes`` 413. A request no worker can serve gets 503; one refused because every
worker's queue is full gets 429. Streaming responses are well-formed SSE.

Closed by default:

- **Bind**: 127.0.0.1 unless told otherwise; binding beyond loopback without an API key logs a WARNING.
- **API keys** (``api_key``, or env ``ROLLART_PROXY_API_KEY``, comma-separated for several clients):
  when set, every endpoint (``/health`` included) needs ``Authorization: Bearer <key>`` (401 without).
- **Admin** (``/admin/*``): needs the admin token (``admin_key`` or env ``ROLLART_PROXY_ADMIN_KEY``;
  it is also accepted on every other endpoint). Without an admin token, admin endpoints answer 403,
  unless the server was made with ``enable_admin=True`` (``--enable-admin``) *and* binds a loopback
  address: then they take the API key, if any (a non-loopback bind with that setting is refused).
- **Sessions** belong to the key whose request created them: reading, draining, aborting, deleting
  or adding turns to a session needs that key or the admin token (403 otherwise). Without API keys
  every client is the same anonymous principal.
- **Bounded**: bodies (413), session records and owners (``max_sessions``, oldest dropped first), and
  the proxy's queues (429). Chat templating and (de)tokenisation run in worker threads, off the
  event loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import json
import logging
import os
import socket
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from rollart_core.errors import ConfigError, EngineError
from rollart_core.types import GenerateOutput, GenerateRequest, SamplingParams
from rollart_proxy.chat_template import ChatTemplate
from rollart_proxy.chat_tokens import GeneratedMessages, message_key, splice_encode
from rollart_proxy.errors import ProxyOverloadedError, WorkerUnavailableError
from rollart_proxy.proxy import LLMProxy
from rollart_proxy.tools import (
    ToolCallParser,
    ToolsError,
    check_tool_choice,
    check_tools,
    template_messages,
    tojson,
)

__all__ = ["API_KEY_ENV", "ADMIN_KEY_ENV", "OpenAIServer", "SessionRecorder"]

log = logging.getLogger(__name__)

API_KEY_ENV = "ROLLART_PROXY_API_KEY"
ADMIN_KEY_ENV = "ROLLART_PROXY_ADMIN_KEY"
_ADMIN = "admin"
"""The principal of the admin token: may touch every session."""
_BOUND = "session:"
"""Principal prefix of a session-bound token (:meth:`OpenAIServer.bind_session`)."""


class _ApiError(Exception):
    def __init__(
        self, status: int, message: str, code: str = "invalid_request_error", param: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


# request bodies --------------------------------------------------------------------------------


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    n: int = Field(1, ge=1, description="Only n=1 is supported (one trajectory turn per call).")
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    presence_penalty: float = Field(0.0, ge=0.0, le=0.0)
    frequency_penalty: float = Field(0.0, ge=0.0, le=0.0)
    stream_options: dict[str, Any] | None = None
    user: str | None = None
    metadata: dict[str, Any] | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        for s in [v] if isinstance(v, str) else v or []:
            if not s:
                raise ValueError("stop strings must be non-empty")
        return v

    @field_validator("n")
    @classmethod
    def _n(cls, v: int) -> int:
        if v != 1:
            raise ValueError(
                "n > 1 is not supported: one call is one turn of one trajectory; make n calls, "
                "each with its own session (X-Session-Id header)"
            )
        return v

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class CompletionBody(_Common):
    prompt: str | list[int] | list[str]
    logprobs: int | None = Field(None, ge=0, le=0, description="Only the sampled token's logprob (0).")
    echo: bool = Field(False, description="Not supported (must be false).")

    @field_validator("echo")
    @classmethod
    def _echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported")
        return v


class _FunctionIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    arguments: str


class _ToolCallIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    type: Literal["function"] = "function"
    function: _FunctionIn


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[_ToolCallIn] | None = None
    tool_call_id: str | None = None
    # what SDKs send back when an agent appends the reply's message object as it is (ignored)
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for p in self.content:
            if p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise ValueError(f"only text content parts are supported, got {p.get('type')!r}")
            parts.append(p["text"])
        return "".join(parts)


class ChatBody(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=0, description="Only the sampled token (0).")
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def tools_active(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


# session records -------------------------------------------------------------------------------


class UpdateWeightsBody(BaseModel):
    """``POST /admin/update_weights``. At module level: with postponed annotations FastAPI resolves the
    handler's annotation in the module's namespace (a class local to ``_build`` made the route's body
    model unresolvable and ``app.openapi()`` raise)."""

    model_config = ConfigDict(extra="forbid")
    version: int = Field(ge=0)


class SessionRecorder:
    """Token ids, logprobs and versions of every call, per session, until the trainer takes them."""

    def __init__(self, max_sessions: int = 100_000, max_calls_per_session: int = 10_000) -> None:
        self.max_sessions = max_sessions
        self.max_calls_per_session = max_calls_per_session
        self._calls: dict[str, list[dict[str, Any]]] = {}
        self._owners: OrderedDict[str, str | None] = OrderedDict()
        """Session → principal that created it (LRU, at most ``max_sessions``)."""

    def claim(self, session_id: str, principal: str | None) -> bool:
        """Record ``principal`` as the session's owner if it has none; False if another owns it."""
        if session_id in self._owners:
            if not self.may_access(session_id, principal):
                return False
            self._owners.move_to_end(session_id)
            return True
        self._owners[session_id] = principal
        while len(self._owners) > self.max_sessions:
            self._owners.popitem(last=False)
        return True

    def may_access(self, session_id: str, principal: str | None) -> bool:
        owner = self._owners.get(session_id, principal)
        return principal == _ADMIN or owner == principal

    def forget(self, session_id: str) -> None:
        self._owners.pop(session_id, None)

    def sizes(self) -> dict[str, int]:
        return {"recorded_sessions": len(self._calls), "owned_sessions": len(self._owners)}

    def record(
        self,
        session_id: str,
        endpoint: str,
        prompt_ids: list[int],
        out: GenerateOutput,
        sampling: SamplingParams | None = None,
    ) -> None:
        if session_id not in self._calls and len(self._calls) >= self.max_sessions:
            self._calls.pop(next(iter(self._calls)))  # oldest session first
        calls = self._calls.setdefault(session_id, [])
        if len(calls) >= self.max_calls_per_session:
            calls.pop(0)  # a session nobody drains keeps only its latest calls
        calls.append(
            {
                "request_id": out.request_id,
                "endpoint": endpoint,
                "prompt_ids": list(prompt_ids),
                "output_ids": list(out.token_ids),
                "logprobs": list(out.logprobs),
                "versions": list(out.versions),
                "finish_reason": out.finish_reason,
                "worker": out.worker,
                "time": time.time(),
                "temperature": sampling.temperature if sampling is not None else None,
                "allowed_token_ids": list(sampling.allowed_token_ids)
                if sampling and sampling.allowed_token_ids
                else None,
            }
        )

    def get(self, session_id: str) -> list[dict[str, Any]]:
        return list(self._calls.get(session_id, ()))

    def drain(self, session_id: str) -> list[dict[str, Any]]:
        return self._calls.pop(session_id, [])


# the server ------------------------------------------------------------------------------------


class OpenAIServer:
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
    ) -> None:
        """``api_key`` / ``admin_key``: None reads ``ROLLART_PROXY_API_KEY`` (comma-separated) /
        ``ROLLART_PROXY_ADMIN_KEY``; an empty string or list means none. ``enable_admin``: admin
        endpoints without an admin token, on a loopback bind only (see the module doc).
        ``tool_parser``: the vLLM tool-call parser for ``tools`` requests (None: tools refused)."""
        from pathlib import Path

        if api_key is None:
            api_key = os.environ.get(API_KEY_ENV, "")
        keys = [k.strip() for k in api_key.split(",")] if isinstance(api_key, str) else list(api_key)
        self._api_keys = [
            (k.encode(), "key-" + hashlib.sha256(k.encode()).hexdigest()[:16]) for k in keys if k
        ]
        if admin_key is None:
            admin_key = os.environ.get(ADMIN_KEY_ENV, "")
        self._admin_key = admin_key.encode() if admin_key else None
        if self._admin_key is not None and any(
            hmac.compare_digest(k, self._admin_key) for k, _ in self._api_keys
        ):
            raise ConfigError("the admin key must differ from every API key")
        self.enable_admin = enable_admin
        if max_body_bytes < 1:
            raise ConfigError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
        self.max_body_bytes = max_body_bytes
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
        self.recorder = SessionRecorder(max_sessions)
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
        episodes: the agent gets a client bound to its trajectory."""
        token = "rollart-session-" + uuid.uuid4().hex
        self._bound[token.encode()] = session_id
        self.refused.setdefault(session_id, 0)
        return token

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

        loopback = _is_loopback(host)
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
        async def _api_error(_: Request, e: _ApiError) -> JSONResponse:
            return _error(e.status, e.message, e.code, e.param)

        @app.exception_handler(RequestValidationError)
        async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
            msgs = "; ".join(
                f"{'.'.join(str(x) for x in err.get('loc', ()))}: {err.get('msg')}" for err in e.errors()
            )
            return _error(400, f"invalid request: {msgs}")

        @app.exception_handler(ProxyOverloadedError)
        async def _overloaded(_: Request, e: ProxyOverloadedError) -> JSONResponse:
            return _error(429, str(e), "rate_limit_exceeded")

        @app.exception_handler(Exception)
        async def _internal(_: Request, e: Exception) -> JSONResponse:
            log.exception("internal error: %r", e)
            return _error(500, f"internal error: {type(e).__name__}", "internal_error")

        @app.exception_handler(WorkerUnavailableError)
        async def _unavailable(_: Request, e: WorkerUnavailableError) -> JSONResponse:
            return _error(503, str(e), "service_unavailable")

        @app.exception_handler(EngineError)
        async def _engine(_: Request, e: EngineError) -> JSONResponse:
            return _error(400, str(e))

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
                prompt_ids = await asyncio.to_thread(self.template.encode, body.prompt[0])
            elif isinstance(body.prompt, str):
                prompt_ids = await asyncio.to_thread(self.template.encode, body.prompt)
            else:
                prompt_ids = list(body.prompt)  # token ids
                if any(t < 0 for t in prompt_ids):  # type: ignore[operator]
                    raise _ApiError(400, "token ids must be >= 0", param="prompt")
            return await self._serve("completions", body, prompt_ids, body.max_tokens, request)

        @app.post("/v1/chat/completions")
        async def chat(body: ChatBody, request: Request) -> Any:
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
            kwargs: dict[str, Any] = (
                {"tools": body.tools} if body.tools and body.tool_choice != "none" else {}
            )
            try:
                prompt_ids, _ = await asyncio.to_thread(
                    splice_encode,
                    lambda ms: self.template.render(template_messages(ms), **kwargs),
                    self.template.encode,
                    msgs,
                    splices,
                    self._eot,
                )
            except Exception as e:  # the model's template refused these messages (raise_exception, bad roles)
                raise _ApiError(400, f"chat template: {e}", param="messages") from None
            return await self._serve(
                "chat", body, prompt_ids, body.max_completion_tokens or body.max_tokens, request
            )

        @app.get("/v1/sessions/{session_id}")
        async def session(session_id: str, request: Request) -> dict[str, Any]:
            self._check_owner(session_id, request)
            return {"session_id": session_id, "calls": self.recorder.get(session_id)}

        @app.post("/v1/sessions/{session_id}/drain")
        async def drain(session_id: str, request: Request) -> dict[str, Any]:
            self._check_owner(session_id, request)
            return {"session_id": session_id, "calls": self.recorder.drain(session_id)}

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
        token: bytes | None = None
        if authorization:
            scheme, _, value = authorization.partition(" ")
            if scheme.lower() == "bearer" and value.strip():
                token = value.strip().encode()
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
        if not self._api_keys:
            return None, None
        if token is None:
            return None, (401, "missing API key (Authorization: Bearer <key>)")
        for key, principal in self._api_keys:
            if hmac.compare_digest(token, key):
                return principal, None
        return None, (401, "invalid API key")

    @staticmethod
    def _principal(request: Request) -> str | None:
        return getattr(request.state, "rollart_principal", None)

    def _check_owner(self, session_id: str, request: Request) -> None:
        if not self.recorder.may_access(session_id, self._principal(request)):
            raise _ApiError(403, f"session {session_id!r} belongs to another API key", "permission_denied")

    async def _check_tools(self, body: ChatBody) -> None:
        try:
            if body.tools:
                check_tools(body.tools)
            check_tool_choice(body.tool_choice, body.tools)
            if body.tools_active():
                if self.tool_parser is None:
                    raise ToolsError(
                        "this server has no tool parser (tool_parser=None): tools are not served", "tools"
                    )
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
        if not prompt_ids:
            raise _ApiError(400, "empty prompt", param="prompt")
        if self.max_model_len is not None and len(prompt_ids) >= self.max_model_len:
            raise _ApiError(
                400,
                f"prompt of {len(prompt_ids)} tokens exceeds the context of {self.max_model_len}",
                "context_length_exceeded",
                "prompt",
            )
        if max_tokens is None:
            room = (self.max_model_len - len(prompt_ids)) if self.max_model_len else self.default_max_tokens
            max_tokens = max(1, min(self.default_max_tokens, room))
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
        if session is not None and not self.recorder.claim(session, principal):
            raise _ApiError(403, f"session {session!r} belongs to another API key", "permission_denied")
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
        reply = await asyncio.to_thread(self._response, endpoint, body, out, prompt_ids)  # detokenises
        if endpoint == "chat":
            message = reply["choices"][0]["message"]
            self._remember(session, message.get("content"), message.get("tool_calls"), out)
        return reply

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
            text, body.tools, body.tool_choice, body.parallel_tool_calls is not False
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
        base = {
            "id": out.request_id,
            "created": int(time.time()),
            "model": self.model_name,
            "usage": usage,
            "rollart": self._extra(out, prompt_ids),
        }
        toks = [self.template.token_str(t) for t in out.token_ids]
        if endpoint == "chat":
            lp = None
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
        lp = None
        if getattr(body, "logprobs", None) is not None:
            lp = {"tokens": toks, "token_logprobs": out.logprobs, "top_logprobs": None, "text_offset": None}
        return {
            **base,
            "object": "text_completion",
            "choices": [{"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}],
        }

    async def _sse(
        self,
        endpoint: str,
        body: _Common,
        first: GenerateOutput,
        parts: AsyncIterator[GenerateOutput],
        prompt_ids: list[int],
        session: str | None,
        sampling: SamplingParams | None = None,
    ) -> AsyncIterator[str]:
        """Server-sent events: one chunk per token delta, text detokenised incrementally.

        Text that could still turn out to be the start of a stop string (or half a UTF-8
        character) is held back until the next delta or the end. If the client goes away, the
        request is aborted on its engine (closing ``parts`` cancels it).
        """
        stops = body.stops()
        hold = max((len(x) for x in stops), default=1) - 1
        tools = isinstance(body, ChatBody) and body.tools_active()
        if tools:  # a tool call is only known once the output is complete: the text comes at the end
            hold = 1 << 62
        head = {"id": first.request_id, "created": int(time.time()), "model": self.model_name}
        obj = "chat.completion.chunk" if endpoint == "chat" else "text_completion"
        want_lp = (
            bool(getattr(body, "logprobs", False))
            if endpoint == "chat"
            else getattr(body, "logprobs", None) is not None
        )
        ids: list[int] = []
        lps: list[float] = []
        sent_text = 0
        sent_tokens = 0
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

        try:
            part: GenerateOutput | None = first
            while part is not None and not part.finish_reason:
                ids += part.token_ids
                lps += part.logprobs
                text = await asyncio.to_thread(self.template.decode, ids)
                safe = len(text) - hold
                while safe > sent_text and text[safe - 1] == "\ufffd":  # an incomplete UTF-8 sequence
                    safe -= 1
                if safe > sent_text or not role_sent:
                    yield chunk(
                        text[sent_text : max(safe, sent_text)], ids[sent_tokens:], lps[sent_tokens:], None
                    )
                    sent_text = max(safe, sent_text)
                    sent_tokens = len(ids)
                part = await anext(parts, None)
        finally:
            await parts.aclose()  # type: ignore[attr-defined]
        if part is None:  # the proxy always ends with the complete output
            raise RuntimeError(f"stream of {first.request_id} ended without a complete output")
        out = part
        self._record(session, endpoint, prompt_ids, out, sampling)
        text, finish = await asyncio.to_thread(self._text, out, stops)
        calls: list[dict[str, Any]] = []
        error: str | None = None
        content: str | None = text
        if tools:
            assert isinstance(body, ChatBody)
            content, calls, error = await asyncio.to_thread(self._tool_reply, body, text)
            text = content or ""
        if endpoint == "chat":
            self._remember(session, content, calls or None, out)
        if text[sent_text:] or out.token_ids[sent_tokens:]:
            yield chunk(text[sent_text:], out.token_ids[sent_tokens:], out.logprobs[sent_tokens:], None)
        if calls:
            deltas = [{"index": i, **c} for i, c in enumerate(calls)]
            yield f"data: {json.dumps({**head, 'object': obj, 'choices': [{'index': 0, 'delta': {'tool_calls': deltas}, 'logprobs': None, 'finish_reason': None}]})}\n\n"
            finish = "tool_calls" if finish == "stop" else finish
        if error:
            yield f"data: {json.dumps({**head, 'object': obj, 'choices': [], 'rollart': {'tool_call_error': error}})}\n\n"
        yield chunk("", [], [], finish)
        if (body.stream_options or {}).get("include_usage"):
            usage = {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": len(out.token_ids),
                "total_tokens": len(prompt_ids) + len(out.token_ids),
            }
            yield f"data: {json.dumps({**head, 'object': obj, 'choices': [], 'usage': usage, 'rollart': self._extra(out, prompt_ids)})}\n\n"
        yield "data: [DONE]\n\n"


def _message_dict(m: ChatMessage) -> dict[str, Any]:
    """A request message as the chat template and :func:`message_key` see it."""
    d: dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.name:
        d["name"] = m.name
    if m.tool_calls:
        d["tool_calls"] = [c.model_dump() for c in m.tool_calls]
    if m.tool_call_id is not None:
        d["tool_call_id"] = m.tool_call_id
    return d


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name other than localhost: assume it reaches beyond this machine
        return False


class _Guard:
    """ASGI middleware: authorisation (before any body is read), then the body-size limit. The body
    is read up to the limit and replayed to the app; a longer one gets 413 without being read on."""

    def __init__(self, app: Any, server: OpenAIServer) -> None:
        self.app = app
        self.server = server

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        principal, denied = self.server._authorize(scope.get("path", ""), headers.get("authorization"))
        if denied is not None:
            status, message = denied
            code = "authentication_error" if status == 401 else "permission_denied"
            extra = {"www-authenticate": "Bearer"} if status == 401 else {}
            await _send_error(send, status, message, code, extra)
            return
        scope.setdefault("state", {})["rollart_principal"] = principal
        limit = self.server.max_body_bytes
        declared = headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                await _send_error(send, 400, "invalid Content-Length header")
                return
            if int(declared) > limit:
                await _send_error(
                    send,
                    413,
                    f"request body of {declared} bytes exceeds the limit of {limit}",
                    "request_too_large",
                )
                return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > limit:
                await _send_error(
                    send, 413, f"request body exceeds the limit of {limit} bytes", "request_too_large"
                )
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()  # type: ignore[no-any-return]

        await self.app(scope, replay, send)


async def _send_error(
    send: Any,
    status: int,
    message: str,
    code: str = "invalid_request_error",
    extra_headers: dict[str, str] | None = None,
) -> None:
    payload = json.dumps(
        {"error": {"message": message, "type": code, "param": None, "code": status}}
    ).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
        *((k.encode(), v.encode()) for k, v in (extra_headers or {}).items()),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


def _error(
    status: int, message: str, code: str = "invalid_request_error", param: str | None = None
) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": code, "param": param, "code": status}}, status_code=status
    )
