"""Hosting a function runtime process: how the ``serverless`` executor starts, watches and stops
``rollart-reward serve``.

- :func:`serve_command`: the ``rollart-reward serve`` argv for a function and its scaling.
- :class:`ServeProcess`: one such child in its own process group (dies with its parent on Linux); reads
  the URL it prints, drains its output, stops it and any worker that outlives it (by PID, checked).
- :class:`RuntimeHost`: the Ray actor body that owns a :class:`ServeProcess` on its node.
- ``LocalHandle`` / ``RayHandle``: the executor's two ways to host it (a child of this process, or of
  a Ray actor on the CPU pool), with the same async ``start`` / ``wait_exit`` / ``alive`` / ``stop``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from rollart_core.errors import ConfigError, RewardError
from rollart_reward.runtime import API_KEY_ENV, ScalingConfig, is_loopback

if TYPE_CHECKING:
    from rollart_reward.serverless import ServerlessExecutorConfig

__all__ = ["LocalHandle", "RayHandle", "RuntimeHost", "ServeProcess", "serve_command"]

log = logging.getLogger(__name__)

_FLAGS = {  # ScalingConfig field -> ``rollart-reward serve`` flag
    "min_workers": "--min-workers",
    "max_workers": "--max-workers",
    "idle_timeout_s": "--idle-timeout",
    "idle_policy": "--idle-policy",
    "call_timeout_s": "--call-timeout",
    "max_queue": "--max-queue",
    "cache_size": "--cache-size",
    "max_body_bytes": "--max-body-bytes",
    "body_timeout_s": "--body-timeout",
    "max_batch": "--max-batch",
    "max_async_tasks": "--max-async-tasks",
    "faults": "--faults",
}


def serve_command(
    function: str, options: dict[str, Any], host: str, port: int, scaling: ScalingConfig
) -> list[str]:
    """``rollart-reward serve ...`` for this function and scaling (the token travels in the environment)."""
    import json

    exe = shutil.which("rollart-reward", path=os.path.dirname(sys.executable))
    argv = [exe] if exe else [sys.executable, "-m", "rollart_reward.cli"]
    argv += [
        "serve",
        "--function",
        function,
        "--options",
        json.dumps(options),
        "--host",
        host,
        "--port",
        str(port),
    ]
    for name, value in scaling.model_dump().items():
        argv += [_FLAGS[name], json.dumps(value) if isinstance(value, dict) else str(value)]
    return argv


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the parent dies (Linux), so a crashed host leaves no runtime."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class ServeProcess:
    """One ``rollart-reward serve`` child in its own process group; used in this process or in the actor."""

    def __init__(self, argv: list[str], api_key: str) -> None:
        self.argv = argv
        self.url = ""
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            env={**os.environ, API_KEY_ENV: api_key},
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        self._api_key = api_key

    @property
    def pid(self) -> int:
        return self.proc.pid

    def read_url(self, timeout: float) -> str:
        """Wait for ``serving NAME on URL``; kill the process and raise :class:`RewardError` otherwise."""
        assert self.proc.stdout is not None
        fd, buf, deadline = self.proc.stdout.fileno(), b"", time.monotonic() + timeout
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            ready = select.select([fd], [], [], max(left, 0))[0] if left > 0 else []
            chunk = os.read(fd, 4096) if ready else b""
            if not chunk:
                self.kill()
                why = "timed out" if left <= 0 or not ready else f"exited with {self.proc.returncode}"
                raise RewardError(
                    f"reward stage: the function runtime did not start ({why} after "
                    f"{timeout - max(left, 0):.1f}s; see its stderr): {' '.join(self.argv[:6])} ..."
                )
            buf += chunk
        line = buf.split(b"\n", 1)[0].decode(errors="replace")
        if not line.startswith("serving ") or " on http" not in line:
            self.kill()
            raise RewardError(
                f"reward stage: unexpected first line from the function runtime: {line[:300]!r}"
            )
        threading.Thread(
            target=self._drain, args=(fd,), daemon=True, name=f"rollart-serve-{self.pid}"
        ).start()
        self.url = line.rsplit(" ", 1)[-1]
        return self.url

    def _drain(self, fd: int) -> None:
        """Keep reading the child's stdout so it never blocks on a full pipe."""
        with contextlib.suppress(OSError):
            while chunk := os.read(fd, 65536):
                log.debug("reward runtime %d: %s", self.pid, chunk.decode(errors="replace").rstrip())

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_exit(self, timeout: float) -> bool:
        try:
            self.proc.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False

    def worker_pids(self) -> list[int]:
        """The runtime's template and worker PIDs (workers live in their own sessions)."""
        import httpx

        if not self.url or not self.alive():
            return []
        try:
            r = httpx.get(
                f"{self.url}/stats", headers={"Authorization": f"Bearer {self._api_key}"}, timeout=2
            )
            pids = r.json()["pids"]
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            log.warning("reward runtime %d: could not read its worker PIDs: %r", self.pid, exc)
            return []
        return [p for p in [pids.get("template"), *pids.get("workers", [])] if isinstance(p, int)]

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self, grace: float) -> None:
        """SIGTERM (the runtime stops its workers), then SIGKILL to the group; workers that outlive it
        (their own sessions) are waited for and killed by PID."""
        stragglers = self.worker_pids()
        if self.alive():
            self.proc.terminate()
            if not self.wait_exit(grace):
                log.warning(
                    "reward runtime %d did not stop within %.1fs: killing its process group", self.pid, grace
                )
        self.kill()
        deadline = time.monotonic() + grace
        for pid in stragglers:
            while _is_runtime_worker(pid) and time.monotonic() < deadline:
                time.sleep(0.02)  # they exit on their own once the runtime's socket is gone
            if _is_runtime_worker(pid):
                log.warning("reward runtime worker %d outlived its runtime: killing it", pid)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)


