"""The ``serverless`` reward executor: a function runtime that the executor starts, watches and stops.

Two ways to use it (task option ``reward_executor: {impl: serverless, options: ...}``):

- ``url:`` a runtime someone else runs (``rollart-reward serve`` by hand, a platform gateway): calls go
  straight to the HTTP executor (:mod:`rollart_reward.http_executor`), nothing is started.
- otherwise the executor runs ``rollart-reward serve`` itself, serving the task's reward function, on a
  free port, with a fresh bearer token: when Ray is initialised, as a child process of a Ray actor on the
  CPU pool (``pool``), bound to ``host`` (loopback by default, ``node`` = the actor node's address);
  without Ray, as a child process of this one. It starts on the first :meth:`score` (the pipeline builds
  executors before it initialises Ray), or on ``await start()``.

Primitives (all called by the pipeline's control plane, on its event loop):

==================  ===========================================================================
``await start()``   start the runtime now (idempotent); returns its URL
``await score(t)``  one trajectory's reward; :class:`RewardError` naming the stage after retries
``stats()``         the HTTP executor's counters plus ``runtime_*``: the runtime's own utilisation,
                    cold starts, workers, and ``runtime_restarts`` (a snapshot, refreshed every
                    ``stats_interval_s``; ``await astats()`` refreshes it first)
``await aclose()``  stop the runtime and every process it started (idempotent); ``close()``: the same
                    from synchronous code
==================  ===========================================================================

Faults: a runtime process that exits (crash, ``kill -9``) is restarted on the same port, up to
``restarts`` times per executor; calls in flight when it died are retried on the new one (their
idempotency keys make a retry safe within one runtime's life: a runtime that died mid-call may have
run the function once already, the new one runs it again). Budget spent: every call fails with a
:class:`RewardError` naming the reward stage and the runtime's URL.

How the runtime process is started, hosted (here or in a Ray actor) and stopped:
:mod:`rollart_reward.runtime_host`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import sys
from collections import Counter
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rollart_core.errors import ConfigError, RewardError
from rollart_core.protocols import RewardFunction
from rollart_core.types import RewardResult, Trajectory
from rollart_reward.http_executor import HttpClientConfig, HttpExecutor, HttpExecutorConfig
from rollart_reward.runtime import ScalingConfig
from rollart_reward.runtime_host import LocalHandle, RayHandle, serve_command

__all__ = ["RewardRef", "ServerlessExecutor", "ServerlessExecutorConfig", "serve_command"]

log = logging.getLogger(__name__)

_OWN_RUNTIME_OPTIONS = frozenset(
    {
        "reward",
        "host",
        "pool",
        "num_cpus",
        "launch",
        "runtime",
        "restarts",
        "start_timeout_s",
        "stop_timeout_s",
    }
)


class RewardRef(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    impl: str
    """Reward function name (``rollart.reward`` entry point) or ``package.module:Class``."""
    options: dict[str, Any] = Field(default_factory=dict)
    """The function's own config (JSON)."""


class ServerlessExecutorConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    url: str | None = None
    """A runtime someone else runs: connect to it and start nothing. Excludes the options below that
    describe a runtime the executor starts (``reward``, ``host``, ``pool``, ``runtime``, ...)."""
    reward: RewardRef | None = None
    """The function the runtime serves. Unset: the task's reward function (the object the pipeline
    passes as ``fn``), found by its class (its ``rollart.reward`` entry point name, else its
    ``module:Class`` path) and its pydantic ``config`` (the options it was built with)."""
    host: str = "127.0.0.1"
    """Address the runtime binds. ``node``: the Ray node's address (reachable from other nodes)."""
    pool: str | None = None
    """Ray custom resource (the CPU pool) the runtime's actor must be placed on; None = anywhere."""
    num_cpus: float = Field(1.0, gt=0)
    """CPUs the runtime's Ray actor reserves (its workers share them)."""
    launch: Literal["auto", "ray", "local"] = "auto"
    """``auto``: a Ray actor if Ray is initialised when the runtime starts, else a local process."""
    runtime: ScalingConfig = ScalingConfig()
    """The runtime's scaling and limits: workers (instances), keep-alive, call timeout, queue, cache."""
    http: HttpClientConfig = HttpClientConfig()
    """How calls are made: concurrency, timeouts (incl. cold start), retries, idempotency, breaker.
    ``http.api_key`` unset: a random token per started runtime."""
    restarts: int = Field(3, ge=0)
    """How often a runtime that died is restarted over the executor's life, before calls fail."""
    start_timeout_s: float = Field(120.0, gt=0)
    """A runtime that has not printed its URL by then is killed and counts as failed to start."""
    stop_timeout_s: float = Field(10.0, gt=0)
    """Grace after SIGTERM before the runtime's process group is killed."""
    stats_interval_s: float = Field(5.0, gt=0)
    """How often the runtime's ``/stats`` is read into :meth:`ServerlessExecutor.stats`."""

    @model_validator(mode="after")
    def _url_or_own_runtime(self) -> ServerlessExecutorConfig:
        own = sorted(self.model_fields_set & _OWN_RUNTIME_OPTIONS)
        if self.url is not None and own:
            raise ValueError(
                f"url is set, but {own} describe a runtime the executor starts itself: give one or the other"
            )
        return self


_ADDITIVE = (
    "calls",
    "failures",
    "busy_s",
    "provisioned_s",
    "billed_s",
    "cold_starts",
    "executions",
    "cache_hits",
    "throttled",
    "function_errors",
)


