"""Access and errors: the server's access checks (:class:`Access`: a token's principal, who owns a
session or group), the ASGI guard (authorisation before any body is read, then the body-size
limit and the time to receive the body) and the error bodies that it and the handlers send, in the
shape of the request's dialect (OpenAI's; Anthropic's under ``/v1/messages``)."""

from __future__ import annotations

import asyncio
import hmac
import json
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from rollart_core.serving import ApiKeys, bearer_token
from rollart_proxy.server.sessions import _ADMIN, _BOUND, SessionRecorder

API_KEY_ENV = "ROLLART_PROXY_API_KEY"
ADMIN_KEY_ENV = "ROLLART_PROXY_ADMIN_KEY"


class _ApiError(Exception):
    def __init__(
        self, status: int, message: str, code: str = "invalid_request_error", param: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


class Access:
    """Who may call what, for :class:`~rollart_proxy.server.app.OpenAIServer`, which inherits it and
    sets these attributes (the guard reads ``max_body_bytes`` and ``body_timeout_s`` too)."""

    _api_keys: ApiKeys
    _admin_key: bytes | None
    enable_admin: bool
    _bound: dict[bytes, str]
    recorder: SessionRecorder
    max_body_bytes: int
    body_timeout_s: float

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


class _Guard:
    """ASGI middleware: authorisation (before any body is read), then the body-size limit. The body
    is read up to the limit and replayed to the app; a longer one gets 413 without being read on."""

    def __init__(self, app: Any, server: Access) -> None:
        self.app = app
        self.server = server

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        path = scope.get("path", "")
        # Anthropic's SDKs send the key as ``x-api-key``: the same key, another header
        authorization = headers.get("authorization")
        if authorization is None and headers.get("x-api-key"):
            authorization = "Bearer " + headers["x-api-key"]
        principal, denied = self.server._authorize(path, authorization)
        if denied is not None:
            status, message = denied
            code = "authentication_error" if status == 401 else "permission_denied"
            extra = {"www-authenticate": "Bearer"} if status == 401 else {}
            await _send_error(send, status, message, code, extra, path)
            return
        scope.setdefault("state", {})["rollart_principal"] = principal
        limit = self.server.max_body_bytes
        declared = headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                await _send_error(send, 400, "invalid Content-Length header", path=path)
                return
            if int(declared) > limit:
                await _send_error(
                    send,
                    413,
                    f"request body of {declared} bytes exceeds the limit of {limit}",
                    "request_too_large",
                    path=path,
                )
                return
        body = bytearray()
        try:
            # a client that declares a body and never sends it must not hold a handler forever
            async with asyncio.timeout(self.server.body_timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return
                    body += message.get("body", b"")
                    if len(body) > limit:
                        await _send_error(
                            send,
                            413,
                            f"request body exceeds the limit of {limit} bytes",
                            "request_too_large",
                            path=path,
                        )
                        return
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            await _send_error(
                send,
                408,
                f"request body not received within {self.server.body_timeout_s} s",
                "timeout",
                path=path,
            )
            return
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


MESSAGES_PATH = "/v1/messages"
"""Requests under this path are the Anthropic Messages dialect: their errors take its shape."""
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


def error_body(
    status: int,
    message: str,
    code: str = "invalid_request_error",
    param: str | None = None,
    path: str = "",
) -> dict[str, Any]:
    """The error body in the dialect of ``path``: Anthropic's ``{"type": "error", "error": {"type",
    "message"}}`` under ``/v1/messages``, else OpenAI's (Chat Completions, Completions, Responses)."""
    if path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/"):
        kind = _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
        return {"type": "error", "error": {"type": kind, "message": message}}
    return {"error": {"message": message, "type": code, "param": param, "code": status}}


async def _send_error(
    send: Any,
    status: int,
    message: str,
    code: str = "invalid_request_error",
    extra_headers: dict[str, str] | None = None,
    path: str = "",
) -> None:
    payload = json.dumps(error_body(status, message, code, path=path)).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
        *((k.encode(), v.encode()) for k, v in (extra_headers or {}).items()),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


def _error(
    status: int,
    message: str,
    code: str = "invalid_request_error",
    param: str | None = None,
    path: str = "",
) -> JSONResponse:
    return JSONResponse(error_body(status, message, code, param, path), status_code=status)
