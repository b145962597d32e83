"""The run's admin endpoint: engines listed, added and removed while the run goes on.

A small HTTP/1.1 server (stdlib asyncio, one request per connection) on 127.0.0.1, started by the
pipeline when ``admin.enabled``. Its address and a random bearer token are written to
``<output_dir>/admin.json`` (mode 0600): whoever can read the run's directory can drive it.
``rollart engines RUN_DIR ...`` is its client.

    GET    /engines                          the engines: group, health, load, being removed
    POST   /engines        {"group": G}      add one engine to group G (optional "place_timeout_s")
    DELETE /engines/NAME[?drain_timeout_s=S] drain and remove engine NAME

Answers are JSON; an error is ``{"error": message}`` with 400 (bad request), 401 (no or wrong
token), 404 (unknown group, engine or path), 409 (refused: the last engine of a group, a pool the
cluster lacks), 503 (no room for an engine within the placement timeout) or 500.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import secrets
from http import HTTPStatus
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

from rollart_core.control.elastic import ElasticError
from rollart_core.errors import ConfigError

if TYPE_CHECKING:
    from rollart_core.control.pipeline import Pipeline

__all__ = ["ADMIN_FILE", "AdminServer", "admin_call"]
log = logging.getLogger(__name__)

ADMIN_FILE = "admin.json"
MAX_HEAD = 16 * 1024
MAX_BODY = 64 * 1024
READ_TIMEOUT_S = 10.0


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class AdminServer:
    """``await AdminServer(pipeline).start(port)``; ``await server.close()`` when the run ends."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline
        self.token = secrets.token_urlsafe(24)
        self.url = ""
        self._server: asyncio.Server | None = None
        self._file: Path | None = None

    async def start(self, port: int = 0) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", port)
        bound = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{bound}"
        out = self.pipeline.config.output_dir
        out.mkdir(parents=True, exist_ok=True)
        self._file = out / ADMIN_FILE
        fd = os.open(self._file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"url": self.url, "token": self.token, "pid": os.getpid()}, f)
        log.info("admin endpoint on %s (address and token in %s)", self.url, self._file)
        return self.url

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        if self._file is not None:
            self._file.unlink(missing_ok=True)  # a finished run cannot be driven
            self._file = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                method, target, headers, body = await asyncio.wait_for(_read(reader), READ_TIMEOUT_S)
                status, answer = await self._answer(method, target, headers, body)
            except _Refused as exc:
                status, answer = exc.status, {"error": str(exc)}
            except TimeoutError:
                status, answer = 400, {"error": f"request not received within {READ_TIMEOUT_S:g}s"}
            data = json.dumps(answer).encode()
            reason = HTTPStatus(status).phrase
            writer.write(
                f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode()
                + data
            )
            await writer.drain()
        except Exception as exc:  # a client that went away: nothing to answer
            log.debug("admin connection: %r", exc)
        finally:
            writer.close()

    async def _answer(
        self, method: str, target: str, headers: dict[str, str], body: bytes
    ) -> tuple[int, dict[str, Any]]:
        auth = headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.token.encode()):
            raise _Refused(401, "missing or wrong bearer token (it is in the run's admin.json)")
        url = urlsplit(target)
        parts = [p for p in url.path.split("/") if p]
        if not parts or parts[0] != "engines" or len(parts) > 2:
            raise _Refused(404, f"no such path {url.path!r} (GET/POST /engines, DELETE /engines/NAME)")
        elastic = self.pipeline.elastic
        if elastic is None:
            raise _Refused(409, "the run's engines have not started")
        try:
            if method == "GET" and len(parts) == 1:
                metrics = await self.pipeline.proxy.metrics(engine_stats=False)
                return 200, {"engines": elastic.describe(metrics), "changes": elastic.changes}
            if method == "POST" and len(parts) == 1:
                req = _json_object(body)
                group = req.get("group")
                if not isinstance(group, str):
                    raise _Refused(400, 'body must be {"group": "<engine group>"}')
                timeout = _number(req.get("place_timeout_s", 120.0), "place_timeout_s")
                return 200, await elastic.add(group, place_timeout_s=timeout, why="admin")
            if method == "DELETE" and len(parts) == 2:
                query = parse_qs(url.query)
                drain = _number(query.get("drain_timeout_s", ["60"])[0], "drain_timeout_s")
                return 200, await elastic.remove(parts[1], drain_timeout_s=drain, why="admin")
        except ElasticError as exc:
            raise _Refused(exc.status, str(exc)) from None
        except ConfigError as exc:
            raise _Refused(400, str(exc)) from None
        except _Refused:
            raise
        except Exception as exc:
            log.exception("admin %s %s failed", method, url.path)
            raise _Refused(500, f"{type(exc).__name__}: {exc}") from None
        raise _Refused(405, f"{method} is not allowed on {url.path}")


async def _read(reader: asyncio.StreamReader) -> tuple[str, str, dict[str, str], bytes]:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.LimitOverrunError:
        raise _Refused(400, "request head too large") from None
    except asyncio.IncompleteReadError:
        raise _Refused(400, "incomplete request") from None
    if len(head) > MAX_HEAD:
        raise _Refused(400, "request head too large")
    lines = head.decode("latin-1").split("\r\n")
    try:
        method, target, _version = lines[0].split(" ")
    except ValueError:
        raise _Refused(400, f"malformed request line {lines[0][:80]!r}") from None
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
    try:
        n = int(headers.get("content-length", "0"))
    except ValueError:
        raise _Refused(400, "bad Content-Length") from None
    if not 0 <= n <= MAX_BODY:
        raise _Refused(400, f"body must be at most {MAX_BODY} bytes")
    body = await reader.readexactly(n) if n else b""
    return method, target, headers, body


def _json_object(body: bytes) -> dict[str, Any]:
    try:
        value = json.loads(body or b"{}")
    except ValueError as exc:
        raise _Refused(400, f"body is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise _Refused(400, "body must be a JSON object")
    return value


def _number(value: object, name: str) -> float:
    try:
        x = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise _Refused(400, f"{name} must be a number, got {value!r}") from None
    if not 0 <= x <= 3600:
        raise _Refused(400, f"{name} must be between 0 and 3600, got {x:g}")
    return x


def admin_call(
    run_dir: str | Path, method: str, path: str, body: dict[str, Any] | None = None, timeout_s: float = 900.0
) -> dict[str, Any]:
    """One call to the admin endpoint of the run going on in ``run_dir`` (its ``admin.json``).
    Raises :class:`ConfigError` when no run serves there, :class:`ElasticError` with the answer's
    status and message when the endpoint refuses."""
    import urllib.error
    import urllib.request

    file = Path(run_dir) / ADMIN_FILE
    try:
        info = json.loads(file.read_text())
        url, token = info["url"], info["token"]
    except FileNotFoundError:
        raise ConfigError(
            f"{file} does not exist: no run with an admin endpoint is going on in {run_dir}"
        ) from None
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{file} is not an admin file: {exc!r}") from None
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url + path, data=data, method=method, headers={"Authorization": f"Bearer {token}"}
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never a proxy
    try:
        with opener.open(request, timeout=timeout_s) as reply:
            answer: dict[str, Any] = json.loads(reply.read())
            return answer
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read()).get("error", "")
        except ValueError:
            message = ""
        raise ElasticError(f"{method} {path}: {exc.code}: {message}", exc.code) from None
    except (urllib.error.URLError, OSError) as exc:
        raise ConfigError(
            f"the run's admin endpoint {url} does not answer ({exc}): has the run ended?"
        ) from None
