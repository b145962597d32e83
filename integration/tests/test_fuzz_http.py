"""Fuzzing the HTTP surfaces, bounded in examples and time: no generated request gets a 5xx, none crashes
the server, and the server still answers a valid request afterwards.

- The proxy's OpenAI server (``rollart_proxy.server.OpenAIServer``, FastAPI): schemathesis generates
  requests from its own OpenAPI schema (``app.openapi()``; the server does not publish
  ``/openapi.json``) for every operation, sent over real HTTP to a real uvicorn server on 127.0.0.1 with a
  real ``LLMProxy`` and the tiny model's real tokenizer and chat template. The engine behind the proxy is
  ``SchemaFuzzEngine``, a fake named as such: this test is about request validation and the server's
  error paths, and a real vLLM engine here costs minutes of start-up on a shared machine. The real
  engine behind the same server is exercised in ``integration/tests/test_proxy_http.py`` and
  ``packages/rollart-proxy/tests/test_server_guard.py``.
- The reward runtime (``rollart_reward.runtime.FunctionRuntime``, what ``rollart-reward serve`` runs):
  hypothesis sends generated bodies to ``/invoke``, the Lambda- and FC-style paths and the polling path
  of a real runtime with real worker processes.

(The env server and the config loader have their own fuzz tests: ``packages/rollart-env/tests/
test_env_server_fuzz.py``, ``packages/rollart-core/tests/test_config_fuzz.py``.)
"""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollart_core.types import GenerateOutput, GenerateRequest

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


class LoopThread:
    """An event loop in a thread: servers live there, the synchronous fuzzers call them over sockets."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout: float = 120) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def request(
    port: int, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        raw = resp.read()
        try:
            return resp.status, json.loads(raw)
        except ValueError:
            return resp.status, raw
    finally:
        conn.close()


# ---------------------------------------------------------------------------------------------- proxy


class SchemaFuzzEngine:
    """FAKE engine for schema fuzzing (named as such): answers every request at once with up to
    ``max_tokens`` (at most 8) tokens drawn from the allowed ids (or the request's own prompt ids), so the
    server's whole request path — validation, templating, tool parsing, sessions, the response — runs
    without a real model. Not a stand-in for vLLM's behaviour."""

    def __init__(self, name: str = "schema-fuzz") -> None:
        self.name, self.version, self.calls = name, 0, 0

    async def start(self) -> str:
        return self.name

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        self.calls += 1
        sp = request.sampling
        pool = list(sp.allowed_token_ids or []) or list(request.prompt_ids[-8:]) or [1]
        n = max(0, min(sp.max_tokens, 8))
        ids = [pool[i % len(pool)] for i in range(n)]
        return GenerateOutput(request.request_id, ids, [-0.5] * n, [self.version] * n, "length", self.name)

    async def abort(self, request_id: str) -> None:
        return None

    async def weight_version(self) -> int:
        return self.version

    async def update_weights(self, version: int) -> float:
        self.version = version
        return 0.0

    async def pause(self, mode: str = "keep") -> None:
        return None

    async def resume(self) -> None:
        return None


@pytest.fixture(scope="module")
def proxy_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, int]]:
    from rollart_proxy import LLMProxy
    from rollart_proxy.server import OpenAIServer
    from rollart_train.tiny import create_tiny_model

    model = create_tiny_model(tmp_path_factory.mktemp("fuzz-proxy") / "tiny", dtype="float32")
    lt = LoopThread()

    async def make() -> tuple[Any, int]:
        server = OpenAIServer(
            LLMProxy({"e": SchemaFuzzEngine()}),
            str(model),
            served_model_name="tiny",
            max_model_len=512,
            api_key="",
            admin_key="",
            enable_admin=True,
            max_body_bytes=64 << 10,
        )
        return server, await server.start("127.0.0.1", 0)

    server, port = lt.run(make())
    try:
        yield server, port
    finally:
        lt.run(server.stop())
        lt.close()


