"""Shared plumbing of the engines that talk to an already running inference server over HTTP.

Error mapping (the proxy relies on it): the server rejected the request (4xx) →
:class:`~rollart_core.errors.EngineError`; the server is unreachable, timed out or failed (5xx) →
:class:`~rollart_proxy.errors.WorkerUnavailableError`, which the proxy retries elsewhere.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict, Field

from rollart_core.errors import EngineError, WeightSyncError
from rollart_core.protocols import WeightStore
from rollart_proxy.engines._common import engine_stats
from rollart_proxy.errors import WorkerUnavailableError
from rollart_proxy.metrics import WorkerMetrics

__all__ = ["HttpEngineBase", "HttpEngineConfig"]

log = logging.getLogger(__name__)


class HttpEngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    url: str
    """Base URL of the running server, e.g. ``http://127.0.0.1:8000``."""
    model: str | None = None
    """Served model name sent with requests; None = ask the server at :meth:`start`."""
    request_timeout_s: float = Field(600.0, gt=0)
    """Upper bound on one generation request (a hung server never hangs the caller)."""
    control_timeout_s: float = Field(120.0, gt=0)
    """Upper bound on pause/resume/weight-update calls."""
    max_connections: int = Field(256, ge=1)
    weights_path_template: str | None = None
    """Where the server finds version ``v`` on disk, e.g. ``/ckpt/v{version:08d}`` (the
    filesystem weight store's layout). If None, versions are pulled from the weight store and
    written as safetensors under ``staging_dir`` (which the server must be able to read)."""
    staging_dir: Path | None = None
    keep_staged: int = Field(2, ge=1)
    """How many staged versions to keep under ``staging_dir``."""


class HttpEngineBase:
    Config = HttpEngineConfig

    def __init__(
        self,
        config: HttpEngineConfig | None = None,
        *,
        url: str | None = None,
        weight_store: WeightStore | None = None,
        name: str | None = None,
    ) -> None:
        if config is None:
            if url is None:
                raise EngineError(f"{type(self).__name__} needs a config or url=")
            config = self.Config(url=url)
        self.config = config
        self.base = config.url.rstrip("/")
        self.name = name or self.base
        self._store = weight_store
        self._client: httpx.AsyncClient | None = None
        self._version = 0
        self._paused = False
        self._inflight: set[str] = set()
        self._metrics = WorkerMetrics()
        self.stats: dict[str, Any] = {
            "requests": 0,
            "prompt_tokens": 0,
            "output_tokens": 0,
            "updates": 0,
            "update_pause_s": 0.0,
        }

    # lifecycle -------------------------------------------------------------------------------

    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            limits = httpx.Limits(
                max_connections=self.config.max_connections,
                max_keepalive_connections=self.config.max_connections,
            )
            self._client = httpx.AsyncClient(
                base_url=self.base,
                limits=limits,
                trust_env=False,
                timeout=httpx.Timeout(self.config.request_timeout_s, connect=10.0),
            )
        return self._client

    async def shutdown(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    # HTTP ------------------------------------------------------------------------------------

    async def _post(
        self, path: str, *, json_body: Any = None, params: dict[str, Any] | None = None, control: bool = True
    ) -> Any:
        timeout = self.config.control_timeout_s if control else self.config.request_timeout_s
        try:
            r = await self.client().post(path, json=json_body, params=params, timeout=timeout)
        except httpx.HTTPError as exc:  # connect error, timeout, reset: the worker is gone
            raise WorkerUnavailableError(f"{self.name}: POST {path} failed: {exc!r}") from None
        return self._check(r, f"POST {path}")

    async def _get(self, path: str) -> Any:
        try:
            r = await self.client().get(path, timeout=self.config.control_timeout_s)
        except httpx.HTTPError as exc:
            raise WorkerUnavailableError(f"{self.name}: GET {path} failed: {exc!r}") from None
        return self._check(r, f"GET {path}")

    def _check(self, r: httpx.Response, what: str) -> Any:
        if r.status_code >= 500:
            raise WorkerUnavailableError(f"{self.name}: {what} → {r.status_code}: {_message(r)}")
        if r.status_code >= 400:
            raise EngineError(f"{self.name}: {what} rejected ({r.status_code}): {_message(r)}")
        if not r.content:
            return None
        try:
            return r.json()
        except json.JSONDecodeError:
            return r.text

    # weights ---------------------------------------------------------------------------------

    def weights_path(self, version: int) -> str:
        """A directory of safetensors the server can load ``version`` from."""
        c = self.config
        if c.weights_path_template is not None:
            return c.weights_path_template.format(version=version)
        if self._store is None or c.staging_dir is None:
            raise WeightSyncError(
                f"{self.name}: set weights_path_template, or a weight store and staging_dir"
            )
        from safetensors.torch import save_file

        tensors = self._store.pull(version)
        out = Path(c.staging_dir) / f"v{version:08d}"
        tmp = Path(c.staging_dir) / f".tmp-v{version:08d}"
        tmp.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors"))
        if out.exists():
            import shutil

            shutil.rmtree(out)
        tmp.rename(out)
        self._prune_staged()
        return str(out)

    def _prune_staged(self) -> None:
        import shutil

        assert self.config.staging_dir is not None
        staged = sorted(p for p in Path(self.config.staging_dir).glob("v*") if p.is_dir())
        for p in staged[: -self.config.keep_staged]:
            shutil.rmtree(p, ignore_errors=True)

    # introspection ---------------------------------------------------------------------------

    async def weight_version(self) -> int:
        await self._get("/health")  # doubles as the proxy's health probe
        return self._version

    async def get_stats(self) -> dict[str, Any]:
        return engine_stats(self.stats, self._metrics, len(self._inflight), self._version, self._paused)

    def _account(self, prompt: int, cached: int, out: int, finish: str) -> None:
        self.stats["requests"] += 1
        self.stats["prompt_tokens"] += prompt
        self.stats["output_tokens"] += out
        self._metrics.record(prompt - cached, out, finish)


def _message(r: httpx.Response) -> str:
    try:
        body = r.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return r.text[:500]
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            return str(err.get("message") or err.get("detail") or err)[:1000]
        if "detail" in body:
            return str(body["detail"])[:1000]
        return str(err)[:1000]
    return str(body)[:1000]
