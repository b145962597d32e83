"""Reference function runtime: serve any registered reward function over HTTP, with autoscaling.

A front server (aiohttp, bound to 127.0.0.1 by default) keeps a pool of worker processes
(:mod:`rollart_reward._worker`), each running one call at a time like a serverless instance. Under
load it spawns workers on demand (a *cold start*: process start + function load), up to
``max_workers``; workers idle for ``idle_timeout_s`` are stopped, down to ``min_workers`` (0 =
scale to zero). Results are cached by idempotency key, and concurrent calls with the same key share
one execution, so a retried call never runs the function twice.

Invocation shapes served:

- ``POST /invoke``: generic JSON, ``{"key", "trajectory"}`` → ``{"key", "result", "cold_start"}``;
  or ``{"items": [{"key", "trajectory"}, ...]}`` → ``{"results": [{"key", "result"|"error"}, ...]}``
- ``POST /2015-03-31/functions/{name}/invocations``: AWS Lambda-style (``X-Amz-Invocation-Type``
  ``RequestResponse`` or ``Event``; function errors are 200 with ``X-Amz-Function-Error``)
- ``POST /2023-03-30/functions/{name}/invocations``: Function Compute-style (``x-fc-invocation-type``
  ``Sync`` | ``Async`` with a caller-chosen ``x-fc-async-task-id``), and
  ``GET /2023-03-30/functions/{name}/async-tasks/{id}`` to poll an async task.
- ``GET /stats`` (workers, cold starts, concurrency, busy/provisioned time — provisioned is every
  worker's lifetime, cold start and keep-alive included — and per-request billed time, faults),
  ``GET /executions/{key}``, ``GET /healthz``; ``POST /admin/faults`` and ``POST /admin/reset``
  only with ``admin_key`` or ``admin=True``.

Access (closed by default, as the other rollart servers): every request except ``GET /healthz``
carries ``Authorization: Bearer <api_key>`` when an API key is set (401 otherwise). The admin
endpoints take their own credential, never the invoke key: with ``admin_key`` they need
``Bearer <admin_key>`` (an invoke key gets 403); without one, ``admin=True`` serves them on a
loopback bind to an open runtime only (with an ``api_key`` or beyond loopback: a start-up error
asking for an admin key). A request body not received within ``body_timeout_s`` gets 408.

The worker pool (forking, autoscaling, keep-alive) is :mod:`rollart_reward.pool`; this module is the
HTTP front, the idempotency cache and the invocation shapes. Its configuration is
:mod:`rollart_reward.runtime_config`; the access and request checks are
:mod:`rollart_reward.runtime_requests`.

Fault injection (tests): with a seeded RNG, a request gets 503 before running, 503 after running
(the result is cached, the response lost), a delay before responding, or a malformed JSON body.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import math
import random
import time
from typing import Any

from rollart_core.serving import is_loopback
from rollart_reward.metrics import UtilisationMeter
from rollart_reward.pool import Overloaded, WorkerPool
from rollart_reward.runtime_config import (
    ADMIN_KEY_ENV,
    API_KEY_ENV,
    FaultConfig,
    RuntimeConfig,
    ScalingConfig,
)
from rollart_reward.runtime_requests import (
    _MAX_KEY,
    BadRequest,
    KeyConflict,
    _kind,
    access_guard,
    body_digest,
    parse_call,
    read_json,
)

__all__ = ["ADMIN_KEY_ENV", "API_KEY_ENV", "FaultConfig", "FunctionRuntime", "RuntimeConfig", "ScalingConfig"]

log = logging.getLogger(__name__)


class _FunctionError(Exception):
    """The reward function raised inside a worker."""


class FunctionRuntime:
    """``await rt.start()`` → URL; ``await rt.stop()`` stops the server and every worker."""

    def __init__(self, config: RuntimeConfig | None = None) -> None:
        self.config = config or RuntimeConfig()
        if self.config.min_workers > self.config.max_workers:
            from rollart_core.errors import ConfigError

            raise ConfigError("runtime: min_workers must be <= max_workers")
        self.meter = UtilisationMeter(slots=None, billed=True)
        self.faults = self.config.faults
        self._rng = random.Random(self.faults.seed)
        self._cache: collections.OrderedDict[str, tuple[str, dict[str, Any]]] = collections.OrderedDict()
        """Idempotency key -> (digest of the trajectory, result)."""
        self._inflight: dict[str, tuple[str, asyncio.Future[dict[str, Any]]]] = {}
        self._executions: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._async_tasks: dict[str, tuple[str, asyncio.Task[Any]]] = {}
        """Running async calls by task id -> (digest, task); moved to ``_async_done`` when they finish."""
        self._async_done: collections.OrderedDict[str, tuple[str, tuple[int, dict[str, Any], bool]]] = (
            collections.OrderedDict()
        )
        self.counters = collections.Counter[str]()
        self.pool = WorkerPool(self.config, self.meter, self.counters)
        self._runner: Any = None
        self.url = ""

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> str:
        from aiohttp import web

        c = self.config
        if c.admin and c.admin_key is None and (c.api_key is not None or not is_loopback(c.host)):
            from rollart_core.errors import ConfigError

            raise ConfigError(
                "runtime: admin endpoints need an admin key (admin_key, --admin-key or "
                f"{ADMIN_KEY_ENV}) when the runtime has an api_key or binds beyond loopback: the "
                "invoke key never opens them"
            )
        if not is_loopback(c.host) and c.api_key is None:
            log.warning(
                "function runtime: bound to %s without an API key: anyone who reaches this address "
                "can call the function (set --api-key or %s)",
                c.host,
                API_KEY_ENV,
            )
        app = web.Application(client_max_size=c.max_body_bytes, middlewares=[access_guard(c, self.counters)])
        r = app.router
        r.add_post("/invoke", self._h_invoke)
        r.add_post("/2015-03-31/functions/{name}/invocations", self._h_lambda)
        r.add_post("/2023-03-30/functions/{name}/invocations", self._h_fc)
        r.add_get("/2023-03-30/functions/{name}/async-tasks/{task}", self._h_fc_poll)
        r.add_get("/stats", self._h_stats)
        r.add_get("/executions/{key}", self._h_executions)
        r.add_get("/healthz", self._h_healthz)
        if self.config.admin_enabled:
            r.add_post("/admin/faults", self._h_faults)
            r.add_post("/admin/reset", self._h_reset)
        try:
            await self.pool.start()
            self._runner = web.AppRunner(app, access_log=None)
            await self._runner.setup()
            site = web.TCPSite(self._runner, self.config.host, self.config.port)
            await site.start()
        except BaseException:  # the template, its socket directory and the server go with the error
            await self.stop()
            raise
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://{self.config.host}:{port}"
        return self.url

    async def stop(self) -> None:
        for t in [task for _, task in self._async_tasks.values()]:
            t.cancel()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self.pool.stop()

    # ---------------------------------------------------------------- execution
    async def execute(
        self, key: str | None, trajectory: dict[str, Any], digest: str | None = None
    ) -> tuple[dict[str, Any], bool]:
        """Run (or join, or replay) one call → (result dict, served by a fresh worker).

        A key's cached result (and a running call under it) is bound to ``digest``, the hash of the
        trajectory it was computed from: the same key with another trajectory raises
        :class:`KeyConflict` (409) instead of replaying, so no caller can pre-seed a result."""
        if key is not None:
            digest = digest or body_digest(trajectory)
            if key in self._cache:
                cached_digest, result = self._cache[key]
                if cached_digest != digest:
                    raise KeyConflict(key)
                self.counters["cache_hits"] += 1
                self._cache.move_to_end(key)
                return result, False
            if key in self._inflight:
                running_digest, running = self._inflight[key]
                if running_digest != digest:
                    raise KeyConflict(key)
                self.counters["joined_inflight"] += 1
                return await asyncio.shield(running), False
            fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
            self._inflight[key] = (digest, fut)
        try:
            result, cold = await self._run(key, trajectory)
        except BaseException as exc:
            if key is not None:
                self._inflight.pop(key, None)
                if not fut.done():
                    fut.set_exception(exc if isinstance(exc, Exception) else RuntimeError("cancelled"))
                    fut.exception()  # mark retrieved
            raise
        if key is not None:
            self._inflight.pop(key, None)
            fut.set_result(result)
            if self.config.cache_size:
                assert digest is not None
                self._cache[key] = (digest, result)
                while len(self._cache) > self.config.cache_size:
                    self._cache.popitem(last=False)
        return result, cold

    async def _run(self, key: str | None, trajectory: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        t_enq = time.monotonic()
        self.meter.enter()
        try:
            w = await self.pool.acquire()
            queue_s = time.monotonic() - t_enq
            cold = w.calls == 0
            w.calls += 1
            if key is not None:
                self._executions[key] = self._executions.get(key, 0) + 1
                while len(self._executions) > max(self.config.cache_size, 1):
                    self._executions.popitem(last=False)
            self.counters["executions"] += 1
            t0 = time.monotonic()
            try:
                reply = await w.call(trajectory, self.config.call_timeout_s)
            except BaseException:
                busy = time.monotonic() - t0
                self.meter.record(
                    busy_s=busy,
                    queue_s=queue_s,
                    ok=False,
                    cold=False,
                    billed_s=math.ceil(busy * 1000) / 1000 + (w.init_s if cold else 0.0),
                )
                await self.pool.retire(w)
                raise
            busy = float(reply.get("busy_s", time.monotonic() - t0))
            billed = math.ceil(busy * 1000) / 1000 + (w.init_s if cold else 0.0)  # per-request bill
            self.meter.record(busy_s=busy, queue_s=queue_s, ok="error" not in reply, billed_s=billed)
            self.pool.release(w)
        finally:
            self.meter.leave()
        if "error" in reply:
            raise _FunctionError(reply["error"])
        return reply["result"], cold

    # ---------------------------------------------------------------- faults
    def _draw(self) -> str | None:
        f = self.faults
        x = self._rng.random()
        for name, rate in (
            ("error_before", f.error_before),
            ("error_after", f.error_after),
            ("delay", f.delay),
            ("malformed", f.malformed),
        ):
            if x < rate:
                self.counters[f"fault_{name}"] += 1
                return name
            x -= rate
        return None

    # ---------------------------------------------------------------- handlers
    async def _invoke_one(
        self, key: str | None, traj: Any, digest: str | None = None
    ) -> tuple[int, dict[str, Any], bool]:
        try:
            result, cold = await self.execute(key, traj, digest)
            return 200, {"key": key, "result": result, "cold_start": cold}, cold
        except _FunctionError as exc:
            self.counters["function_errors"] += 1
            return 500, {"key": key, "error": str(exc)}, False
        except KeyConflict:
            self.counters["key_conflicts"] += 1
            return (
                409,
                {"key": key, "error": "idempotency key already used with a different trajectory"},
                False,
            )
        except Overloaded:
            self.counters["throttled"] += 1
            return 429, {"key": key, "error": "too many queued calls"}, False
        except TimeoutError:
            return 504, {"key": key, "error": "function timed out"}, False
        except (RuntimeError, ValueError, KeyError) as exc:
            return 502, {"key": key, "error": f"worker failure: {exc}"}, False

    async def _respond(
        self,
        status: int,
        body: dict[str, Any],
        cold: bool,
        fault: str | None,
        headers: dict[str, str] | None = None,
    ) -> Any:
        from aiohttp import web

        headers = {**(headers or {}), **_status_headers(status)}
        if cold:
            headers["X-Rollart-Cold-Start"] = "1"
        if fault == "error_after":
            return web.json_response({"error": "injected fault (after execution)"}, status=503)
        if fault == "delay":
            await asyncio.sleep(self.faults.delay_s)
        if fault == "malformed" and status == 200:
            return web.Response(
                text='{"result": {"score": 1.0, "det', content_type="application/json", headers=headers
            )
        return web.json_response(body, status=status, headers=headers)

    async def _h_invoke(self, request: Any) -> Any:
        from aiohttp import web

        self.counters["requests"] += 1
        body = await read_json(request, self.config)
        if isinstance(body, dict) and "items" in body:
            items = body["items"]
            if not isinstance(items, list):
                raise BadRequest(400, f"'items' must be a list, got {_kind(items)}")
            if len(items) > self.config.max_batch:
                raise BadRequest(413, f"{len(items)} items exceed the batch limit of {self.config.max_batch}")
            calls = [parse_call(item, request, f"items[{i}]") for i, item in enumerate(items)]
        else:
            calls = None
            key, trajectory, digest = parse_call(body, request)
        fault = self._draw()
        if fault == "error_before":
            return web.json_response({"error": "injected fault"}, status=503)
        if calls is not None:
            outs = await asyncio.gather(*(self._invoke_one(k, t, d) for k, t, d in calls))
            return await self._respond(200, {"results": [o[1] for o in outs]}, any(o[2] for o in outs), fault)
        status, out, cold = await self._invoke_one(key, trajectory, digest)
        return await self._respond(status, out, cold, fault)

    async def _h_lambda(self, request: Any) -> Any:
        from aiohttp import web

        self.counters["requests"] += 1
        key, trajectory, digest = parse_call(await read_json(request, self.config), request)
        invocation = request.headers.get("X-Amz-Invocation-Type", "RequestResponse")
        if invocation not in ("RequestResponse", "Event"):
            raise BadRequest(
                400, f"X-Amz-Invocation-Type must be RequestResponse or Event, got {invocation!r}"
            )
        fault = self._draw()
        if fault == "error_before":
            return web.json_response({"Type": "Service", "message": "injected fault"}, status=503)
        if invocation == "Event":
            if key is None:
                return web.json_response({"message": "Event invocations need a key"}, status=400)
            status = self._submit_async(f"event:{key}", key, trajectory, digest)
            if status != 202:
                return web.json_response(
                    {"message": _ASYNC_REFUSED[status]}, status=status, headers=_status_headers(status)
                )
            return web.Response(status=202)
        status, out, cold = await self._invoke_one(key, trajectory, digest)
        if status == 500:
            return web.json_response(
                {"errorMessage": out["error"], "errorType": "Unhandled"},
                status=200,
                headers={"X-Amz-Function-Error": "Unhandled"},
            )
        if status != 200:
            return web.json_response(
                {"message": out["error"]}, status=status, headers=_status_headers(status)
            )
        return await self._respond(200, out["result"], cold, fault)

    async def _h_fc(self, request: Any) -> Any:
        from aiohttp import web

        self.counters["requests"] += 1
        key, trajectory, digest = parse_call(await read_json(request, self.config), request)
        invocation = request.headers.get("x-fc-invocation-type", "Sync")
        if invocation not in ("Sync", "Async"):
            raise BadRequest(400, f"x-fc-invocation-type must be Sync or Async, got {invocation!r}")
        task_id = request.headers.get("x-fc-async-task-id")
        if invocation == "Async" and (not task_id or len(task_id) > _MAX_KEY):
            return web.json_response(
                {"Code": "MissingTaskId", "Message": f"x-fc-async-task-id (1 to {_MAX_KEY} characters)"},
                status=400,
            )
        fault = self._draw()
        if fault == "error_before":
            return web.json_response({"Code": "ServiceUnavailable", "Message": "injected fault"}, status=503)
        if invocation == "Async":
            assert task_id is not None
            # re-submitting a task id with the same body is a no-op (idempotent); another body is a 409
            status = self._submit_async(task_id, key or task_id, trajectory, digest)
            if status != 202:
                return web.json_response(
                    {"Code": "Refused", "Message": _ASYNC_REFUSED[status]},
                    status=status,
                    headers=_status_headers(status),
                )
            return web.Response(status=202, headers={"x-fc-async-task-id": task_id})
        status, out, cold = await self._invoke_one(key, trajectory, digest)
        if status != 200:
            return web.json_response(
                {"Code": "FunctionError", "Message": out["error"]},
                status=status if status != 500 else 200,
                headers={"x-fc-error-type": "UnhandledInvocationError"}
                if status == 500
                else _status_headers(status),
            )
        return await self._respond(200, out["result"], cold, fault)

    def _submit_async(self, task_id: str, key: str, trajectory: dict[str, Any], digest: str) -> int:
        """Start an async call under ``task_id`` → 202, or 409 (the id is held by another body), or 429
        (``max_async_tasks`` running). A finished task is kept for polling until evicted (oldest first)."""
        known = self._async_tasks.get(task_id) or self._async_done.get(task_id)
        if known is not None:
            return 202 if known[0] == digest else 409
        if len(self._async_tasks) >= self.config.max_async_tasks:
            self.counters["throttled"] += 1
            return 429
        task = asyncio.create_task(self._invoke_one(key, trajectory, digest))
        self._async_tasks[task_id] = (digest, task)
        task.add_done_callback(lambda t: self._async_finished(task_id, digest, t))
        return 202

    def _async_finished(self, task_id: str, digest: str, task: asyncio.Task[Any]) -> None:
        self._async_tasks.pop(task_id, None)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:  # _invoke_one maps every failure it expects; anything else is a bug: say so
            log.error("function runtime: async task %s failed: %r", task_id, exc)
            out: tuple[int, dict[str, Any], bool] = (
                502,
                {"key": task_id, "error": f"runtime failure: {exc!r}"},
                False,
            )
        else:
            out = task.result()
        self._async_done[task_id] = (digest, out)
        while (
            len(self._async_done) + len(self._async_tasks) > self.config.max_async_tasks and self._async_done
        ):
            self._async_done.popitem(last=False)

    async def _h_fc_poll(self, request: Any) -> Any:
        from aiohttp import web

        task_id = request.match_info["task"]
        if task_id in self._async_tasks:
            return web.json_response({"taskId": task_id, "status": "Running"})
        done = self._async_done.get(task_id)
        if done is None:
            return web.json_response({"Code": "AsyncTaskNotFound", "Message": task_id}, status=404)
        status, out, cold = done[1]
        if status == 200:
            return web.json_response(
                {
                    "taskId": task_id,
                    "status": "Succeeded",
                    "returnPayload": json.dumps(out["result"]),
                    "coldStart": cold,
                }
            )
        return web.json_response({"taskId": task_id, "status": "Failed", "errorMessage": out["error"]})

    def stats(self) -> dict[str, Any]:
        s: dict[str, Any] = self.meter.stats(provisioned_extra=self.pool.live_provisioned_s())
        execs = list(self._executions.values())
        s.update(
            {
                **self.pool.stats(),
                "max_executions_per_key": max(execs, default=0),
                "keys_executed_more_than_once": sum(1 for n in execs if n > 1),
                "async_tasks_running": len(self._async_tasks),
                "async_tasks_held": len(self._async_done),
                "cache_entries": len(self._cache),
                **dict(self.counters),
            }
        )
        return s

    async def _h_healthz(self, request: Any) -> Any:
        from aiohttp import web

        return web.json_response({"ok": True})

    async def _h_stats(self, request: Any) -> Any:
        from aiohttp import web

        return web.json_response(self.stats())

    async def _h_executions(self, request: Any) -> Any:
        from aiohttp import web

        key = request.match_info["key"]
        return web.json_response({"key": key, "executions": self._executions.get(key, 0)})

    async def _h_faults(self, request: Any) -> Any:
        from aiohttp import web
        from pydantic import ValidationError

        try:
            self.faults = FaultConfig.model_validate(await read_json(request, self.config))
        except ValidationError as exc:
            raise BadRequest(400, f"fault config: {exc}") from None
        self._rng = random.Random(self.faults.seed)
        return web.json_response(self.faults.model_dump())

    async def _h_reset(self, request: Any) -> Any:
        from aiohttp import web

        self.meter.reset()
        self.counters.clear()
        self.pool.reset()
        self._cache.clear()
        self._executions.clear()
        return web.json_response({"ok": True})


_ASYNC_REFUSED = {409: "task id already used with a different trajectory", 429: "too many async tasks held"}


def _status_headers(status: int) -> dict[str, str]:
    return {"Retry-After": "1"} if status in (429, 503) else {}
