"""Environments over HTTP: a small server exposing any Environment, and a client that makes a
remote one look local. Needs ``pip install 'rollart-env[remote]'`` (aiohttp).

Wire protocol (JSON bodies; one session = one environment instance on the server)::

    POST   /sessions                   → {session, action_vocabulary, system_prompt}
    POST   /sessions/{id}/reset {seed}  → {observation, info}
    POST   /sessions/{id}/step {action} → {observation, reward, terminated, truncated, info}
    DELETE /sessions/{id}               → {}   (closes the env)
    GET    /health                      → {sessions, created, expired, max_sessions, idle_ttl_s}

Sessions are bounded: at most ``max_sessions`` at once and at most ``max_sessions_per_key`` per API
key, so one client cannot fill the table for all (a create beyond either gets 429 with
``Retry-After``), and a session not used for ``idle_ttl_s`` is closed by the server (a client that
vanished without ``DELETE`` leaks nothing); calls to it then get 404. A session's call in progress
keeps it alive.

Closed by default (the conventions of ``rollart-proxy``'s server and ``rollart-reward serve``):

- **Bind**: 127.0.0.1 unless told otherwise; binding beyond loopback without an API key logs a WARNING.
- **API keys** (``api_key``, or env ``ROLLART_ENV_API_KEY``, comma-separated for several clients):
  when set, every endpoint (``/health`` included) needs ``Authorization: Bearer <key>`` (401
  without, or with a wrong one). :class:`RemoteEnv` sends its ``api_key`` (or the same variable).
- **Sessions** belong to the key that created them: resetting, stepping or deleting another key's
  session gets 403. Without API keys every client is the same anonymous principal.
- **Bounded**: bodies (413), the time to send a body (``body_timeout_s``: a client that declares a
  body and never sends it gets 408 instead of holding a handler forever), sessions (429, per key
  too, idle expiry), seeds (a signed 64-bit integer, as vLLM bounds them; else 422).
- The served environment is fixed by the server's owner (clients cannot choose code to load).

Errors come back as ``{"error": ..., "type": ...}`` with status 401 (no or wrong API key), 403
(another key's session), 404 (unknown or expired session), 413 (body too large), 422 (bad body),
429 (``max_sessions`` reached) or 500 (the environment raised); the client raises
:class:`~rollart_core.errors.EnvError` naming the cause, or
:class:`~rollart_core.errors.EnvTimeoutError` when a call exceeds its timeout. A step whose action
the environment rejects with :class:`~rollart_core.errors.InvalidActionError` (the model's fault) is
a 422 of type ``InvalidActionError`` with its ``reward``, raised again as that error by the client,
so the episode is scored with the failure reward rather than failed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from rollart_core.errors import EnvError, EnvTimeoutError, InvalidActionError
from rollart_core.extras import require
from rollart_core.protocols import Environment
from rollart_core.serving import INT64_MAX, INT64_MIN, ApiKeys, bearer_token, is_loopback
from rollart_core.types import StepResult

__all__ = ["API_KEY_ENV", "EnvServer", "RemoteEnv", "RemoteEnvConfig"]

log = logging.getLogger(__name__)
_INSTALL = "pip install 'rollart-env[remote]'"

API_KEY_ENV = "ROLLART_ENV_API_KEY"
"""Environment variable the server reads its API keys from (comma-separated) and :class:`RemoteEnv`
its key from, when none is given: keeps them out of ``ps`` and config files."""


def _dumps(obj: Any) -> str:
    return json.dumps(obj, default=str)  # info dicts may carry numpy scalars, enums, ...


@dataclass(eq=False)
class _Session:
    env: Environment
    last_used: float
    owner: str | None = None
    """The principal (API key) that created it; None without API keys."""
    busy: int = 0
    """Calls in progress: a busy session never expires."""


class _BodyTimeout(Exception):
    """A request body was not received within the server's ``body_timeout_s``."""


def _is_int64(value: int) -> bool:
    return INT64_MIN <= value <= INT64_MAX