class ServerlessExecutor:
    """Scores through a function runtime it starts (or the one at ``url``). ``await aclose()`` when done."""

    Config = ServerlessExecutorConfig

    def __init__(
        self, config: ServerlessExecutorConfig | None = None, *, fn: RewardFunction | None = None
    ) -> None:
        self.config = c = config or ServerlessExecutorConfig()
        if c.url is None:
            self.function, self.options = reward_of(c.reward, fn)
        self._api_key = c.http.api_key or (secrets.token_urlsafe(24) if c.url is None else None)
        self.url = c.url or ""
        self._http = HttpExecutor(
            HttpExecutorConfig(
                **{**c.http.model_dump(), "api_key": self._api_key, "url": c.url or "http://127.0.0.1:1"}
            ),
            fn=fn,
        )
        self._lock = asyncio.Lock()
        self._ready = asyncio.Event()
        self._handle: LocalHandle | RayHandle | None = None
        self.pid: int | None = None
        """PID of the runtime's serve process (on the actor's node in the Ray case)."""
        self.deaths = 0
        self.restarts = 0
        self._failed: RewardError | None = None
        self._closed = False
        self._watcher: asyncio.Task[None] | None = None
        self._poller: asyncio.Task[None] | None = None
        self._runtime: dict[str, Any] = {}
        self._banked: Counter[str] = Counter()

    @property
    def api_key(self) -> str | None:
        """The bearer token calls carry (generated per executor for a runtime it starts)."""
        return self._api_key

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> str:
        """Start the runtime (once; later calls return its URL). :class:`RewardError` if it cannot start."""
        if self.config.url is not None:
            return self.url
        async with self._lock:
            if self._closed:
                raise RewardError("reward stage: the serverless executor is closed")
            if self._handle is None and self._failed is None:
                await self._launch(0)
                self._watcher = asyncio.create_task(self._watch(), name="rollart-reward-runtime-watch")
                self._poller = asyncio.create_task(self._poll_stats(), name="rollart-reward-runtime-stats")
        if self._failed is not None:
            raise self._failed
        return self.url

    def _new_handle(self) -> LocalHandle | RayHandle:
        c = self.config
        use_ray = c.launch == "ray"
        if c.launch == "auto":
            ray = sys.modules.get("ray")
            use_ray = ray is not None and ray.is_initialized()
        if use_ray:
            from rollart_core.extras import require

            require("ray", "pip install 'rollart-reward[ray]'")
            return RayHandle(c, self.function, self.options, self._api_key or "")
        return LocalHandle(c, self.function, self.options, self._api_key or "")

    async def _launch(self, port: int) -> None:
        handle = self._new_handle()
        try:
            info = await handle.start(port)
        except BaseException:
            await handle.stop()
            raise
        self._handle, self.url, self.pid = handle, info["url"], info["pid"]
        self._http.retarget(self.url)
        self._http.breaker.success()  # failures of the dead runtime say nothing about this one
        self._ready.set()
        log.info(
            "reward runtime for %s started as a %s at %s (pid %s)",
            self.function,
            handle.where,
            self.url,
            self.pid,
        )

    async def _watch(self) -> None:
        """Restart the runtime whenever it exits unasked, within the ``restarts`` budget."""
        while True:
            handle = self._handle
            assert handle is not None
            await handle.wait_exit()
            if self._closed:
                return
            self._ready.clear()
            self.deaths += 1
            self._bank_stats()
            url, port = self.url, int(self.url.rsplit(":", 1)[-1])
            await handle.stop()
            if self.restarts >= self.config.restarts:
                self._fail(
                    f"reward stage: the function runtime at {url} died and its restart budget "
                    f"({self.config.restarts}) is spent"
                )
                return
            self.restarts += 1
            log.warning(
                "reward runtime at %s (pid %s) exited: restart %d of %d",
                url,
                self.pid,
                self.restarts,
                self.config.restarts,
            )
            try:
                try:
                    await self._launch(port)  # the same port: retries already under way reach the new one
                except RewardError as exc:
                    log.warning(
                        "reward runtime could not restart on port %d (%s): trying a free port", port, exc
                    )
                    await self._launch(0)
            except RewardError as exc:
                self._fail(
                    f"reward stage: the function runtime at {url} died and could not be restarted: {exc}"
                )
                return

    def _fail(self, message: str) -> None:
        log.error("%s", message)
        self._failed = RewardError(message)
        self._ready.set()  # waiting calls wake up and raise it

    async def aclose(self) -> None:
        """Stop the runtime and every process it started; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._failed is None:
            self._failed = RewardError("reward stage: the serverless executor is closed")
        self._ready.set()
        for task in (self._watcher, self._poller):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        handle, self._handle = self._handle, None
        if handle is not None:
            await self._refresh_stats()
            self._bank_stats()
            await handle.stop()
        await self._http.aclose()

    def close(self) -> None:
        """:meth:`aclose` for synchronous code (not from inside a running event loop: await ``aclose``)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            raise RewardError(
                "serverless executor: close() called inside a running event loop: await aclose()"
            )
        if self._closed:
            return
        self._closed = True
        self._failed = self._failed or RewardError("reward stage: the serverless executor is closed")
        for task in (self._watcher, self._poller):
            if task is not None:
                task.cancel()
        handle, self._handle = self._handle, None
        if handle is not None:
            self._bank_stats()
            handle.stop_sync()
        self._http._client = None  # its connections belong to a loop that is gone

    # ---------------------------------------------------------------- scoring
    async def score(self, trajectory: Trajectory) -> RewardResult:
        if self.config.url is not None:
            return await self._http.score(trajectory)
        last: RewardError | None = None
        for _ in range(self.config.restarts + 2):
            await self.start()
            await self._ready.wait()
            if self._failed is not None:
                raise self._failed from last
            deaths = self.deaths
            try:
                return await self._http.score(trajectory)
            except RewardError as exc:
                handle = self._handle
                if self._closed or (self.deaths == deaths and handle is not None and await handle.alive()):
                    raise  # the runtime was up all along: a real failure of this call
                log.warning(
                    "reward call %s failed while the runtime at %s was down (%s): retrying it once the "
                    "runtime is back",
                    trajectory.traj_id,
                    self.url,
                    exc,
                )
                last = exc
        raise RewardError(
            f"reward stage: {trajectory.traj_id} failed on every restart of the function runtime "
            f"at {self.url}: {last}"
        ) from last

    # ---------------------------------------------------------------- stats
    async def _poll_stats(self) -> None:
        while True:
            await asyncio.sleep(self.config.stats_interval_s)
            await self._refresh_stats()

    async def _refresh_stats(self) -> None:
        if not self.url or not self._ready.is_set() or (self._failed is not None and not self._closed):
            return  # down (restarting, or given up): nothing to read
        import httpx

        try:
            async with httpx.AsyncClient(timeout=5) as client:
                r = await client.get(
                    f"{self.url}/stats", headers={"Authorization": f"Bearer {self._api_key}"}
                )
                r.raise_for_status()
                self._runtime = r.json()
        except (httpx.HTTPError, ValueError) as exc:
            log.warning("reward runtime at %s: could not read its stats: %r", self.url, exc)

    def _bank_stats(self) -> None:
        """Keep a dead (or stopped) runtime's last counters: a restarted runtime counts from zero."""
        for k in _ADDITIVE:
            self._banked[k] += self._runtime.get(k, 0)
        self._runtime = {}

    async def astats(self) -> dict[str, float]:
        """:meth:`stats` with the runtime's counters read now."""
        await self._refresh_stats()
        return self.stats()

    def stats(self) -> dict[str, float]:
        s: dict[str, Any] = dict(self._http.stats())
        rt = self._runtime
        total = {k: self._banked[k] + rt.get(k, 0) for k in _ADDITIVE}
        s.update({f"runtime_{k}": v for k, v in total.items()})
        s.update(
            {
                "runtime_utilisation": total["busy_s"] / total["provisioned_s"]
                if total["provisioned_s"]
                else 0.0,
                "runtime_utilisation_billed": total["busy_s"] / total["billed_s"]
                if total["billed_s"]
                else 0.0,
                "runtime_workers": rt.get("workers", 0),
                "runtime_peak_workers": rt.get("peak_workers", 0),
                "runtime_cold_start_s_mean": rt.get("cold_start_s_mean", 0.0),
                "runtime_restarts": self.restarts,
                "runtime_deaths": self.deaths,
            }
        )
        return s


