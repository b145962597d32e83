"""Environments over HTTP: a small server exposing any Environment, and a client that makes a
remote one look local. Needs ``pip install 'rollart-env[remote]'`` (aiohttp).

Wire protocol (JSON bodies; one session = one environment instance on the server)::

    POST   /sessions                   → {session, action_vocabulary, system_prompt}
    POST   /sessions/{id}/reset {seed}  → {observation, info}
    POST   /sessions/{id}/step {action} → {observation, reward, terminated, truncated, info}
    DELETE /sessions/{id}               → {}   (closes the env)
    GET    /health                      → {sessions, created}

Errors come back as ``{"error": ..., "type": ...}`` with status 404 (unknown session), 409
(``max_sessions`` reached), 422 (bad body) or 500 (the environment raised); the client raises
:class:`~rollart_core.errors.EnvError` naming the cause, or
:class:`~rollart_core.errors.EnvTimeoutError` when a call exceeds its timeout. The server binds
127.0.0.1 unless told otherwise; the served environment is fixed by the server's owner (clients
cannot choose code to load).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from rollart_core.errors import EnvError, EnvTimeoutError
from rollart_core.extras import require
from rollart_core.protocols import Environment
from rollart_core.types import StepResult

__all__ = ["EnvServer", "RemoteEnv", "RemoteEnvConfig"]

log = logging.getLogger(__name__)
_INSTALL = "pip install 'rollart-env[remote]'"


def _dumps(obj: Any) -> str:
    return json.dumps(obj, default=str)  # info dicts may carry numpy scalars, enums, ...


class EnvServer:
    """Serves environments made by ``factory`` over HTTP. ``async with EnvServer(f) as s: s.url``."""

    def __init__(self, factory: Callable[[], Environment], *, host: str = "127.0.0.1", port: int = 0,
                 max_sessions: int = 256) -> None:
        self.factory = factory
        self.host, self.port = host, port
        self.max_sessions = max_sessions
        self.sessions: dict[str, Environment] = {}
        self.created = 0
        self._runner: Any = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> str:
        web = require("aiohttp.web", _INSTALL)
        app = web.Application()
        app.add_routes([
            web.get("/health", self._health),
            web.post("/sessions", self._create),
            web.post("/sessions/{sid}/reset", self._reset),
            web.post("/sessions/{sid}/step", self._step),
            web.delete("/sessions/{sid}", self._close),
        ])
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]  # the bound port when port=0
        return self.url

    async def stop(self) -> None:
        for sid in list(self.sessions):
            env = self.sessions.pop(sid)
            try:
                await env.close()
            except Exception as exc:
                log.warning("closing session %s failed: %r", sid, exc)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> EnvServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # handlers --------------------------------------------------------------------------------

    @staticmethod
    def _json(data: Any, status: int = 200) -> Any:
        from aiohttp import web

        return web.Response(text=_dumps(data), status=status, content_type="application/json")

    def _error(self, status: int, exc: BaseException | str) -> Any:
        msg = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
        kind = "" if isinstance(exc, str) else type(exc).__name__
        return self._json({"error": msg, "type": kind}, status)

    async def _body(self, request: Any, key: str, kind: type) -> Any:
        try:
            body = await request.json()
            value = body[key]
        except (ValueError, KeyError, TypeError):
            return None
        return value if isinstance(value, kind) and not isinstance(value, bool) else None

    async def _health(self, request: Any) -> Any:
        return self._json({"sessions": len(self.sessions), "created": self.created})

    async def _create(self, request: Any) -> Any:
        if len(self.sessions) >= self.max_sessions:
            return self._error(409, f"max_sessions={self.max_sessions} reached")
        try:
            env = self.factory()
            start = getattr(env, "start", None)
            if callable(start):
                await start()
        except Exception as exc:
            return self._error(500, exc)
        sid = uuid.uuid4().hex
        self.sessions[sid] = env
        self.created += 1
        vocab = list(env.action_vocabulary) if env.action_vocabulary else None
        return self._json({"session": sid, "action_vocabulary": vocab, "system_prompt": env.system_prompt})

    def _env(self, request: Any) -> Environment | None:
        return self.sessions.get(request.match_info["sid"])

    async def _reset(self, request: Any) -> Any:
        env = self._env(request)
        if env is None:
            return self._error(404, "unknown session")
        seed = await self._body(request, "seed", int)
        if seed is None:
            return self._error(422, "body must be {\"seed\": <int>}")
        try:
            obs, info = await env.reset(seed)
        except Exception as exc:
            return self._error(500, exc)
        return self._json({"observation": obs, "info": info})

    async def _step(self, request: Any) -> Any:
        env = self._env(request)
        if env is None:
            return self._error(404, "unknown session")
        action = await self._body(request, "action", str)
        if action is None:
            return self._error(422, "body must be {\"action\": <str>}")
        try:
            r = await env.step(action)
        except Exception as exc:
            return self._error(500, exc)
        return self._json({"observation": r.observation, "reward": r.reward, "terminated": r.terminated,
                           "truncated": r.truncated, "info": r.info})

    async def _close(self, request: Any) -> Any:
        env = self.sessions.pop(request.match_info["sid"], None)
        if env is None:
            return self._error(404, "unknown session")
        try:
            await env.close()
        except Exception as exc:
            return self._error(500, exc)
        return self._json({})


class RemoteEnvConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    url: str = Field(pattern=r"^https?://")
    """Base URL of an :class:`EnvServer`, e.g. ``http://127.0.0.1:8765``."""
    timeout_s: float = Field(30.0, gt=0)
    """Per request (create/reset/step/close)."""


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
    async def connect(cls, url: str, timeout_s: float = 30.0) -> RemoteEnv:
        env = cls(RemoteEnvConfig(url=url, timeout_s=timeout_s))
        await env.start()
        return env

    async def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        aiohttp = require("aiohttp", _INSTALL)
        if self._http is None:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.config.timeout_s))
        url = self.config.url.rstrip("/") + path
        t0 = time.perf_counter()
        try:
            async with self._http.request(method, url, data=None if body is None else _dumps(body),
                                          headers={"Content-Type": "application/json"}) as resp:
                data = await resp.json(content_type=None)
                status = resp.status
        except TimeoutError:
            raise EnvTimeoutError(f"{method} {url}: no answer within {self.config.timeout_s}s "
                                  f"(waited {time.perf_counter() - t0:.1f}s)") from None
        except aiohttp.ClientError as exc:
            raise EnvError(f"{method} {url}: {type(exc).__name__}: {exc}") from exc
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
        return StepResult(d["observation"], float(d["reward"]), bool(d["terminated"]), bool(d["truncated"]), d["info"])

    async def close(self) -> None:
        try:
            if self.session_id is not None:
                sid, self.session_id = self.session_id, None
                await self._request("DELETE", f"/sessions/{sid}")
        finally:
            if self._http is not None:
                await self._http.close()
                self._http = None