class EnvServer:
    """Serves environments made by ``factory`` over HTTP. ``async with EnvServer(f) as s: s.url``.

    ``max_sessions``: sessions held at once (more creates get 429); ``max_sessions_per_key``: of
    those, held by one API key (None: no quota of its own). ``idle_ttl_s``: a session unused
    for this long is closed (None: never; then only ``DELETE`` frees one). ``max_body_bytes``: larger
    request bodies get 413; ``body_timeout_s``: a body not received within it gets 408. ``api_key``:
    bearer token(s) every request must carry; None reads ``ROLLART_ENV_API_KEY`` (comma-separated),
    an empty string or list means none."""

    def __init__(
        self,
        factory: Callable[[], Environment],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        max_sessions: int = 256,
        idle_ttl_s: float | None = 600.0,
        max_body_bytes: int = 1 << 20,
        api_key: str | Sequence[str] | None = None,
        max_sessions_per_key: int | None = None,
        body_timeout_s: float = 30.0,
    ) -> None:
        if max_sessions < 1:
            raise ValueError("max_sessions must be >= 1")
        if max_sessions_per_key is not None and max_sessions_per_key < 1:
            raise ValueError("max_sessions_per_key must be >= 1 (or None: no quota per key)")
        if body_timeout_s <= 0:
            raise ValueError("body_timeout_s must be > 0")
        if idle_ttl_s is not None and idle_ttl_s <= 0:
            raise ValueError("idle_ttl_s must be > 0 (or None: sessions never expire)")
        self.factory = factory
        self.host, self.port = host, port
        self.max_sessions = max_sessions
        self.idle_ttl_s = idle_ttl_s
        self.max_body_bytes = max_body_bytes
        self.max_sessions_per_key = max_sessions_per_key
        self.body_timeout_s = body_timeout_s
        self._api_keys = ApiKeys(api_key, API_KEY_ENV)
        self.unauthorized = 0
        """Requests refused for a missing or wrong API key (401) or another key's session (403)."""
        self._sessions: dict[str, _Session] = {}
        self.created = 0
        self.expired = 0
        self._creating: Counter[str | None] = Counter()
        """Sessions being created (their environment starting), per principal: they hold a slot."""
        self._runner: Any = None
        self._reaper: asyncio.Task[None] | None = None

    @property
    def sessions(self) -> dict[str, Environment]:
        """The open sessions' environments by session id (a snapshot)."""
        return {sid: s.env for sid, s in self._sessions.items()}

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> str:
        web = require("aiohttp.web", _INSTALL)
        if not is_loopback(self.host) and not self._api_keys:
            log.warning(
                "EnvServer binds %s (beyond loopback) without an API key: anyone who reaches it can "
                "open, drive and close environment sessions; set api_key or %s",
                self.host,
                API_KEY_ENV,
            )
        app = web.Application(client_max_size=self.max_body_bytes, middlewares=[self._guard(web)])
        app.add_routes(
            [
                web.get("/health", self._health),
                web.post("/sessions", self._create),
                web.post("/sessions/{sid}/reset", self._reset),
                web.post("/sessions/{sid}/step", self._step),
                web.delete("/sessions/{sid}", self._close),
            ]
        )
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        try:
            await site.start()
        except OSError:  # e.g. the address is taken or not on this machine: leave nothing behind
            await self._runner.cleanup()
            self._runner = None
            raise
        self.port = self._runner.addresses[0][1]  # the bound port when port=0
        if self.idle_ttl_s is not None:
            self._reaper = asyncio.create_task(self._reap_loop(), name="rollart-env-server-reaper")
        return self.url

    async def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.gather(self._reaper, return_exceptions=True)
            self._reaper = None
        for sid in list(self._sessions):
            await self._close_env(sid, self._sessions.pop(sid).env)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> EnvServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # sessions --------------------------------------------------------------------------------

    @staticmethod
    async def _close_env(sid: str, env: Environment) -> None:
        try:
            await env.close()
        except Exception as exc:
            log.warning("closing session %s failed: %r", sid, exc)

    async def expire_idle(self) -> int:
        """Close the sessions idle for longer than ``idle_ttl_s``; returns how many."""
        if self.idle_ttl_s is None:
            return 0
        cutoff = time.monotonic() - self.idle_ttl_s
        stale = [sid for sid, s in self._sessions.items() if not s.busy and s.last_used < cutoff]
        for sid in stale:
            session = self._sessions.pop(sid)
            self.expired += 1
            log.info("env session %s expired after %.0fs idle", sid, self.idle_ttl_s)
            await self._close_env(sid, session.env)
        return len(stale)

    async def _reap_loop(self) -> None:
        assert self.idle_ttl_s is not None
        interval = min(max(self.idle_ttl_s / 4, 0.05), 10.0)
        while True:
            await asyncio.sleep(interval)
            try:
                await self.expire_idle()
            except Exception as exc:  # never let one bad close stop the expiry of the rest
                log.warning("expiring idle env sessions failed: %r", exc)

    # handlers --------------------------------------------------------------------------------

    def _guard(self, web: Any) -> Any:
        """The API key check (before any body is read), then router and body-size refusals (404,
        405, 413) in the same JSON shape as the handlers' errors."""

        @web.middleware
        async def guard(request: Any, handler: Any) -> Any:
            principal, denied = self._api_keys.check(bearer_token(request.headers.get("Authorization")))
            if denied is not None:
                self.unauthorized += 1
                resp = self._error(401, denied)
                resp.headers["WWW-Authenticate"] = "Bearer"
                return resp
            request["rollart_principal"] = principal
            try:
                return await handler(request)
            except web.HTTPException as exc:
                if exc.status < 400:
                    raise
                resp = self._error(exc.status, exc.reason)
                if "Allow" in exc.headers:
                    resp.headers["Allow"] = exc.headers["Allow"]
                return resp

        return guard

    def _session_of(self, request: Any, *, pop: bool = False) -> tuple[_Session | None, Any]:
        """The request's session if its key may use it: ``(session, None)`` or ``(None, error response)``."""
        sid = request.match_info["sid"]
        session = self._sessions.get(sid)
        if session is None:
            return None, self._error(404, "unknown or expired session")
        if session.owner != request.get("rollart_principal"):
            self.unauthorized += 1
            return None, self._error(403, "this session belongs to another API key")
        if pop:
            del self._sessions[sid]
        return session, None

    @staticmethod
    def _json(data: Any, status: int = 200) -> Any:
        from aiohttp import web

        return web.Response(text=_dumps(data), status=status, content_type="application/json")

    def _error(self, status: int, exc: BaseException | str) -> Any:
        msg = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
        kind = "" if isinstance(exc, str) else type(exc).__name__
        return self._json({"error": msg, "type": kind}, status)

    async def _body(self, request: Any, key: str, kind: type) -> Any:
        """``body[key]`` if it is a ``kind``, else None; :class:`_BodyTimeout` if the body is not in
        within ``body_timeout_s``."""
        try:
            async with asyncio.timeout(self.body_timeout_s):
                raw = await request.read()
        except TimeoutError:
            raise _BodyTimeout from None
        try:
            value = json.loads(raw)[key]
        except (ValueError, KeyError, TypeError, IndexError, RecursionError):
            return None
        return value if isinstance(value, kind) and not isinstance(value, bool) else None

    async def _health(self, request: Any) -> Any:
        return self._json(
            {
                "sessions": len(self._sessions),
                "created": self.created,
                "expired": self.expired,
                "max_sessions": self.max_sessions,
                "idle_ttl_s": self.idle_ttl_s,
            }
        )

    def _refusal(self, principal: str | None) -> str | None:
        """Why a new session of ``principal`` must wait (the table or its quota is full), or None."""
        if len(self._sessions) + sum(self._creating.values()) >= self.max_sessions:
            return f"max_sessions={self.max_sessions} reached"
        quota = self.max_sessions_per_key
        if quota is not None:
            held = sum(s.owner == principal for s in self._sessions.values()) + self._creating[principal]
            if held >= quota:
                return f"this API key holds max_sessions_per_key={quota} sessions"
        return None

    async def _create(self, request: Any) -> Any:
        principal = request.get("rollart_principal")
        if self._refusal(principal) is not None:
            await self.expire_idle()  # make room from the expired ones before refusing
        why = self._refusal(principal)
        if why is not None:
            retry = max(1, round(self.idle_ttl_s / 4)) if self.idle_ttl_s else 5
            resp = self._error(429, f"{why}: close a session (DELETE) or retry later")
            resp.headers["Retry-After"] = str(retry)
            return resp
        self._creating[principal] += 1  # a slot is held while the environment starts
        try:
            env = self.factory()
            start = getattr(env, "start", None)
            if callable(start):
                await start()
        except Exception as exc:
            return self._error(500, exc)
        finally:
            self._creating[principal] -= 1
            if not self._creating[principal]:
                del self._creating[principal]
        sid = uuid.uuid4().hex
        self._sessions[sid] = _Session(env, time.monotonic(), owner=principal)
        self.created += 1
        vocab = list(env.action_vocabulary) if env.action_vocabulary else None
        return self._json({"session": sid, "action_vocabulary": vocab, "system_prompt": env.system_prompt})

    async def _use(
        self,
        request: Any,
        key: str,
        kind: type,
        call: Callable[[Environment, Any], Any],
        usage: str,
        valid: Callable[[Any], bool] = lambda _: True,
    ) -> Any:
        """Run ``call(env, body[key])`` on the request's session, which stays alive while it runs;
        a ``body[key]`` that is not a ``kind`` or not ``valid`` gets 422 naming ``usage``."""
        session, refused = self._session_of(request)
        if session is None:
            return refused
        session.busy += 1
        try:
            try:
                value = await self._body(request, key, kind)
            except _BodyTimeout:
                return self._error(408, f"request body not received within {self.body_timeout_s}s")
            if value is None or not valid(value):
                return self._error(422, f"body must be {usage}")
            try:
                return self._json(await call(session.env, value))
            except InvalidActionError as exc:  # the model's fault, not the server's: 422 with its reward
                return self._json(
                    {"error": str(exc), "type": "InvalidActionError", "reward": exc.reward}, 422
                )
            except Exception as exc:
                return self._error(500, exc)
        finally:
            session.busy -= 1
            session.last_used = time.monotonic()

    async def _reset(self, request: Any) -> Any:
        async def reset(env: Environment, seed: int) -> dict[str, Any]:
            obs, info = await env.reset(seed)
            return {"observation": obs, "info": info}

        return await self._use(
            request, "seed", int, reset, '{"seed": <int>}, a signed 64-bit integer', valid=_is_int64
        )

    async def _step(self, request: Any) -> Any:
        async def step(env: Environment, action: str) -> dict[str, Any]:
            r = await env.step(action)
            return {
                "observation": r.observation,
                "reward": r.reward,
                "terminated": r.terminated,
                "truncated": r.truncated,
                "info": r.info,
            }

        return await self._use(request, "action", str, step, '{"action": <str>}')

    async def _close(self, request: Any) -> Any:
        session, refused = self._session_of(request, pop=True)
        if session is None:
            return refused
        try:
            await session.env.close()
        except Exception as exc:
            return self._error(500, exc)
        return self._json({})


class RemoteEnvConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    url: str = Field(pattern=r"^https?://")
    """Base URL of an :class:`EnvServer`, e.g. ``http://127.0.0.1:8765``."""
    timeout_s: float = Field(30.0, gt=0)
    """Per request (create/reset/step/close)."""
    api_key: str | None = Field(None, repr=False, min_length=1)
    """Bearer token sent as ``Authorization: Bearer ...``; None: ``$ROLLART_ENV_API_KEY`` if set."""


class RemoteEnv:
    """A remote environment that looks local. ``await start()`` (or the first reset) opens the session."""

    Config = RemoteEnvConfig

    def __init__(self, config: RemoteEnvConfig) -> None:
        self.config = config
        self.session_id: str | None = None
        self.action_vocabulary: tuple[str, ...] | None = None
        self.system_prompt: str | None = None
        self._http: Any = None

    @classmethod
    async def connect(cls, url: str, timeout_s: float = 30.0, api_key: str | None = None) -> RemoteEnv:
        env = cls(RemoteEnvConfig(url=url, timeout_s=timeout_s, api_key=api_key))
        try:
            await env.start()
        except BaseException:
            await env.close()  # its HTTP client, which a failed connect would leak
            raise
        return env

    async def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        aiohttp = require("aiohttp", _INSTALL)
        if self._http is None:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.config.timeout_s))
        url = self.config.url.rstrip("/") + path
        headers = {"Content-Type": "application/json"}
        token = self.config.api_key or os.environ.get(API_KEY_ENV) or None
        if token:
            headers["Authorization"] = f"Bearer {token}"
        t0 = time.perf_counter()
        try:
            async with self._http.request(
                method, url, data=None if body is None else _dumps(body), headers=headers
            ) as resp:
                data = await resp.json(content_type=None)
                status = resp.status
        except TimeoutError:
            raise EnvTimeoutError(
                f"{method} {url}: no answer within {self.config.timeout_s}s "
                f"(waited {time.perf_counter() - t0:.1f}s)"
            ) from None
        except aiohttp.ClientError as exc:
            raise EnvError(f"{method} {url}: {type(exc).__name__}: {exc}") from exc
        if status == 422 and isinstance(data, dict) and data.get("type") == "InvalidActionError":
            reward = data.get("reward")
            raise InvalidActionError(
                str(data.get("error")), float(reward) if isinstance(reward, int | float) else 0.0
            )
        if status != 200:
            err = data.get("error", data) if isinstance(data, dict) else data
            raise EnvError(f"remote env {method} {path} failed ({status}): {err}")
        return data

    async def start(self) -> None:
        if self.session_id is not None:
            return
        data = await self._request("POST", "/sessions")
        self.session_id = data["session"]
        vocab = data.get("action_vocabulary")
        self.action_vocabulary = tuple(vocab) if vocab else None
        self.system_prompt = data.get("system_prompt")

    async def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        await self.start()
        data = await self._request("POST", f"/sessions/{self.session_id}/reset", {"seed": seed})
        return data["observation"], data["info"]

    async def step(self, action_text: str) -> StepResult:
        if self.session_id is None:
            raise EnvError("step() before reset(): no remote session")
        d = await self._request("POST", f"/sessions/{self.session_id}/step", {"action": action_text})
        return StepResult(
            d["observation"], float(d["reward"]), bool(d["terminated"]), bool(d["truncated"]), d["info"]
        )

    async def close(self) -> None:
        try:
            if self.session_id is not None:
                sid, self.session_id = self.session_id, None
                await self._request("DELETE", f"/sessions/{sid}")
        finally:
            if self._http is not None:
                await self._http.close()
                self._http = None
