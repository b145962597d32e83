"""EnvServer under generated requests (hypothesis), and its session bounds: idle expiry and a full table.

A real EnvServer (aiohttp on 127.0.0.1) serving real FrozenLake environments runs on a loop in a
thread; requests go over a real socket with ``http.client`` so that bodies can be anything (bytes
that are not JSON, JSON of every shape, huge or deep values). Every answer must be a 4xx/2xx JSON
object: the environment only sees well-typed calls, and a malformed request never reaches it.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time
import urllib.parse
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("aiohttp")

from rollart_env.frozenlake import FrozenLakeEnv
from rollart_env.remote import EnvServer


class ThreadServer:
    """An EnvServer on its own event loop in a thread (hypothesis drives it synchronously)."""

    def __init__(self, **kw: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = EnvServer(FrozenLakeEnv, **kw)
        self.call(self.server.start())

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def close(self) -> None:
        self.call(self.server.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    def request(
        self, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None
    ) -> tuple[int, Any, dict[str, str]]:
        conn = http.client.HTTPConnection(self.server.host, self.server.port, timeout=10)
        try:
            conn.request(method, path, body=body, headers=headers or {"Content-Type": "application/json"})
            resp = conn.getresponse()
            raw = resp.read()
            try:
                data = json.loads(raw) if raw else None
            except ValueError:
                data = raw
            return resp.status, data, dict(resp.getheaders())
        finally:
            conn.close()

    def new_session(self) -> str:
        status, data, _ = self.request("POST", "/sessions", b"")
        assert status == 200, data
        return data["session"]


@pytest.fixture(scope="module")
def served() -> Iterator[ThreadServer]:
    s = ThreadServer(max_sessions=64, idle_ttl_s=60)
    try:
        yield s
    finally:
        s.close()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=50),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=20,
)
fields = st.one_of(
    json_values,
    st.integers(min_value=-(2**70), max_value=2**70),  # beyond int64 too
    st.text(max_size=300),
    st.sampled_from(["up", "down", "left", "right", "", "<action>up</action>", "\x00", "é" * 50]),
)
bodies = st.one_of(
    st.binary(max_size=300),  # anything, mostly not JSON
    json_values.map(lambda v: json.dumps(v).encode()),  # JSON of any shape
    st.dictionaries(st.sampled_from(["seed", "action", "x"]), fields, max_size=3).map(
        lambda v: json.dumps(v).encode()
    ),  # near-valid bodies
    st.integers(1, 200).map(lambda n: ("[" * n * 5 + "]" * n * 5).encode()),  # deep nesting
)
routes = st.sampled_from(["reset", "step", "delete", "create", "health", "other"])
session_ids = st.one_of(st.just("<live>"), st.text(max_size=40), st.sampled_from(["", "..", "%00", "a/b"]))


@settings(
    max_examples=150,
    deadline=2000,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(route=routes, sid=session_ids, body=bodies)
def test_generated_requests_get_4xx_or_2xx(served: ThreadServer, route: str, sid: str, body: bytes) -> None:
    live = served.new_session()
    sid = live if sid == "<live>" else urllib.parse.quote(sid, safe="")
    method, path = {
        "reset": ("POST", f"/sessions/{sid}/reset"),
        "step": ("POST", f"/sessions/{sid}/step"),
        "delete": ("DELETE", f"/sessions/{sid}"),
        "create": ("POST", "/sessions"),
        "health": ("GET", "/health"),
        "other": ("PUT", f"/sessions/{sid}"),
    }[route]
    if route == "step" and sid == live:  # a step needs a reset first: the env, not the body, would object
        assert served.request("POST", f"/sessions/{live}/reset", b'{"seed": 3}')[0] == 200
    status, data, _ = served.request(method, path, body)
    assert status < 500, (method, path, body[:200], status, data)
    if status >= 400:
        assert isinstance(data, dict) and data.get("error"), data
    served.request("DELETE", f"/sessions/{live}")
    # the server still answers, and leaked nothing
    status, health, _ = served.request("GET", "/health")
    assert status == 200 and health["sessions"] <= 1, health
    if health["sessions"]:  # a "create" route made one: close it
        for extra in list(served.server.sessions):
            served.request("DELETE", f"/sessions/{extra}")


def test_a_valid_episode_still_runs_after_fuzzing(served: ThreadServer) -> None:
    sid = served.new_session()
    status, data, _ = served.request("POST", f"/sessions/{sid}/reset", b'{"seed": 1}')
    assert status == 200 and data["observation"]
    status, data, _ = served.request("POST", f"/sessions/{sid}/step", b'{"action": "right"}')
    assert status == 200 and set(data) == {"observation", "reward", "terminated", "truncated", "info"}
    assert served.request("DELETE", f"/sessions/{sid}")[0] == 200


def test_idle_sessions_expire_and_a_full_table_refuses_with_429() -> None:
    s = ThreadServer(max_sessions=3, idle_ttl_s=0.5)
    try:
        a, b, c = (s.new_session() for _ in range(3))
        status, data, headers = s.request("POST", "/sessions", b"")
        assert status == 429 and "max_sessions=3" in data["error"] and int(headers["Retry-After"]) >= 1
        # a session in use stays: keep c busy with calls while a and b go idle
        deadline = time.monotonic() + 0.9
        while time.monotonic() < deadline:
            assert s.request("POST", f"/sessions/{c}/reset", b'{"seed": 0}')[0] == 200
            time.sleep(0.05)
        # the reaper closed a and b (idle > 0.5 s); c was used all along
        assert set(s.server.sessions) == {c}
        status, health, _ = s.request("GET", "/health")
        assert health["expired"] == 2 and health["sessions"] == 1
        status, data, _ = s.request("POST", f"/sessions/{a}/reset", b'{"seed": 0}')
        assert status == 404 and "expired" in data["error"]
        assert s.request("DELETE", f"/sessions/{b}")[0] == 404
        # the room they left is usable again
        assert s.new_session() and s.new_session()
        assert s.request("POST", "/sessions", b"")[0] == 429
    finally:
        s.close()
    assert s.server.sessions == {}  # stop() closed the rest


def test_a_full_table_without_ttl_frees_room_only_by_delete() -> None:
    s = ThreadServer(max_sessions=1, idle_ttl_s=None)
    try:
        sid = s.new_session()
        time.sleep(0.2)
        assert s.request("POST", "/sessions", b"")[0] == 429
        assert s.request("DELETE", f"/sessions/{sid}")[0] == 200
        assert s.new_session()
    finally:
        s.close()


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="idle_ttl_s"):
        EnvServer(FrozenLakeEnv, idle_ttl_s=0)
    with pytest.raises(ValueError, match="max_sessions"):
        EnvServer(FrozenLakeEnv, max_sessions=0)
