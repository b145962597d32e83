"""A load generator in a process of its own (:class:`LoadClient`), for benchmarks that compare HTTP
endpoints: a client in the server's process would share its GIL and event loop. Each round posts a
list of bodies at once and answers the round's wall time, each request's latency and the token
counts the replies report (Chat Completions', Responses' or Messages' usage; a streamed reply is
read to its end and its usage taken from its events)."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import time
from typing import Any


def _token_counts(usage: dict[str, Any]) -> tuple[int, int]:
    """``(prompt, completion)`` tokens of a usage object: Chat Completions' names or the dialects'."""
    get = usage.get
    return get("prompt_tokens", get("input_tokens", 0)), get("completion_tokens", get("output_tokens", 0))


def _stream_usage(text: str) -> dict[str, Any]:
    """The usage a stream reports, in any of the three dialects: a chat chunk's ``usage``, Responses'
    ``response.completed`` ``response.usage``, Messages' ``message_start`` / ``message_delta`` usage
    (the last one seen wins, field by field)."""
    found: dict[str, Any] = {}
    for line in text.splitlines():
        if line.startswith("data: {"):
            event = json.loads(line[len("data: ") :])
            inner = event.get("response") or event.get("message") or {}
            found.update(event.get("usage") or inner.get("usage") or {})
    if not found:
        raise RuntimeError(f"a stream without usage: {text[-300:]!r}")
    return found


def _client_main(conn: Any) -> None:
    """The load generator, in a process of its own: for each ``(url, path, bodies, headers)`` it receives,
    posts every body at once and answers ``(wall s, per-request latencies, prompt tokens, completion
    tokens)``; a streamed request is read to its end."""
    import httpx

    async def serve() -> None:
        clients: dict[str, httpx.AsyncClient] = {}
        while True:
            job = await asyncio.to_thread(conn.recv)
            if job is None:
                break
            url, path, bodies, headers = job
            if url not in clients:
                clients[url] = httpx.AsyncClient(
                    base_url=url,
                    trust_env=False,
                    timeout=600,
                    # idle connections dropped before the server's keep-alive timeout (5 s) closes them under us
                    limits=httpx.Limits(max_connections=len(bodies) + 8, keepalive_expiry=1.0),
                )
            client = clients[url]

            async def one(
                client: httpx.AsyncClient, url: str, path: str, body: dict[str, Any], h: dict[str, str]
            ) -> tuple[float, int, int]:
                t0 = time.perf_counter()
                r = await client.post(path, json=body, headers=h)
                if r.status_code != 200:
                    raise RuntimeError(f"{url}{path}: {r.status_code} {r.text[:500]}")
                latency = time.perf_counter() - t0
                usage = _stream_usage(r.text) if body.get("stream") else r.json()["usage"]
                return latency, *_token_counts(usage)

            t0 = time.perf_counter()
            try:
                res = await asyncio.gather(
                    *(one(client, url, path, b, h) for b, h in zip(bodies, headers, strict=True))
                )
            except Exception as e:
                conn.send(("error", repr(e)))
                continue
            wall = time.perf_counter() - t0
            conn.send(("ok", (wall, [r[0] for r in res], sum(r[1] for r in res), sum(r[2] for r in res))))
        for c in clients.values():
            await c.aclose()

    asyncio.run(serve())


class LoadClient:
    """Handle of the load-generating process."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_client_main, args=(child,), daemon=True)
        self.proc.start()

    async def round(
        self, url: str, path: str, bodies: list[dict[str, Any]], headers: list[dict[str, str]]
    ) -> Any:
        self.conn.send((url, path, bodies, headers))
        status, value = await asyncio.to_thread(self.conn.recv)
        if status != "ok":
            raise RuntimeError(f"load client: {value}")
        return value

    def close(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
