"""EnvServer's API keys over a real socket (aiohttp on 127.0.0.1, real Sokoban environments): 401
without or with a wrong key on every endpoint, 200 with it; sessions usable only with the key that
created them; RemoteEnv sending its key (config or ``ROLLART_ENV_API_KEY``); the warning when the
server binds beyond loopback without a key; the ``rollart-env serve`` command with a key."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import pytest

pytest.importorskip("aiohttp")

from rollart_core.errors import EnvError
from rollart_env import EnvServer, RemoteEnv, SokobanEnv
from rollart_env.remote import API_KEY_ENV

KEYS = ("key-alice", "key-bob")


async def call(
    server: EnvServer, method: str, path: str, token: str | None, body: bytes = b"{}"
) -> tuple[int, Any, Any]:
    import aiohttp

    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    async with (
        aiohttp.ClientSession() as http,
        http.request(method, server.url + path, data=body, headers=headers) as resp,
    ):
        return resp.status, await resp.json(content_type=None), resp.headers


@pytest.fixture
async def server(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[EnvServer]:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    async with EnvServer(SokobanEnv, api_key=",".join(KEYS)) as s:
        yield s


async def test_every_endpoint_needs_a_valid_key(server: EnvServer) -> None:
    status, data, _ = await call(server, "POST", "/sessions", "key-alice")
    assert status == 200, data
    sid = data["session"]
    routes = [
        ("GET", "/health", b""),
        ("POST", "/sessions", b""),
        ("POST", f"/sessions/{sid}/reset", b'{"seed": 1}'),
        ("POST", f"/sessions/{sid}/step", b'{"action": "up"}'),
        ("DELETE", f"/sessions/{sid}", b""),
        ("GET", "/no-such-route", b""),  # refused before routing: no probing without a key
    ]
    for method, path, body in routes:
        for token in (None, "", "key-mallory", "key-alice-and-more", "Key-Alice"):
            status, data, headers = await call(server, method, path, token, body)
            assert status == 401, (method, path, token, status, data)
            assert data["error"] and headers["WWW-Authenticate"] == "Bearer"
    assert server.unauthorized == len(routes) * 5
    assert set(server.sessions) == {sid}  # nothing was created, reset or closed without a key
    assert (await call(server, "POST", f"/sessions/{sid}/reset", "key-alice", b'{"seed": 1}'))[0] == 200
    assert (await call(server, "POST", f"/sessions/{sid}/step", "key-alice", b'{"action": "up"}'))[0] == 200
    assert (await call(server, "GET", "/health", "key-bob", b""))[0] == 200
    assert (await call(server, "DELETE", f"/sessions/{sid}", "key-alice", b""))[0] == 200
    assert server.sessions == {}


async def test_a_session_answers_only_the_key_that_created_it(server: EnvServer) -> None:
    sid = (await call(server, "POST", "/sessions", "key-alice"))[1]["session"]
    for method, path, body in (
        ("POST", f"/sessions/{sid}/reset", b'{"seed": 1}'),
        ("POST", f"/sessions/{sid}/step", b'{"action": "up"}'),
        ("DELETE", f"/sessions/{sid}", b""),
    ):
        status, data, _ = await call(server, method, path, "key-bob", body)
        assert status == 403 and "another API key" in data["error"], (method, path, status, data)
    assert set(server.sessions) == {sid}  # bob's DELETE closed nothing
    status, data, _ = await call(server, "POST", f"/sessions/{sid}/reset", "key-alice", b'{"seed": 1}')
    assert status == 200 and data["observation"]
    assert (await call(server, "DELETE", f"/sessions/{sid}", "key-alice", b""))[0] == 200


async def test_remote_env_sends_its_key(server: EnvServer, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(EnvError, match=r"\(401\).*missing API key"):
        await RemoteEnv.connect(server.url)
    with pytest.raises(EnvError, match=r"\(401\).*invalid API key"):
        await RemoteEnv.connect(server.url, api_key="key-mallory")
    env = await RemoteEnv.connect(server.url, api_key="key-alice")
    local = SokobanEnv()
    assert await env.reset(5) == await local.reset(5)
    step = await env.step("left")
    assert step.observation == (await local.step("left")).observation
    monkeypatch.setenv(API_KEY_ENV, "key-bob")  # the variable, when the config names no key
    from_env = await RemoteEnv.connect(server.url)
    from_env.session_id, stolen = env.session_id, from_env.session_id  # bob tries alice's session
    with pytest.raises(EnvError, match=r"\(403\)"):
        await from_env.step("left")
    from_env.session_id = stolen
    await from_env.close()
    await env.close()
    assert server.sessions == {}


async def test_keys_from_the_environment_and_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(API_KEY_ENV, " key-x , key-y ")
    async with EnvServer(SokobanEnv) as s:
        assert (await call(s, "GET", "/health", None, b""))[0] == 401
        assert (await call(s, "GET", "/health", "key-y", b""))[0] == 200
    async with EnvServer(SokobanEnv, api_key="") as s:  # explicitly none: open (on loopback)
        assert (await call(s, "GET", "/health", None, b""))[0] == 200


async def test_warns_when_bound_beyond_loopback_without_a_key(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    # 192.0.2.1 is TEST-NET, not on this machine: the warning comes, then the bind fails
    with caplog.at_level(logging.WARNING, logger="rollart_env.remote"):
        with pytest.raises(OSError):
            await EnvServer(SokobanEnv, host="192.0.2.1").start()
        assert any("without an API key" in r.getMessage() for r in caplog.records)
        caplog.clear()
        with pytest.raises(OSError):
            await EnvServer(SokobanEnv, host="192.0.2.1", api_key="k").start()
        async with EnvServer(SokobanEnv, host="127.0.0.1"):
            pass
        assert not [r for r in caplog.records if "without an API key" in r.getMessage()]


async def test_serve_command_takes_the_key_from_the_environment() -> None:
    import aiohttp

    env = {**os.environ, API_KEY_ENV: "key-cli"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "rollart_env.cli",
        "serve",
        "--env",
        "frozenlake",
        "--options",
        '{"size": 4}',
        env=env,
        stdout=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
        assert line.startswith("serving frozenlake on http://127.0.0.1:"), line
        url = line.split(" on ", 1)[1].strip()
        async with aiohttp.ClientSession() as http:
            async with http.get(url + "/health") as resp:
                assert resp.status == 401
        remote = await RemoteEnv.connect(url, api_key="key-cli")
        obs, _ = await remote.reset(3)
        assert obs and remote.action_vocabulary
        await remote.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0


def test_serve_command_refuses_bad_options() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "rollart_env.cli", "serve", "--env", "frozenlake", "--options", '{"nope": 1}'],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "error:" in proc.stderr and "nope" in proc.stderr, proc.stderr


async def test_one_key_cannot_fill_the_table_for_all(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    async with EnvServer(SokobanEnv, api_key=",".join(KEYS), max_sessions=4, max_sessions_per_key=2) as s:
        alice = [(await call(s, "POST", "/sessions", "key-alice"))[1]["session"] for _ in range(2)]
        status, data, headers = await call(s, "POST", "/sessions", "key-alice")
        assert status == 429 and "max_sessions_per_key=2" in data["error"] and headers["Retry-After"]
        for _ in range(2):  # bob still gets his share
            assert (await call(s, "POST", "/sessions", "key-bob"))[0] == 200
        assert (await call(s, "DELETE", f"/sessions/{alice[0]}", "key-alice", b""))[0] == 200
        assert (await call(s, "POST", "/sessions", "key-alice"))[0] == 200
    with pytest.raises(ValueError, match="max_sessions_per_key"):
        EnvServer(SokobanEnv, max_sessions_per_key=0)


async def test_seed_is_bounded_to_int64(server: EnvServer) -> None:
    sid = (await call(server, "POST", "/sessions", "key-alice"))[1]["session"]
    for seed in (2**63, -(2**63) - 1, 10**30):
        body = f'{{"seed": {seed}}}'.encode()
        status, data, _ = await call(server, "POST", f"/sessions/{sid}/reset", "key-alice", body)
        assert status == 422 and "64-bit" in data["error"], (seed, status, data)
    for seed in (2**63 - 1, -(2**63)):
        body = f'{{"seed": {seed}}}'.encode()
        assert (await call(server, "POST", f"/sessions/{sid}/reset", "key-alice", body))[0] == 200


async def test_a_declared_but_unsent_body_gets_408_not_a_hung_handler(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    async with EnvServer(SokobanEnv, api_key="", body_timeout_s=0.3) as s:
        sid = (await call(s, "POST", "/sessions", None))[1]["session"]
        reader, writer = await asyncio.open_connection("127.0.0.1", s.port)
        writer.write(
            f"POST /sessions/{sid}/reset HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            "Content-Length: 100\r\n\r\n{".encode()
        )
        await writer.drain()
        head = await asyncio.wait_for(reader.readline(), timeout=10)
        assert b" 408 " in head, head
        writer.close()
        await writer.wait_closed()
        assert s._sessions[sid].busy == 0  # the session may expire again
        assert (await call(s, "POST", f"/sessions/{sid}/reset", None, b'{"seed": 1}'))[0] == 200
