"""The OpenAI-compatible server is closed by default: real servers on 127.0.0.1 over one real in-process
vLLM (CPU) engine. API keys on every endpoint, the admin token on ``/admin/*`` (and admin refused
without one unless enabled on loopback), sessions owned by the key that made them, the body limit
(413), every malformed body a 4xx with a message, a full queue 429, the WARNING for a bind beyond
loopback without a key."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollart_core.errors import ConfigError
from rollart_proxy import LLMProxy, WorkerHandle

pytestmark = [pytest.mark.vllm, pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]

NO_EOS = list(range(10, 300))
CHAT = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 2,
    "allowed_token_ids": NO_EOS,
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rollart_train.tiny import create_tiny_model

    return create_tiny_model(tmp_path_factory.mktemp("server-guard") / "tiny", dtype="float32")


@pytest.fixture(scope="module")
async def engine(model_dir: Path) -> AsyncIterator[Any]:
    from rollart_proxy.engines.vllm_engine import VllmEngine, VllmEngineConfig

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    e = VllmEngine(
        VllmEngineConfig(max_model_len=512, dtype="float32", max_num_seqs=8),
        model_path=str(model_dir),
        name="e",
    )
    try:
        await e.start()
        yield e
    finally:
        await e.shutdown()


class Served:
    def __init__(self, server: Any, port: int) -> None:
        self.server, self.base = server, f"http://127.0.0.1:{port}"

    def client(self, key: str | None = None) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.AsyncClient(base_url=self.base, headers=headers, trust_env=False, timeout=120)


@pytest.fixture
async def serve(model_dir: Path) -> AsyncIterator[Any]:
    from rollart_proxy.server import OpenAIServer

    started: list[Any] = []

    async def make(proxy: LLMProxy, **kw: Any) -> Served:
        s = OpenAIServer(proxy, str(model_dir), served_model_name="tiny", max_model_len=512, **kw)
        port = await s.start("127.0.0.1", 0)
        started.append(s)
        return Served(s, port)

    try:
        yield make
    finally:
        for s in started:
            await s.stop()


@pytest.fixture
def no_key_env() -> Iterator[None]:
    saved = {
        k: os.environ.pop(k) for k in ("ROLLART_PROXY_API_KEY", "ROLLART_PROXY_ADMIN_KEY") if k in os.environ
    }
    try:
        yield
    finally:  # a test may have set a key: it must not reach later tests' servers
        for k in ("ROLLART_PROXY_API_KEY", "ROLLART_PROXY_ADMIN_KEY"):
            os.environ.pop(k, None)
        os.environ.update(saved)


async def test_keys_admin_token_and_session_ownership(engine: Any, serve: Any, no_key_env: None) -> None:
    srv = await serve(LLMProxy({"e": engine}), api_key=["k1", "k2"], admin_key="adm")
    async with (
        srv.client() as anon,
        srv.client("k1") as c1,
        srv.client("k2") as c2,
        srv.client("adm") as admin,
        srv.client("wrong") as bad,
    ):
        r = await anon.get("/health")
        assert (
            r.status_code == 401
            and r.headers["www-authenticate"] == "Bearer"
            and r.json()["error"]["message"]
        )
        assert (await bad.get("/v1/models")).status_code == 401
        assert (await c1.get("/health")).status_code == 200 and (
            await admin.get("/metrics")
        ).status_code == 200
        # admin endpoints: the admin token only
        assert (await anon.post("/admin/suspend")).status_code == 401
        r = await c1.post("/admin/suspend")
        assert r.status_code == 403 and "admin token" in r.json()["error"]["message"]
        assert (await admin.post("/admin/suspend")).json() == {"suspended": True}
        assert (await admin.post("/admin/resume")).json() == {"suspended": False}
        # a session belongs to the key that created it
        r = await c1.post("/v1/chat/completions", json=CHAT, headers={"X-Session-Id": "s1"})
        assert r.status_code == 200, r.text
        for call in (
            c2.get("/v1/sessions/s1"),
            c2.post("/v1/sessions/s1/drain"),
            c2.post("/v1/sessions/s1/abort"),
            c2.delete("/v1/sessions/s1"),
            c2.post("/v1/chat/completions", json=CHAT, headers={"X-Session-Id": "s1"}),
        ):
            r = await call
            assert r.status_code == 403 and "another API key" in r.json()["error"]["message"], r.text
        assert len((await c1.get("/v1/sessions/s1")).json()["calls"]) == 1
        assert len((await admin.get("/v1/sessions/s1")).json()["calls"]) == 1  # the admin sees every session
        assert (await c1.delete("/v1/sessions/s1")).json()["calls"] == 1
        assert (await c2.get("/v1/sessions/s1")).json()["calls"] == []  # ended: the id is free again
        assert srv.server.recorder.sizes() == {"recorded_sessions": 0, "owned_sessions": 0}


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


async def test_admin_without_admin_key(engine: Any, serve: Any, no_key_env: None, model_dir: Path) -> None:
    from rollart_proxy.server import OpenAIServer

    closed = await serve(LLMProxy({"e": engine}))
    async with closed.client() as h:
        r = await h.post("/admin/suspend")
        assert r.status_code == 403 and "--enable-admin" in r.json()["error"]["message"]
        assert (await h.get("/admin/weight_versions")).status_code == 403
    opened = await serve(LLMProxy({"e": engine}), enable_admin=True)  # on loopback: allowed
    async with opened.client() as h:
        assert (await h.get("/admin/weight_versions")).json() == {"e": 0}
    with pytest.raises(ConfigError, match="only served on loopback"):
        await OpenAIServer(LLMProxy({"e": engine}), str(model_dir), enable_admin=True).start("192.0.2.1", 0)
    # beyond loopback without a key: a WARNING (192.0.2.1 is TEST-NET, not on this machine: the bind fails)
    seen = _Records()
    logging.getLogger("rollart_proxy.server").addHandler(seen)
    try:
        with pytest.raises(OSError):
            await OpenAIServer(LLMProxy({"e": engine}), str(model_dir)).start("192.0.2.1", 0)
    finally:
        logging.getLogger("rollart_proxy.server").removeHandler(seen)
    assert any("beyond loopback" in m for m in seen.messages), seen.messages
    os.environ["ROLLART_PROXY_API_KEY"] = "from-env"  # restored by no_key_env
    from_env = await serve(LLMProxy({"e": engine}))
    async with from_env.client() as anon, from_env.client("from-env") as keyed:
        assert (await anon.get("/health")).status_code == 401 and (
            await keyed.get("/health")
        ).status_code == 200


async def test_bodies_limits_and_full_queue(engine: Any, serve: Any, no_key_env: None) -> None:
    proxy = LLMProxy([WorkerHandle("e", engine, max_inflight=1, max_queued=0)])
    srv = await serve(proxy, max_body_bytes=16 << 10)
    async with srv.client() as h:
        r = await h.post("/v1/completions", json={"model": "tiny", "prompt": "x" * (32 << 10)})
        assert r.status_code == 413 and r.json()["error"]["message"]

        async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: the limit counts what arrives
            for _ in range(40):
                yield b" " * 1024

        r = await h.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413
        malformed: list[tuple[str, Any]] = [
            ("/v1/completions", b"{not json"),
            ("/v1/completions", b"[]"),
            ("/v1/completions", b'"text"'),
            ("/v1/completions", b"\xff\xfe"),
            ("/v1/completions", b""),
            ("/v1/completions", {"model": "tiny"}),
            ("/v1/completions", {"model": 3, "prompt": "x"}),
            ("/v1/completions", {"model": "tiny", "prompt": [-5, 3]}),
            ("/v1/completions", {"model": "tiny", "prompt": [[1, 2]]}),
            ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": "many"}),
            ("/v1/completions", {"model": "tiny", "prompt": "x", "stop": [""]}),
            ("/v1/chat/completions", {"model": "tiny", "messages": "hi"}),
            ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}),
            (
                "/v1/chat/completions",
                {
                    "model": "tiny",
                    "messages": [
                        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
                    ],
                },
            ),
            ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user"}], "max_tokens": -1}),
        ]
        for path, body in malformed:
            kw: dict[str, Any] = (
                {"content": body, "headers": {"content-type": "application/json"}}
                if isinstance(body, bytes)
                else {"json": body}
            )
            r = await h.post(path, **kw)
            assert 400 <= r.status_code < 500 and r.json()["error"]["message"], (body, r.status_code, r.text)
        # a full queue: one request in flight (max_inflight=1), no room to wait → 429 at once
        long = asyncio.create_task(
            h.post(
                "/v1/completions",
                json={"model": "tiny", "prompt": [1, 20, 30], "max_tokens": 400, "allowed_token_ids": NO_EOS},
            )
        )
        deadline = time.monotonic() + 60
        while proxy.workers["e"].inflight < 1:
            assert time.monotonic() < deadline and not long.done(), "the long request never started"
            await asyncio.sleep(0.01)
        r = await h.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2], "max_tokens": 1})
        assert r.status_code == 429 and "queue is full" in r.json()["error"]["message"]
        assert (await long).status_code == 200
    admin = await serve(LLMProxy({"e": engine}), admin_key="adm")
    async with admin.client("adm") as h:
        r = await h.post("/admin/update_weights", json={"version": -1})
        assert r.status_code == 400 and r.json()["error"]["message"]
        r = await h.post(
            "/admin/update_weights", content=b"nope", headers={"content-type": "application/json"}
        )
        assert r.status_code == 400


async def test_n_samples_are_one_group(engine: Any, serve: Any, no_key_env: None) -> None:
    """``n=4`` on the real engine: 4 choices recorded as 4 sibling sessions of one group, holding
    exactly the engine's tokens, that the trainer's GRPO advantage treats as one group."""
    from rollart_proxy.server import group_trajectories
    from rollart_train.losses import batch_advantages

    srv = await serve(LLMProxy({"e": engine}), max_n=4)
    async with srv.client() as h:
        body = {**CHAT, "max_tokens": 4, "temperature": 1.0, "seed": 3}
        r = await h.post("/v1/chat/completions", json={**body, "n": 4})
        assert r.status_code == 200, r.text
        reply = r.json()
        group_id = reply["rollart"]["group_id"]
        assert len(reply["choices"]) == 4 and [c["index"] for c in reply["choices"]] == [0, 1, 2, 3]
        r = await h.post("/v1/chat/completions", json={**body, "n": 5})
        assert r.status_code == 400 and "maximum of 4" in r.json()["error"]["message"]
        r = await h.post("/v1/chat/completions", json={**body, "n": 2}, headers={"X-Session-Id": "s"})
        assert r.status_code == 400 and "one turn of one trajectory" in r.json()["error"]["message"]
        members = (await h.post(f"/v1/groups/{group_id}/drain")).json()["members"]
    assert [m["session_id"] for m in members] == reply["rollart"]["sessions"]
    calls = [m["calls"] for m in members]
    assert all(len(c) == 1 and c[0]["group_id"] == group_id for c in calls)
    assert [c[0]["output_ids"] for c in calls] == [c["token_ids"] for c in reply["rollart"]["choices"]]
    assert all(len(c[0]["output_ids"]) == 4 == len(c[0]["logprobs"]) == len(c[0]["versions"]) for c in calls)

    class Decode:
        def decode(self, ids: Any) -> str:
            return str(srv.server.template.decode(list(ids)))

    trajs = group_trajectories(members, group_id, Decode(), rewards=[1.0, 0.0, 0.0, 0.0])  # type: ignore[arg-type]
    assert {t.group_id for t in trajs} == {group_id}
    adv = batch_advantages(trajs, "grpo", gamma=1.0, step_weight=1.0, scale_by_std=True)
    assert adv[0] > 0 > adv[1] and sum(adv) == pytest.approx(0.0, abs=1e-6)
