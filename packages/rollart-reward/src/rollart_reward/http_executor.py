"""Serverless reward offload over HTTP: concurrency-limited async client with batching, timeouts,
retries (exponential backoff + full jitter on 429/5xx/timeouts/malformed bodies), an
attempt-independent idempotency key per trajectory, a circuit breaker with fallback to another
executor, and cold-start awareness (a longer timeout while the endpoint may be cold; cold starts the
runtime reports in ``X-Rollart-Cold-Start`` are counted).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from collections import Counter
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rollart_core.errors import RewardError
from rollart_core.protocols import RewardExecutor, RewardFunction
from rollart_core.types import RewardResult, Trajectory
from rollart_reward.adapters import (
    COLD_START_HEADER,
    Call,
    FcAdapter,
    FunctionFailed,
    JsonAdapter,
    Retryable,
    make_adapter,
)
from rollart_reward.executor import InlineExecutor
from rollart_reward.metrics import UtilisationMeter
from rollart_reward.wire import idempotency_key, result_from_dict, trajectory_to_dict

__all__ = ["CircuitBreaker", "HttpClientConfig", "HttpExecutor", "HttpExecutorConfig"]

log = logging.getLogger(__name__)


class HttpClientConfig(BaseModel):
    """How calls are made (everything but the URL): shared by ``http`` and ``serverless`` executors."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    function: str = "reward"
    """Function name used in platform paths (Lambda/FC) and in the idempotency key."""
    adapter: Literal["json", "lambda", "fc"] = "json"
    invocation: Literal["sync", "async"] = "sync"
    """``async``: submit with a caller-chosen task id, then poll (``fc`` adapter only)."""
    max_concurrency: int = Field(64, ge=1)
    timeout_s: float = Field(30.0, gt=0)
    cold_start_timeout_s: float = Field(120.0, gt=0)
    """Timeout while the endpoint may be cold (no success yet, or none for ``warm_window_s``)."""
    warm_window_s: float = Field(60.0, gt=0)
    retries: int = Field(4, ge=0)
    backoff_base_s: float = Field(0.05, ge=0)
    backoff_max_s: float = Field(5.0, ge=0)
    batch_size: int = Field(1, ge=1)
    """>1 groups concurrent calls into one request (``json`` adapter)."""
    batch_wait_s: float = Field(0.005, ge=0)
    breaker_failures: int = Field(8, ge=1)
    """Consecutive failed attempts (endpoint faults, not function errors) that open the circuit."""
    breaker_reset_s: float = Field(5.0, gt=0)
    """Open circuit: after this long one probe call is let through (half-open)."""
    poll_interval_s: float = Field(0.05, gt=0)
    poll_timeout_s: float = Field(600.0, gt=0)
    fallback: Literal["inline", "none"] = "inline"
    """Where calls go while the circuit is open: the function run in-process (needs ``fn``), or nowhere."""
    seed: int | None = None
    """Seed of the jitter RNG (tests)."""
    api_key: str | None = Field(None, repr=False, min_length=1)
    """Bearer token sent as ``Authorization: Bearer ...``; None: ``$ROLLART_REWARD_API_KEY`` if set."""


class HttpExecutorConfig(HttpClientConfig):
    url: str
    """Base URL of the function endpoint, e.g. ``http://127.0.0.1:8700``."""


class CircuitBreaker:
    """closed → (``threshold`` consecutive failures) → open → (``reset_s``) → half-open: one probe."""

    def __init__(self, threshold: int, reset_s: float) -> None:
        self.threshold, self.reset_s = threshold, reset_s
        self.state: Literal["closed", "open", "half_open"] = "closed"
        self.failures = 0
        self.opened_at = 0.0
        self.opens = 0
        self._probe = False

    def allow(self) -> bool:
        if self.state == "closed":
            return True
        if self.state == "open" and time.monotonic() - self.opened_at >= self.reset_s:
            self.state, self._probe = "half_open", False
        if self.state == "half_open" and not self._probe:
            self._probe = True
            return True
        return False

    def success(self) -> None:
        self.state, self.failures, self._probe = "closed", 0, False

    def failure(self) -> None:
        self.failures += 1
        if self.state == "half_open" or (self.state == "closed" and self.failures >= self.threshold):
            if self.state != "open":
                self.opens += 1
            self.state, self.opened_at, self._probe = "open", time.monotonic(), False


class _CircuitOpen(Exception):
    pass