CHAT_OK = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_proxy_openapi_schema_fuzz_gets_no_5xx(proxy_server: tuple[Any, int]) -> None:
    import requests
    import schemathesis
    from schemathesis.checks import not_a_server_error

    server, port = proxy_server
    schema = schemathesis.openapi.from_dict(server.app.openapi())
    base = f"http://127.0.0.1:{port}"
    session = requests.Session()
    session.trust_env = False  # loopback only, never through a proxy from the environment
    operations = [op.ok() for op in schema.get_all_operations()]
    assert len(operations) >= 10, [op.label for op in operations]
    seen: dict[str, list[int]] = {}
    t0 = time.monotonic()

    for op in operations:

        @settings(
            max_examples=12,
            deadline=5000,
            database=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=op.as_strategy())
        def fuzz(case: Any) -> None:
            response = case.call(base_url=base, session=session, timeout=30)
            seen.setdefault(case.operation.label, []).append(response.status_code)
            case.validate_response(response, checks=[not_a_server_error])

        fuzz()
        assert time.monotonic() - t0 < 120, "schema fuzzing ran past its time budget"

    assert all(seen.values()), seen
    # the server still answers, and serves a valid request
    assert request(port, "GET", "/health")[0] == 200
    status, data = request(port, "POST", "/v1/chat/completions", json.dumps(CHAT_OK).encode())
    assert status == 200 and data["choices"][0]["message"]["role"] == "assistant", data


@settings(max_examples=120, deadline=5000, database=None, suppress_health_check=list(HealthCheck))
@given(
    path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/admin/update_weights"]),
    body=st.binary(max_size=200)
    | st.integers(1, 400).map(lambda n: ("[" * n + "]" * n).encode())
    | st.recursive(
        st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=20),
        lambda s: (
            st.lists(s, max_size=4)
            | st.dictionaries(
                st.sampled_from(
                    [
                        "model",
                        "messages",
                        "prompt",
                        "max_tokens",
                        "n",
                        "stop",
                        "tools",
                        "role",
                        "content",
                        "logprobs",
                        "temperature",
                        "version",
                        "x",
                    ]
                ),
                s,
                max_size=5,
            )
        ),
        max_leaves=15,
    ).map(lambda v: json.dumps(v).encode()),
)
def test_proxy_raw_bodies_get_4xx_not_5xx(proxy_server: tuple[Any, int], path: str, body: bytes) -> None:
    _, port = proxy_server
    status, data = request(port, "POST", path, body)
    assert status < 500, (path, body[:200], status, data)


# -------------------------------------------------------------------------------------- reward runtime


@pytest.fixture(scope="module")
def reward_runtime() -> Iterator[tuple[Any, int]]:
    from rollart_reward.runtime import FunctionRuntime, RuntimeConfig

    lt = LoopThread()
    rt = FunctionRuntime(
        RuntimeConfig(
            function="success",
            min_workers=1,
            max_workers=1,
            idle_timeout_s=30,
            max_body_bytes=64 << 10,
            max_batch=16,
            max_async_tasks=64,
        )
    )
    lt.run(rt.start())
    try:
        yield rt, int(rt.url.rsplit(":", 1)[1])
    finally:
        lt.run(rt.stop())
        lt.close()


scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=20)
json_any = st.recursive(
    scalars,
    lambda s: st.lists(s, max_size=4) | st.dictionaries(st.text(max_size=8), s, max_size=4),
    max_leaves=12,
)
turn = st.fixed_dictionaries(
    {},
    optional={
        "context_ids": st.lists(st.integers(0, 600), max_size=5) | json_any,
        "output_ids": st.lists(st.integers(0, 600), max_size=5) | json_any,
        "output_logprobs": st.lists(st.floats(-5, 0), max_size=5),
        "output_versions": st.lists(st.integers(0, 3), max_size=5),
        "finish_reason": st.sampled_from(["length", "stop"]) | json_any,
        "action_text": st.text(max_size=20),
        "env_reward": st.floats() | json_any,
        "new_sequence": st.booleans(),
    },
)
trajectory = st.fixed_dictionaries(
    {},
    optional={
        "traj_id": st.text(max_size=20) | json_any,
        "task": st.text(max_size=10),
        "env_id": st.text(max_size=10),
        "group_id": st.text(max_size=10),
        "seed": st.integers(-(2**70), 2**70) | json_any,
        "start_version": st.integers(-3, 3),
        "reward": st.floats(),
        "terminated": st.booleans() | json_any,
        "truncated": st.booleans(),
        "fate": st.sampled_from(["finished", "env_failed", "nope", None]),
        "info": st.dictionaries(st.sampled_from(["success", "x"]), scalars, max_size=2) | json_any,
        "turns": st.lists(turn, max_size=3) | json_any,
        "extra": json_any,
    },
)
call = st.fixed_dictionaries({"trajectory": trajectory}, optional={"key": st.text(max_size=30) | json_any})
reward_bodies = st.one_of(
    call.map(lambda v: json.dumps(v).encode()),
    st.lists(call, max_size=20).map(lambda items: json.dumps({"items": items}).encode()),
    json_any.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=200),
    st.integers(1, 400).map(lambda n: ("[" * n + "]" * n).encode()),
)
reward_paths = st.sampled_from(
    [
        ("POST", "/invoke", {}),
        ("POST", "/2015-03-31/functions/success/invocations", {}),
        ("POST", "/2015-03-31/functions/success/invocations", {"X-Amz-Invocation-Type": "Event"}),
        ("POST", "/2023-03-30/functions/success/invocations", {"x-fc-invocation-type": "Sync"}),
        (
            "POST",
            "/2023-03-30/functions/success/invocations",
            {"x-fc-invocation-type": "Async", "x-fc-async-task-id": "fuzz-task"},
        ),
        ("GET", "/2023-03-30/functions/success/async-tasks/fuzz-task", {}),
        ("GET", "/executions/some-key", {}),
        ("GET", "/stats", {}),
    ]
)


@settings(max_examples=200, deadline=10_000, database=None, suppress_health_check=list(HealthCheck))
@given(route=reward_paths, body=reward_bodies, key_header=st.none() | st.text(max_size=300))
def test_reward_runtime_generated_bodies_get_no_5xx(
    reward_runtime: tuple[Any, int], route: tuple[Any, ...], body: bytes, key_header: str | None
) -> None:
    _, port = reward_runtime
    method, path, headers = route
    headers = dict(headers)
    if key_header is not None and key_header.isascii() and key_header.isprintable():
        headers["Idempotency-Key"] = key_header
    status, data = request(port, method, path, body if method == "POST" else None, headers)
    # 5xx is reserved for the function's own failure (none here: ``success`` never raises) and the platform
    assert status < 500, (method, path, headers, body[:300], status, data)


def test_reward_runtime_still_scores_after_fuzzing(reward_runtime: tuple[Any, int]) -> None:
    rt, port = reward_runtime
    traj = {
        "traj_id": "ok",
        "task": "t",
        "env_id": "e",
        "group_id": "g",
        "seed": 0,
        "start_version": 0,
        "terminated": True,
        "info": {"success": True},
    }
    status, data = request(
        port, "POST", "/invoke", json.dumps({"key": "after-fuzz", "trajectory": traj}).encode()
    )
    assert status == 200 and data["result"]["score"] == 1.0, data
    assert rt.stats()["workers"] <= 1


def test_fuzz_fixtures_stay_on_loopback(
    proxy_server: tuple[Any, int], reward_runtime: tuple[Any, int]
) -> None:
    assert reward_runtime[0].url.startswith("http://127.0.0.1:")
    assert Path("/proc/self").exists()  # the servers live in this process: nothing to end by PID
