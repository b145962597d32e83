"""The elastic rollout pool's refusals and the run's admin endpoint (a real HTTP server on 127.0.0.1,
real urllib client and CLI). The pipeline around them is a stand-in holding a real config: adding
and removing real engines mid-run is ``integration/tests/test_elastic.py``."""

from __future__ import annotations

import asyncio
import json
import stat
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from rollart_core.cli import main
from rollart_core.config import RunConfig
from rollart_core.control.admin import ADMIN_FILE, AdminServer, admin_call
from rollart_core.control.elastic import ElasticEngines, ElasticError
from rollart_core.errors import ConfigError
from rollart_core.resources import ClusterView


def config(root: Path, pool: str | None = None) -> RunConfig:
    return RunConfig.model_validate(
        {
            "output_dir": str(root / "run"),
            "model": {"path": str(root / "model")},
            "engines": [{"name": "gen", "impl": "vllm", "count": 1, "pool": pool}],
            "tasks": [{"name": "t", "env": {"impl": "frozenlake"}, "reward": {"impl": "success"}}],
        }
    )


class ElasticProxy:
    """Has the proxy capability; the refusals under test come before any engine is reached."""

    async def add_actor_worker(self, name: str, actor: Any, pool: str) -> int:
        raise AssertionError("not reached")

    async def remove_worker(self, name: str, drain_timeout_s: float = 60.0) -> dict[str, int]:
        raise AssertionError("not reached")

    async def metrics(self, engine_stats: bool = True) -> dict[str, dict[str, Any]]:
        return {}


def cluster_without_h20() -> ClusterView:
    return ClusterView.from_node_table(
        [
            {
                "NodeID": "n1",
                "NodeManagerAddress": "127.0.0.1",
                "Alive": True,
                "Resources": {"CPU": 2.0, "H800": 1.0},
            }
        ]
    )


async def test_adding_to_an_unknown_group_or_a_missing_pool_is_refused_naming_what_exists(
    tmp_path: Path,
) -> None:
    p = SimpleNamespace(config=config(tmp_path, pool="H20"), proxy=ElasticProxy(), actors=[], tag="t0")
    elastic = ElasticEngines(p, {"gen": None}, cluster=cluster_without_h20)  # type: ignore[arg-type]
    with pytest.raises(ElasticError, match="no engine group 'big' \\(groups: gen\\)") as e:
        await elastic.add("big")
    assert e.value.status == 404
    with pytest.raises(
        ElasticError, match=r"needs pool 'H20', which the cluster does not have \(pools: .*H800"
    ) as e:
        await elastic.add("gen")
    assert e.value.status == 409 and elastic.count("gen") == 0
    with pytest.raises(ElasticError, match="no engine 'gen-0'") as e:
        await elastic.remove("gen-0")
    assert e.value.status == 404


async def test_a_proxy_without_the_capability_is_named(tmp_path: Path) -> None:
    p = SimpleNamespace(config=config(tmp_path), proxy=object(), actors=[])
    elastic = ElasticEngines(p, {"gen": None})  # type: ignore[arg-type]
    with pytest.raises(ElasticError, match="proxy \\(object\\) cannot add or remove engines"):
        await elastic.add("gen")


def test_elastic_bounds_are_checked() -> None:
    base = {"name": "gen", "count": 3}
    from rollart_core.config import EngineGroupConfig

    with pytest.raises(ValueError, match=r"count 3 must be within elastic min_count\.\.max_count \(1\.\.2\)"):
        EngineGroupConfig.model_validate({**base, "elastic": {"max_count": 2}})
    with pytest.raises(ValueError, match="min_count 3 > max_count 2"):
        EngineGroupConfig.model_validate({**base, "elastic": {"min_count": 3, "max_count": 2}})
    assert EngineGroupConfig.model_validate({**base, "elastic": {"max_count": 4}}).elastic.max_count == 4  # type: ignore[union-attr]


async def call(run_dir: Path, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    return await asyncio.to_thread(admin_call, run_dir, method, path, body, 30)


async def raw(url: str, request: bytes) -> tuple[int, dict[str, Any]]:
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(request)
    await writer.drain()
    data = await reader.read()
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


async def test_admin_endpoint_answers_and_refuses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = config(tmp_path)
    p = SimpleNamespace(config=cfg, proxy=ElasticProxy(), actors=[])
    p.elastic = ElasticEngines(p, {"gen": None})  # type: ignore[arg-type]
    server = AdminServer(p)  # type: ignore[arg-type]
    await server.start()
    run_dir = cfg.output_dir
    try:
        file = run_dir / ADMIN_FILE
        assert stat.S_IMODE(file.stat().st_mode) == 0o600
        assert json.loads(file.read_text())["url"] == server.url
        assert await call(run_dir, "GET", "/engines") == {"engines": [], "changes": []}
        with pytest.raises(ElasticError, match="404: no engine group 'big' \\(groups: gen\\)"):
            await call(run_dir, "POST", "/engines", {"group": "big"})
        with pytest.raises(ElasticError, match='400: body must be \\{"group"'):
            await call(run_dir, "POST", "/engines", {"grp": "gen"})
        with pytest.raises(ElasticError, match="400: place_timeout_s must be a number"):
            await call(run_dir, "POST", "/engines", {"group": "gen", "place_timeout_s": "soon"})
        with pytest.raises(ElasticError, match="404: no engine 'gen-7'"):
            await call(run_dir, "DELETE", "/engines/gen-7?drain_timeout_s=1")
        with pytest.raises(ElasticError, match="400: drain_timeout_s must be between 0 and 3600"):
            await call(run_dir, "DELETE", "/engines/gen-7?drain_timeout_s=-1")
        with pytest.raises(ElasticError, match="405: PUT is not allowed"):
            await call(run_dir, "PUT", "/engines")
        with pytest.raises(ElasticError, match="404: no such path '/models'"):
            await call(run_dir, "GET", "/models")
        token = server.token
        status, answer = await raw(server.url, b"GET /engines HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status == 401 and "bearer token" in answer["error"]
        status, _ = await raw(
            server.url, b"GET /engines HTTP/1.1\r\nAuthorization: Bearer " + b"x" * len(token) + b"\r\n\r\n"
        )
        assert status == 401
        status, answer = await raw(
            server.url,
            f"POST /engines HTTP/1.1\r\nAuthorization: Bearer {token}\r\nContent-Length: 3\r\n\r\n[1]".encode(),
        )
        assert status == 400 and answer == {"error": "body must be a JSON object"}
        status, answer = await raw(
            server.url,
            f"POST /engines HTTP/1.1\r\nAuthorization: Bearer {token}\r\nContent-Length: 999999\r\n\r\n".encode(),
        )
        assert status == 400 and "at most" in answer["error"]
        # the CLI, in process: a listing, and a missing target as a user's mistake (exit 2)
        assert await asyncio.to_thread(main, ["engines", str(run_dir), "list"]) == 0
        assert json.loads(capsys.readouterr().out) == {"engines": [], "changes": []}
        assert await asyncio.to_thread(main, ["engines", str(run_dir), "remove"]) == 2
        assert "engines remove needs a target" in capsys.readouterr().err
    finally:
        await server.close()
    assert not (run_dir / ADMIN_FILE).exists()  # a finished run cannot be driven
    with pytest.raises(ConfigError, match="no run with an admin endpoint is going on"):
        admin_call(run_dir, "GET", "/engines")
