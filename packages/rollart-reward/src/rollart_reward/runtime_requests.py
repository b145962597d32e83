"""The function runtime's request checks: the bearer-token middleware, reading a JSON body and one
call out of it, and the 4xx errors they raise (:mod:`rollart_reward.runtime` serves the requests)."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
from typing import TYPE_CHECKING, Any

from rollart_core.errors import RewardError
from rollart_core.serving import ApiKeys, bearer_token
from rollart_reward.runtime_config import API_KEY_ENV
from rollart_reward.wire import trajectory_from_dict

if TYPE_CHECKING:
    import collections

    from rollart_reward.runtime_config import RuntimeConfig


class KeyConflict(Exception):
    """An idempotency key already names a call with a different trajectory (409)."""


class BadRequest(Exception):
    """A request the runtime refuses (4xx) with a message for the caller."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


_MAX_KEY = 256


def body_digest(trajectory: Any) -> str:
    """Hash of a trajectory's canonical JSON: what an idempotency key's cached result is bound to."""
    return hashlib.sha256(json.dumps(trajectory, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _kind(x: Any) -> str:
    return "null" if x is None else type(x).__name__


def access_guard(c: RuntimeConfig, counters: collections.Counter[str]) -> Any:
    """Middleware: the bearer token checks (admin endpoints: the admin key only; the rest: the
    API key), and :class:`BadRequest` as a JSON 4xx with its message."""
    from aiohttp import web

    invoke_keys = ApiKeys([c.api_key] if c.api_key else [], API_KEY_ENV)
    admin_key = c.admin_key.encode() if c.admin_key else None

    def refuse(status: int, message: str) -> Any:
        counters["unauthorized"] += 1
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
        return web.json_response({"error": message}, status=status, headers=headers)

    @web.middleware
    async def guard(request: Any, handler: Any) -> Any:
        token = bearer_token(request.headers.get("Authorization"))
        is_admin_path = request.path == "/admin" or request.path.startswith("/admin/")
        if is_admin_path and admin_key is not None:
            if token is None or not hmac.compare_digest(token, admin_key):
                return refuse(
                    401 if token is None else 403,
                    "admin endpoints need the admin key (Authorization: Bearer <admin key>)",
                )
        elif request.path != "/healthz" and invoke_keys.check(token)[1] is not None:
            return refuse(401, "missing or wrong bearer token (Authorization: Bearer ...)")
        try:
            return await handler(request)
        except BadRequest as exc:
            counters[f"rejected_{exc.status}"] += 1
            return web.json_response({"error": exc.message}, status=exc.status)

    return guard


async def read_json(request: Any, config: RuntimeConfig) -> Any:
    """The request body as JSON; :class:`BadRequest` (413 too large, 400 not JSON) otherwise."""
    from aiohttp import web

    limit = config.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise BadRequest(413, f"request body of {request.content_length} bytes exceeds the limit of {limit}")
    try:
        async with asyncio.timeout(config.body_timeout_s):
            raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise BadRequest(413, f"request body exceeds the limit of {limit} bytes") from None
    except TimeoutError:
        raise BadRequest(408, f"request body not received within {config.body_timeout_s}s") from None
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise BadRequest(400, f"request body is not JSON: {str(exc)[:200]}") from None


def parse_call(
    body: Any, request: Any, where: str = "request body"
) -> tuple[str | None, dict[str, Any], str]:
    """``(key, trajectory, digest)`` of one call ``{"key"?, "trajectory"}``, or :class:`BadRequest`."""
    if not isinstance(body, dict):
        raise BadRequest(400, f"{where}: expected a JSON object {{'key', 'trajectory'}}, got {_kind(body)}")
    if "trajectory" not in body:
        raise BadRequest(400, f"{where}: missing 'trajectory'")
    key = body.get("key")
    if key is None or key == "":
        key = request.headers.get("Idempotency-Key") or None
    if key is not None and (not isinstance(key, str) or len(key) > _MAX_KEY):
        raise BadRequest(
            400, f"{where}: 'key' must be a string of at most {_MAX_KEY} characters, got {_kind(key)}"
        )
    trajectory = body["trajectory"]
    try:
        trajectory_from_dict(trajectory)
    except RewardError as exc:
        raise BadRequest(400, f"{where}: {exc}") from None
    try:
        digest = body_digest(trajectory)
    except (ValueError, TypeError, RecursionError) as exc:
        raise BadRequest(400, f"{where}: trajectory is not serialisable: {str(exc)[:200]}") from None
    return key, trajectory, digest