def reward_of(ref: RewardRef | None, fn: RewardFunction | None) -> tuple[str, dict[str, Any]]:
    """``(impl, options)`` the runtime is told to serve: ``ref`` if given, else derived from ``fn``."""
    if ref is not None:
        return ref.impl, dict(ref.options)
    if fn is None:
        raise ConfigError(
            "serverless executor: no reward function to serve: set reward: {impl, options} (or url:)"
        )
    if getattr(fn, "stateless", True) is False:
        log.warning(
            "serverless executor: reward %s declares stateless = False; each runtime worker holds its own "
            "copy of its state",
            type(fn).__name__,
        )
    cls = type(fn)
    path = f"{cls.__module__}:{cls.__qualname__}"
    if "<locals>" in path or cls.__module__ == "__main__":
        raise ConfigError(
            f"serverless executor: reward class {path} cannot be imported by the runtime: set reward: "
            "{impl, options}"
        )
    from importlib.metadata import entry_points

    name = next((ep.name for ep in entry_points(group="rollart.reward") if ep.value == path), path)
    config = getattr(fn, "config", None)
    if isinstance(config, BaseModel):
        options = config.model_dump(mode="json", exclude_unset=True)
    elif getattr(cls, "Config", None) is None:
        options = {}
    else:
        raise ConfigError(
            f"serverless executor: cannot tell the options reward {name} was built with: set reward: "
            "{impl, options}"
        )
    return name, options