class HttpExecutor:
    """Scores trajectories by calling a function endpoint. ``await aclose()`` when done."""

    Config = HttpExecutorConfig

    def __init__(
        self,
        config: HttpExecutorConfig,
        *,
        fn: RewardFunction | None = None,
        fallback: RewardExecutor | None = None,
    ) -> None:
        self.config = config
        if config.invocation == "async" and config.adapter != "fc":
            raise RewardError("http executor: invocation='async' needs adapter='fc'")
        self.adapter = make_adapter(config.adapter, config.function)
        if fallback is None and fn is not None and config.fallback == "inline":
            fallback = InlineExecutor(fn, retries=0)
        self.fallback = fallback
        self.breaker = CircuitBreaker(config.breaker_failures, config.breaker_reset_s)
        self.meter = UtilisationMeter(slots=None)
        self.counters: Counter[str] = Counter()
        self._rng = random.Random(config.seed)
        self._last_ok: float | None = None
        self._client: Any = None
        self._retired: list[Any] = []
        self._sem: asyncio.Semaphore | None = None
        self._pending: list[tuple[str, dict[str, Any], asyncio.Future[RewardResult]]] = []
        self._flusher: asyncio.Task[None] | None = None

    # ---------------------------------------------------------------- plumbing
    def _http(self) -> Any:
        if self._client is None:
            import httpx

            n = self.config.max_concurrency
            token = self.config.api_key or os.environ.get("ROLLART_REWARD_API_KEY") or None
            self._client = httpx.AsyncClient(
                base_url=self.config.url,
                headers={"Authorization": f"Bearer {token}"} if token else None,
                limits=httpx.Limits(max_connections=n, max_keepalive_connections=n),
            )
            if self._sem is None:
                self._sem = asyncio.Semaphore(n)
        return self._client

    def retarget(self, url: str) -> None:
        """Send the next attempts to ``url`` (the endpoint moved, e.g. a restarted runtime on a new
        port). Requests already on the wire finish on the old client, which is closed by :meth:`aclose`."""
        if url == self.config.url:
            return
        self.config = self.config.model_copy(update={"url": url})
        if self._client is not None:
            self._retired.append(self._client)
            self._client = None

    async def aclose(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
        clients, self._retired = [*self._retired, self._client], []
        self._client = None
        for client in clients:
            if client is not None:
                await client.aclose()

    def _timeout(self) -> float:
        c = self.config
        cold = self._last_ok is None or time.monotonic() - self._last_ok > c.warm_window_s
        if cold:
            self.counters["cold_timeout_calls"] += 1
        return c.cold_start_timeout_s if cold else c.timeout_s

    async def _send(self, call: Call, timeout: float) -> tuple[int, str, Any]:
        import httpx

        self.counters["http_attempts"] += 1
        try:
            r = await self._http().request(
                call.method, call.path, json=call.body, headers=call.headers, timeout=timeout
            )
        except httpx.TimeoutException as exc:
            self.counters["http_timeouts"] += 1
            raise Retryable(f"timed out after {timeout:.1f}s: {type(exc).__name__}") from None
        except httpx.TransportError as exc:
            self.counters["http_transport_errors"] += 1
            raise Retryable(f"transport error: {exc!r}") from None
        self.counters[f"http_{r.status_code}"] += 1
        if r.headers.get(COLD_START_HEADER) == "1":
            self.meter.cold_starts += 1
        return r.status_code, r.text, r.headers

    def _backoff(self, attempt: int, retry_after: float | None) -> float:
        c = self.config
        delay = self._rng.uniform(0, min(c.backoff_max_s, c.backoff_base_s * 2**attempt))
        return max(delay, retry_after or 0.0)

    # ---------------------------------------------------------------- one attempt
    async def _attempt(self, key: str, traj: dict[str, Any], attempt: int) -> RewardResult:
        if self.config.invocation == "async":
            return await self._attempt_async(key, traj, attempt)
        status, text, headers = await self._send(self.adapter.request(key, traj), self._timeout())
        try:
            return self.adapter.response(status, text, headers)
        except ValueError as exc:  # a 4xx: our request is wrong, retrying will not help
            raise RewardError(f"endpoint rejected the call: {exc}") from None

    async def _attempt_async(self, key: str, traj: dict[str, Any], attempt: int) -> RewardResult:
        assert isinstance(self.adapter, FcAdapter)
        # Same task id for every resubmission of one attempt (the platform dedupes); a new id only
        # after the task itself failed, since a failed task id cannot be rerun.
        task_id = key if attempt == 0 else f"{key}-{attempt}"
        status, text, headers = await self._send(self.adapter.submit(key, task_id, traj), self._timeout())
        if status != 202:
            self.adapter.response(status, text, headers)  # raises the right error
            raise Retryable(f"async submit answered {status}, expected 202: {text[:500]!r}")
        deadline = time.monotonic() + self.config.poll_timeout_s
        while time.monotonic() < deadline:
            await asyncio.sleep(self.config.poll_interval_s)
            status, text, headers = await self._send(self.adapter.poll(task_id), self.config.timeout_s)
            result = self.adapter.poll_response(status, text, headers)
            if result is not None:
                return result
        raise Retryable(f"async task {task_id} still running after {self.config.poll_timeout_s}s")

    # ---------------------------------------------------------------- public
    async def score(self, trajectory: Trajectory) -> RewardResult:
        key = idempotency_key(trajectory, self.config.function)
        t_enq = time.monotonic()
        self.meter.enter()
        result: RewardResult | None  # None: the circuit opened during the retries
        try:
            if not self.breaker.allow():
                return await self._fall_back(trajectory, "circuit open")
            data = trajectory_to_dict(trajectory)
            if self.config.batch_size > 1 and isinstance(self.adapter, JsonAdapter):
                result = await self._batched(key, data)
                self.meter.record(busy_s=time.monotonic() - t_enq)
                return result
            self._http()
            assert self._sem is not None
            async with self._sem:
                queue_s = time.monotonic() - t_enq
                t0 = time.monotonic()
                try:
                    result = await self._with_retries(key, data, trajectory.traj_id)
                except _CircuitOpen:
                    result = None
                if result is not None:
                    self.meter.record(busy_s=time.monotonic() - t0, queue_s=queue_s)
                    return result
            return await self._fall_back(trajectory, "circuit opened during retries")
        except RewardError:
            self.meter.record(busy_s=time.monotonic() - t_enq, ok=False)
            raise
        finally:
            self.meter.leave()

    async def _with_retries(self, key: str, data: dict[str, Any], traj_id: str) -> RewardResult:
        c = self.config
        last: Exception | None = None
        for attempt in range(c.retries + 1):
            if attempt and not self.breaker.allow():
                raise _CircuitOpen()
            try:
                result = await self._attempt(key, data, attempt)
            except FunctionFailed as exc:
                self.breaker.success()  # the endpoint answered: healthy
                last = exc
            except Retryable as exc:
                self.breaker.failure()
                last = exc
            else:
                self.breaker.success()
                self._last_ok = time.monotonic()
                return result
            log.warning(
                "reward call %s (key %s) attempt %d/%d failed: %s",
                traj_id,
                key,
                attempt + 1,
                c.retries + 1,
                last,
            )
            if attempt < c.retries:
                self.meter.retries += 1
                if isinstance(last, Retryable):
                    await asyncio.sleep(self._backoff(attempt, last.retry_after))
        raise RewardError(f"reward for {traj_id} failed after {c.retries + 1} attempts: {last}")

    async def _fall_back(self, trajectory: Trajectory, why: str) -> RewardResult:
        if self.fallback is None:
            raise RewardError(f"reward endpoint unavailable ({why}) and no fallback executor")
        self.counters["fallbacks"] += 1
        return await self.fallback.score(trajectory)

    # ---------------------------------------------------------------- batching
    async def _batched(self, key: str, data: dict[str, Any]) -> RewardResult:
        fut: asyncio.Future[RewardResult] = asyncio.get_running_loop().create_future()
        self._pending.append((key, data, fut))
        if len(self._pending) >= self.config.batch_size:
            self._flush_now()
        elif self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush_later())
        return await fut

    async def _flush_later(self) -> None:
        await asyncio.sleep(self.config.batch_wait_s)
        self._flush_now()

    def _flush_now(self) -> None:
        items, self._pending = self._pending, []
        if items:
            task = asyncio.create_task(self._send_batch(items))
            task.add_done_callback(lambda t: t.exception() if not t.cancelled() else None)

    async def _send_batch(
        self, items: list[tuple[str, dict[str, Any], asyncio.Future[RewardResult]]]
    ) -> None:
        assert isinstance(self.adapter, JsonAdapter)
        self._http()
        assert self._sem is not None
        self.counters["batches"] += 1
        c = self.config
        try:
            async with self._sem:
                last: Exception | None = None
                for attempt in range(c.retries + 1):
                    try:
                        call = self.adapter.batch_request([(k, d) for k, d, _ in items])
                        status, text, headers = await self._send(call, self._timeout())
                        results = self.adapter.batch_response(status, text, headers)
                        break
                    except Retryable as exc:
                        self.breaker.failure()
                        last = exc
                        log.warning("reward batch of %d, attempt %d failed: %s", len(items), attempt + 1, exc)
                        if attempt < c.retries:
                            self.meter.retries += 1
                            await asyncio.sleep(self._backoff(attempt, exc.retry_after))
                else:
                    raise RewardError(f"reward batch failed after {c.retries + 1} attempts: {last}")
            self.breaker.success()
            self._last_ok = time.monotonic()
            for (k, d, fut), r in zip(items, results, strict=True):
                if fut.done():
                    continue
                if isinstance(r, dict) and "result" in r:
                    fut.set_result(result_from_dict(r["result"]))
                else:  # this item's function failed: retry it alone
                    try:
                        fut.set_result(await self._with_retries(k, d, d.get("traj_id", k)))
                    except Exception as exc:
                        fut.set_exception(exc)
        except Exception as exc:
            for _, _, fut in items:
                if not fut.done():
                    fut.set_exception(exc if isinstance(exc, RewardError) else RewardError(str(exc)))

    def stats(self) -> dict[str, Any]:
        s: dict[str, Any] = self.meter.stats()
        s.update(dict(self.counters))
        s.update({"breaker_state": self.breaker.state, "breaker_opens": self.breaker.opens})
        return s
