"""The stand-alone proxy service: ``rollart-proxy serve --config proxy.yaml``.

Puts an :class:`LLMProxy` with its OpenAI-compatible endpoint in front of inference servers that
were started separately (vLLM or SGLang), so another RL stack can use it over HTTP only.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from rollart_core.errors import ConfigError
from rollart_proxy.proxy import LLMProxy, WorkerHandle

__all__ = ["ServiceConfig", "WorkerConfig", "build_proxy", "load_config", "run_service"]

log = logging.getLogger(__name__)


class WorkerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    url: str
    """Base URL of a running inference server."""
    name: str | None = None
    """Worker name (default: the URL)."""
    kind: Literal["vllm", "sglang"] = "vllm"
    pool: str = "default"
    """Hardware pool the server belongs to (e.g. ``H800`` for prefill-heavy, ``H20`` for decode-heavy)."""
    max_inflight: int = Field(64, ge=1)
    """In-flight limit (back-pressure): more requests wait in the proxy, not in the engine."""
    weights_path_template: str | None = None
    """Where the server loads version ``v`` from, e.g. ``/ckpt/v{version:08d}``."""
    request_timeout_s: float = Field(600.0, gt=0)


class ServiceConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    model: Path
    """Model directory: its tokenizer and chat template format chat requests."""
    served_model_name: str | None = None
    """Name clients pass as ``model`` (default: the model directory's name)."""
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    workers: list[WorkerConfig] = Field(min_length=1)
    task_pools: dict[str, str] = Field(default_factory=dict)
    """Task name (``X-Rollart-Task`` header) → pool."""
    max_retries: int = Field(2, ge=0)
    """A request whose worker dies is retried on another worker of its pool at most this often."""
    max_model_len: int | None = Field(None, ge=2)
    """Context length for prompt checks; default: what the first vLLM server reports."""
    default_max_tokens: int = Field(256, ge=1)
    session_header: str = "X-Session-Id"
    enable_admin: bool = False
    """Serve ``/admin/*`` without an admin key (only on a loopback ``host``). Keys are never read from
    this file: pass them as ``--api-key`` / ``--admin-key`` or in ``ROLLART_PROXY_API_KEY`` /
    ``ROLLART_PROXY_ADMIN_KEY``."""
    max_body_bytes: int = Field(8 << 20, ge=1)
    """Larger request bodies get 413."""
    max_sessions: int = Field(100_000, ge=1)
    """Bound of the session tables: routing stickiness (least recently used first) and the server's
    owned sessions (a new one beyond it replaces one idle for ``session_ttl_s``, else gets 429)."""
    session_ttl_s: float | None = Field(3600.0, gt=0)
    """A session unused this long may be evicted whole to make room (None: only ``DELETE`` ends one)."""
    body_timeout_s: float = Field(30.0, gt=0)
    """A request body not received within this gets 408."""
    max_queued: int = Field(4096, ge=0)
    """Requests that may wait per worker beyond its ``max_inflight``; more get 429."""
    max_n: int = Field(16, ge=1)
    """Largest ``n`` of a call without a session: ``n`` samples of one prompt, recorded as ``n``
    sibling trajectories of one group (``GET /v1/groups/{id}``); a larger ``n`` gets 400."""

    @model_validator(mode="after")
    def _check(self) -> ServiceConfig:
        names = [w.name or w.url for w in self.workers]
        if len(set(names)) != len(names):
            raise ValueError(f"worker names must be unique, got {names}")
        pools = {w.pool for w in self.workers}
        bad = {t: p for t, p in self.task_pools.items() if p not in pools}
        if bad:
            raise ValueError(f"task_pools name pools without workers: {bad} (pools: {sorted(pools)})")
        return self


def load_config(path: str | Path) -> ServiceConfig:
    p = Path(path)
    try:
        raw = yaml.safe_load(p.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{p}: cannot read config: {exc}") from None
    try:
        return ServiceConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(f"{p}: invalid proxy config:\n{exc}") from None


async def build_proxy(cfg: ServiceConfig) -> LLMProxy:
    from rollart_proxy.engines.sglang_server_engine import SglangServerEngine
    from rollart_proxy.engines.vllm_server_engine import VllmServerEngine, VllmServerEngineConfig

    handles = []
    for w in cfg.workers:
        cls = VllmServerEngine if w.kind == "vllm" else SglangServerEngine
        config = cls.Config(
            url=w.url,
            weights_path_template=w.weights_path_template,
            request_timeout_s=w.request_timeout_s,
        )
        engine: VllmServerEngine | SglangServerEngine
        if isinstance(config, VllmServerEngineConfig):  # pairs each config with its engine class
            engine = VllmServerEngine(config, name=w.name or w.url)
        else:
            engine = SglangServerEngine(config, name=w.name or w.url)
        await engine.start()
        handles.append(WorkerHandle(w.name or w.url, engine, w.pool, w.max_inflight, cfg.max_queued))
    return LLMProxy(
        handles, task_pools=cfg.task_pools, max_retries=cfg.max_retries, max_sessions=cfg.max_sessions
    )


async def run_service(
    cfg: ServiceConfig,
    *,
    api_keys: list[str] | None = None,
    admin_key: str | None = None,
    enable_admin: bool | None = None,
) -> None:
    """Serve until SIGINT/SIGTERM. ``api_keys`` / ``admin_key``: None reads the environment (see
    :class:`~rollart_proxy.server.OpenAIServer`); ``enable_admin``: None takes the config's."""
    from rollart_proxy.server import OpenAIServer

    proxy = await build_proxy(cfg)
    max_len = cfg.max_model_len
    if max_len is None:
        max_len = next(
            (
                getattr(w.engine, "max_model_len", None)
                for w in proxy.workers.values()
                if getattr(w.engine, "max_model_len", None)
            ),
            None,
        )
    server = OpenAIServer(
        proxy,
        str(cfg.model),
        served_model_name=cfg.served_model_name,
        max_model_len=max_len,
        default_max_tokens=cfg.default_max_tokens,
        session_header=cfg.session_header,
        api_key=api_keys,
        admin_key=admin_key,
        enable_admin=cfg.enable_admin if enable_admin is None else enable_admin,
        max_body_bytes=cfg.max_body_bytes,
        max_sessions=cfg.max_sessions,
        max_n=cfg.max_n,
        session_ttl_s=cfg.session_ttl_s,
        body_timeout_s=cfg.body_timeout_s,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    proxy.start_health_loop()  # dead servers that come back are brought to the served version first
    port = await server.start(cfg.host, cfg.port)
    print(
        f"rollart-proxy serving {server.model_name!r} on http://{cfg.host}:{port} "
        f"over {len(proxy.workers)} worker(s)",
        flush=True,
    )
    try:
        await stop.wait()
    finally:
        await server.stop()
        await proxy.stop_health_loop()
        for w in proxy.workers.values():
            await w.engine.shutdown()  # type: ignore[attr-defined]