def _is_runtime_worker(pid: int) -> bool:
    """True while ``pid`` is a live (not zombie) ``rollart_reward._worker`` process: no stranger's PID is killed."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
    except (OSError, IndexError):
        return False
    return state != b"Z" and b"rollart_reward._worker" in cmdline


class RuntimeHost:
    """Ray actor body: owns one :class:`ServeProcess` on its node. Methods run one at a time."""

    def __init__(self) -> None:
        self.serve: ServeProcess | None = None

    def start(
        self,
        function: str,
        options: dict[str, Any],
        host: str,
        port: int,
        scaling: dict[str, Any],
        api_key: str,
        timeout: float,
    ) -> dict[str, Any]:
        import ray

        node_ip = ray.util.get_node_ip_address()
        argv = serve_command(
            function,
            options,
            node_ip if host == "node" else host,
            port,
            ScalingConfig.model_validate(scaling),
        )
        self.serve = ServeProcess(argv, api_key)
        return {"url": self.serve.read_url(timeout), "pid": self.serve.pid, "node_ip": node_ip}

    def wait_exit(self, timeout: float) -> bool:
        return self.serve is None or self.serve.wait_exit(timeout)

    def alive(self) -> bool:
        return self.serve is not None and self.serve.alive()

    def worker_pids(self) -> list[int]:
        return self.serve.worker_pids() if self.serve is not None else []

    def stop(self, grace: float) -> None:
        if self.serve is not None:
            self.serve.stop(grace)


class LocalHandle:
    """The runtime as a child of this process."""

    where = "local process"

    def __init__(
        self, c: ServerlessExecutorConfig, function: str, options: dict[str, Any], api_key: str
    ) -> None:
        if c.host == "node":
            raise ConfigError("serverless executor: host 'node' needs Ray (the runtime runs in a Ray actor)")
        self.c, self.function, self.options, self.api_key = c, function, options, api_key
        self.serve: ServeProcess | None = None

    async def start(self, port: int) -> dict[str, Any]:
        c = self.c
        self.serve = ServeProcess(
            serve_command(self.function, self.options, c.host, port, c.runtime), self.api_key
        )
        url = await asyncio.to_thread(self.serve.read_url, c.start_timeout_s)
        return {"url": url, "pid": self.serve.pid}

    async def wait_exit(self) -> None:
        assert self.serve is not None
        proc = self.serve.proc
        try:
            pidfd = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):  # no pidfd: a thread waits instead
            await asyncio.to_thread(proc.wait)
            return
        loop, exited = asyncio.get_running_loop(), asyncio.Event()
        loop.add_reader(pidfd, exited.set)
        try:
            await exited.wait()
        finally:
            loop.remove_reader(pidfd)
            os.close(pidfd)
        proc.wait()

    async def alive(self) -> bool:
        return self.serve is not None and self.serve.alive()

    def stop_sync(self) -> None:
        if self.serve is not None:
            self.serve.stop(self.c.stop_timeout_s)

    async def stop(self) -> None:
        await asyncio.to_thread(self.stop_sync)


class RayHandle:
    """The runtime as a child of a Ray actor on the CPU pool."""

    where = "Ray actor"

    def __init__(
        self, c: ServerlessExecutorConfig, function: str, options: dict[str, Any], api_key: str
    ) -> None:
        import ray

        self.ray = ray
        self.c, self.function, self.options, self.api_key = c, function, options, api_key
        opts: dict[str, Any] = {"num_cpus": c.num_cpus, "max_restarts": 0, "max_concurrency": 1}
        if c.pool:
            opts["resources"] = {c.pool: 0.001}
        # a Ray actor handle: Ray types `.remote` only on methods decorated with @ray.method, which
        # RuntimeHost's are not (this module imports Ray lazily), so its calls stay untyped
        self.actor: Any = ray.remote(**opts)(RuntimeHost).remote()

    async def start(self, port: int) -> dict[str, Any]:
        c = self.c
        try:
            info = await asyncio.wait_for(
                self.actor.start.remote(
                    self.function,
                    self.options,
                    c.host,
                    port,
                    c.runtime.model_dump(),
                    self.api_key,
                    c.start_timeout_s,
                ),
                c.start_timeout_s + 60,
            )  # + placement of the actor itself
        except Exception as exc:  # the actor could not be placed, or died: say so with the stage
            cause = getattr(exc, "cause", None)  # a RayTaskError carries what the actor raised
            if isinstance(cause, RewardError):
                raise cause from None
            raise RewardError(
                f"reward stage: the function runtime's Ray actor failed to start it: {exc!r}"
            ) from exc
        here = self.ray.util.get_node_ip_address()
        if is_loopback(c.host) and info["node_ip"] != here:
            self.stop_sync()
            raise RewardError(
                f"reward stage: the function runtime was placed on node {info['node_ip']} but binds "
                f"{c.host}, which this node ({here}) cannot reach: set host: node"
            )
        return info

    async def wait_exit(self) -> None:
        while True:
            try:
                if await self.actor.wait_exit.remote(0.5):
                    return
            except Exception as exc:  # the actor itself died: its runtime died with it (PDEATHSIG)
                log.warning("reward runtime's Ray actor is gone: %r", exc)
                return

    async def alive(self) -> bool:
        try:
            return bool(await self.actor.alive.remote())
        except Exception:
            return False

    def stop_sync(self) -> None:
        try:
            self.ray.get(
                self.actor.stop.remote(self.c.stop_timeout_s), timeout=self.c.stop_timeout_s * 2 + 10
            )
        except Exception as exc:
            log.warning("reward runtime's Ray actor did not stop cleanly (killing it): %r", exc)
        self.ray.kill(self.actor)

    async def stop(self) -> None:
        try:
            await asyncio.wait_for(
                self.actor.stop.remote(self.c.stop_timeout_s), self.c.stop_timeout_s * 2 + 10
            )
        except Exception as exc:
            log.warning("reward runtime's Ray actor did not stop cleanly (killing it): %r", exc)
        self.ray.kill(self.actor)
