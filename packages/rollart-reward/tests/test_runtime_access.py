"""The function runtime's access rules over a real socket (aiohttp on 127.0.0.1, in process): admin
endpoints take their own key, never the invoke key; one Bearer parsing; a declared-but-unsent body
gets 408; out-of-range numbers in a trajectory get 400."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from rollart_core.errors import ConfigError
from rollart_core.types import Trajectory
from rollart_reward.runtime import FunctionRuntime, RuntimeConfig
from rollart_reward.wire import trajectory_to_dict


def _config(**kw: Any) -> RuntimeConfig:
    return RuntimeConfig(function="synthetic", options={"work_s": 0.0}, max_workers=1, **kw)


@pytest.fixture
async def keyed() -> AsyncIterator[str]:
    rt = FunctionRuntime(_config(api_key="invoke-key", admin_key="admin-key", body_timeout_s=0.3))
    url = await rt.start()
    try:
        yield url
    finally:
        await rt.stop()


def _body(seed: int = 0) -> dict[str, Any]:
    traj = Trajectory("t", "task", "e", "g", seed=seed, start_version=0, info={"score": 1.0})
    return {"key": f"k{seed}", "trajectory": trajectory_to_dict(traj)}


async def test_admin_endpoints_take_the_admin_key_only(keyed: str) -> None:
    async with httpx.AsyncClient(base_url=keyed, timeout=30) as http:
        for auth, status in ((None, 401), ("Bearer invoke-key", 403), ("Bearer wrong", 403)):
            headers = {"Authorization": auth} if auth else {}
            r = await http.post("/admin/reset", headers=headers)
            assert r.status_code == status and "admin key" in r.json()["error"], (auth, r.text)
        r = await http.post("/admin/reset", headers={"Authorization": "Bearer admin-key"})
        assert r.status_code == 200
        # the admin key is not an invoke key either
        r = await http.post("/invoke", json=_body(), headers={"Authorization": "Bearer admin-key"})
        assert r.status_code == 401
        # one Bearer parsing (rollart_core.serving.bearer_token): the scheme is case-insensitive
        r = await http.post("/invoke", json=_body(), headers={"Authorization": "bearer  invoke-key"})
        assert r.status_code == 200, r.text


async def test_admin_without_an_admin_key_is_refused_where_it_would_be_open() -> None:
    with pytest.raises(ConfigError, match="admin key"):
        await FunctionRuntime(_config(admin=True, api_key="invoke-key")).start()
    with pytest.raises(ConfigError, match="admin key"):
        await FunctionRuntime(_config(admin=True, host="0.0.0.0")).start()
    with pytest.raises(ValidationError, match="admin_key must differ"):
        _config(api_key="same", admin_key="same")
    rt = FunctionRuntime(_config(api_key="invoke-key"))  # no admin: /admin/* do not exist
    url = await rt.start()
    try:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            r = await http.post("/admin/reset", headers={"Authorization": "Bearer invoke-key"})
            assert r.status_code == 404
    finally:
        await rt.stop()


async def test_a_declared_but_unsent_body_gets_408(keyed: str) -> None:
    port = int(keyed.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /invoke HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer invoke-key\r\n"
        b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"
    )
    await writer.drain()
    head = await asyncio.wait_for(reader.readline(), timeout=10)
    assert b" 408 " in head, head
    writer.close()
    await writer.wait_closed()


async def test_numbers_beyond_64_bits_are_400(keyed: str) -> None:
    async with httpx.AsyncClient(base_url=keyed, timeout=30) as http:
        headers = {"Authorization": "Bearer invoke-key"}
        body = _body()
        body["trajectory"]["seed"] = 2**64
        r = await http.post("/invoke", json=body, headers=headers)
        assert r.status_code == 400 and "beyond 64 bits" in r.json()["error"], r.text
        body = _body()
        body["trajectory"]["turns"] = [{"context_ids": [1, 10**40], "output_ids": []}]
        r = await http.post("/invoke", json=body, headers=headers)
        assert r.status_code == 400 and "context_ids" in r.json()["error"], r.text


def test_serve_with_admin_and_an_api_key_asks_for_an_admin_key() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "rollart_reward.cli", "serve", "--function", "synthetic", "--admin"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"ROLLART_REWARD_API_KEY": "k", "PATH": ""},
    )
    assert r.returncode == 2 and "admin key" in r.stderr, r.stderr
