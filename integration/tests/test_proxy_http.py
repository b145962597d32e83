"""The proxy in front of real vLLM OpenAI servers (CPU build) started by this module:
``VllmServerEngine`` (token-in generation, suspend → weight update → resume with per-token
versions, abort, bad requests), the stand-alone service exactly as the package README shows it,
and a server killed mid-request (its requests are retried on the other server).

Two servers live for the whole module (at most two engines at a time on this machine).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollart_core.errors import EngineError
from rollart_core.serving import free_port
from rollart_core.types import GenerateRequest, SamplingParams

# Two real vLLM OpenAI servers (~2 min to start on 2 cores) and a timing-sensitive suspend test:
# part of the slow set (`uv run --no-sync pytest -m slow`), not of the default CI run.
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "packages" / "rollart-proxy" / "README.md"
NO_EOS = tuple(range(10, 300))


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(url, timeout=2, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"{url} not healthy after {timeout} s:\n{log.read_text()[-4000:]}")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


class Server:
    def __init__(self, model: Path, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_SERVER_DEV_MODE": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                str(model),
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--dtype",
                "float32",
                "--max-model-len",
                "512",
                "--max-num-seqs",
                "16",
                "--enable-scale-out",
            ],
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rollart_train.tiny import create_tiny_model

    return create_tiny_model(tmp_path_factory.mktemp("proxy-http") / "tiny", dtype="float32")


@pytest.fixture(scope="module")
def servers(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server]]:
    logs = tmp_path_factory.mktemp("vllm-logs")
    a = Server(model_dir, logs / "a.log")
    b = Server(model_dir, logs / "b.log")
    try:
        for s in (a, b):
            wait_http(f"{s.url}/health", s.proc, 600, s.log)
        yield a, b
    finally:
        stop(a.proc)
        stop(b.proc)


async def until(cond: Any, timeout: float = 120.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(cond):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


def req(rid: str, n: int, **sampling: Any) -> GenerateRequest:
    sp = {"max_tokens": n, "seed": 0, "allowed_token_ids": NO_EOS, **sampling}
    return GenerateRequest(rid, [1, 20, 30, 40, 50], SamplingParams(**sp))


async def test_vllm_server_engine_suspend_update_resume_abort(
    servers: tuple[Server, Server], model_dir: Path, tmp_path: Path
) -> None:
    import torch
    from safetensors.torch import load_file

    from rollart_proxy.engines.vllm_server_engine import VllmServerEngine
    from rollart_weightsync import FilesystemWeightStore

    a, _ = servers
    store = FilesystemWeightStore(root=tmp_path / "weights")
    new = {
        k: v + 0.05 * torch.randn_like(v) for k, v in load_file(str(model_dir / "model.safetensors")).items()
    }
    store.push(1, new).result(timeout=120)
    eng = VllmServerEngine(
        VllmServerEngine.Config(
            url=a.url, weights_path_template=str(tmp_path / "weights" / "v{version:08d}")
        ),
        name="a",
    )
    await eng.start()
    try:
        assert eng.max_model_len == 512
        n = 480
        seen: dict[str, int] = {}

        async def consume(rid: str, n: int = n) -> list[Any]:  # streamed deltas show progress as it happens
            parts = []
            async for p in eng.generate_stream(req(rid, n, seed=len(seen))):
                parts.append(p)
                seen[rid] = seen.get(rid, 0) + (0 if p.finish_reason else len(p.token_ids))
            return parts

        tasks = [asyncio.create_task(consume(f"h{i}")) for i in range(2)]
        await until(lambda: len(seen) == 2 and min(seen.values()) >= 20, what="tokens before the update")
        await eng.pause("keep")
        paused = await eng.update_weights(1)
        await eng.resume()
        streams = await asyncio.gather(*tasks)
        assert paused > 0 and await eng.weight_version() == 1
        for parts in streams:
            o = parts[-1]
            assert len(parts) > 2 and all(not p.finish_reason for p in parts[:-1])
            assert o.finish_reason == "length" and len(o.token_ids) == n == len(o.logprobs) == len(o.versions)
            assert [t for p in parts[:-1] for t in p.token_ids] == o.token_ids[
                : sum(len(p.token_ids) for p in parts[:-1])
            ]
            # kept across the update, not aborted: old tokens v0, the rest v1
            assert o.versions == sorted(o.versions) and o.start_version == 0 and o.end_version == 1, (
                o.versions
            )
        info = httpx.get(f"{a.url}/weight_info", trust_env=False, timeout=10).json()
        assert info["weight_version"] == "1"
        # abort one request mid-generation
        # abort mid-generation, while suspended: the requests are frozen (pause keep), so the abort
        # certainly lands before they end; it is delivered on resume (vLLM would lose it if sent now)
        doomed = asyncio.create_task(consume("doomed", 450))
        await until(lambda: seen.get("doomed", 0) >= 5, what="the doomed request generating")
        await eng.pause("keep")
        await eng.abort("doomed")
        await eng.resume()
        out = (await asyncio.wait_for(doomed, 60))[-1]
        assert out.finish_reason == "abort" and 5 <= len(out.token_ids) < 450
        with pytest.raises(EngineError, match="out-of-vocab"):
            await eng.generate(req("bad", 4, allowed_token_ids=(10**6,)))
        with pytest.raises(EngineError, match="max_model_len"):
            await eng.generate(GenerateRequest("long", [5] * 600, SamplingParams()))
        stats = await eng.get_stats()
        assert stats["decode_tokens"] > 600 and stats["suspended_s"] > 0
    finally:
        await eng.shutdown()


def readme_blocks() -> tuple[str, str]:
    text = README.read_text()
    yaml_block = re.search(r"Describe them in `proxy.yaml`:\n\n```yaml\n(.*?)```", text, re.S)
    py_block = re.search(r"Run `rollart-proxy serve --config proxy.yaml`.*?```python\n(.*?)```", text, re.S)
    assert yaml_block and py_block, "README lost its stand-alone service example"
    return yaml_block.group(1), py_block.group(1)


ADMIN_KEY = "test-admin-key"


def start_service(config: Path, log: Path) -> subprocess.Popen[bytes]:
    exe = Path(sys.executable).parent / "rollart-proxy"
    env = {**os.environ, "ROLLART_PROXY_ADMIN_KEY": ADMIN_KEY}  # admin endpoints are closed without one
    return subprocess.Popen(
        [str(exe), "serve", "--config", str(config)],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env=env,
    )


def test_standalone_service_exactly_as_the_readme_shows(
    servers: tuple[Server, Server], model_dir: Path, tmp_path: Path
) -> None:
    a, _ = servers
    port = free_port()
    yaml_text, code = readme_blocks()
    subst = {
        "/models/tiny": str(model_dir),
        "http://127.0.0.1:8100": a.url,
        "port: 8000": f"port: {port}",
        "127.0.0.1:8000": f"127.0.0.1:{port}",
    }
    for k, v in subst.items():
        yaml_text, code = yaml_text.replace(k, v), code.replace(k, v)
    (tmp_path / "proxy.yaml").write_text(yaml_text)
    proc = start_service(tmp_path / "proxy.yaml", tmp_path / "proxy.log")
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc, 120, tmp_path / "proxy.log")
        r = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path
        )
        assert r.returncode == 0, r.stderr[-3000:]
        last = r.stdout.rstrip("\n").split("\n")[-1]  # output ids, logprobs, and versions (all 0)
        assert last.startswith("[") and re.search(r"\[0(, 0)*\]$", last), r.stdout
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", trust_env=False, timeout=60) as h:
            assert h.post("/admin/suspend").status_code == 401  # the admin token is required
            admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
            assert h.post("/admin/suspend", headers=admin).json() == {"suspended": True}
            assert h.post("/admin/resume", headers=admin).json() == {"suspended": False}
            m = h.get("/metrics").json()
            assert (
                m["gen-0"]["pool"] == "H800" and m["gen-0"]["requests"] >= 1 and m["gen-0"]["suspended_s"] > 0
            )
            r2 = h.post("/v1/chat/completions", json={"model": "tiny", "messages": "not a list"})
            assert r2.status_code == 400 and r2.json()["error"]["message"]
            r3 = h.post("/v1/completions", json={"model": "tiny", "prompt": [5] * 600})
            assert r3.status_code == 400 and "context" in r3.json()["error"]["message"]
            r4 = h.post(
                "/v1/chat/completions",
                headers={"X-Rollart-Task": "math"},
                json={"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
            )
            assert r4.status_code == 200
        bad = tmp_path / "bad.yaml"
        bad.write_text(yaml_text.replace("task_pools: {math: H800}", "task_pools: {math: H100}"))
        chk = subprocess.run(
            [str(Path(sys.executable).parent / "rollart-proxy"), "check-config", str(bad)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert chk.returncode == 2 and "pools without workers" in chk.stderr
    finally:
        stop(proc)
    assert proc.returncode == 0, (tmp_path / "proxy.log").read_text()[-3000:]


async def test_service_retries_requests_of_a_killed_server(
    servers: tuple[Server, Server], model_dir: Path, tmp_path: Path
) -> None:
    """Runs last in this module: it kills server b."""
    a, b = servers
    port = free_port()
    (tmp_path / "proxy.yaml").write_text(
        f"model: {model_dir}\nserved_model_name: tiny\nport: {port}\nmax_retries: 1\nworkers:\n"
        f'  - {{name: a, url: "{a.url}", max_inflight: 2}}\n  - {{name: b, url: "{b.url}", max_inflight: 2}}\n'
    )
    proc = start_service(tmp_path / "proxy.yaml", tmp_path / "proxy.log")
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc, 120, tmp_path / "proxy.log")
        body = {"model": "tiny", "prompt": [1, 20, 30], "max_tokens": 480, "allowed_token_ids": list(NO_EOS)}
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", trust_env=False, timeout=300) as h:
            tasks = [asyncio.create_task(h.post("/v1/completions", json=body)) for _ in range(4)]

            def b_busy() -> bool:  # the proxy has two requests in flight on b
                return (
                    httpx.get(f"http://127.0.0.1:{port}/metrics", trust_env=False, timeout=10).json()["b"][
                        "inflight"
                    ]
                    == 2
                )

            await until(b_busy, what="requests in flight on server b")
            os.killpg(b.proc.pid, signal.SIGKILL)  # the whole server process group dies at once
            b.proc.wait(30)
            rs = await asyncio.gather(*tasks)
            assert [r.status_code for r in rs] == [200] * 4, [r.text for r in rs]
            workers = [r.json()["rollart"]["worker"] for r in rs]
            assert all(len(r.json()["rollart"]["token_ids"]) == 480 for r in rs)
            assert set(workers) == {"a"}, workers  # b's requests were retried on a
            m = (await h.get("/metrics")).json()
            assert m["b"]["healthy"] is False and m["b"]["failures"] >= 1
            again = await h.post("/v1/completions", json={**body, "max_tokens": 3})
            assert again.status_code == 200 and again.json()["rollart"]["worker"] == "a"
    finally:
        stop(proc)
