"""The OpenAI-compatible server: :class:`OpenAIServer` (its routes, session-bound tokens, and serving
in the running event loop; the call path in :mod:`.calls`, request checks in :mod:`.admission`, access
in :mod:`.guard`). What the endpoints do and how access is closed by default: :mod:`rollart_proxy.server`."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections.abc import Sequence
from typing import Any, cast

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from rollart_core.errors import ConfigError, EngineError
from rollart_core.serving import ApiKeys, is_loopback
from rollart_proxy.errors import ProxyOverloadedError, WorkerUnavailableError
from rollart_proxy.proxy import LLMProxy
from rollart_proxy.server.calls import Calls
from rollart_proxy.server.chat_template import ChatTemplate
from rollart_proxy.server.chat_tokens import GeneratedMessages
from rollart_proxy.server.guard import ADMIN_KEY_ENV, API_KEY_ENV, _ApiError, _error, _Guard
from rollart_proxy.server.messages_api import add_messages_routes
from rollart_proxy.server.models import ChatBody, CompletionBody, ReleaseBody, UpdateWeightsBody
from rollart_proxy.server.responses import INLINE_CHARS, off_loop
from rollart_proxy.server.responses_api import add_responses_routes
from rollart_proxy.server.sessions import _BOUND, SessionRecorder, SessionTableFull
from rollart_proxy.server.tools import ToolCallParser, tojson

__all__ = ["API_KEY_ENV", "ADMIN_KEY_ENV", "OpenAIServer"]

log = logging.getLogger(__name__)


class OpenAIServer(Calls):
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
