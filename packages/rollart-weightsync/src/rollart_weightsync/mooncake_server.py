"""MooncakeStoreServer: runs ``mooncake_master`` and a holder process that owns the store's memory.

Mooncake keeps objects in memory that clients contribute (their "global segment") and drops them
when that client exits, so the pusher and pullers contribute nothing and a long-lived holder
contributes ``segment_bytes``. Both processes bind 127.0.0.1 by default, on ports found free at
start-up, and are stopped by PID.

    with MooncakeStoreServer(MooncakeServerConfig(segment_bytes=1 << 30)) as server:
        store = MooncakeWeightStore(server.store_config(bucket_bytes=16 << 20))

With ``shared_memory=True`` the holder is Mooncake's standalone real client (``mooncake_client``):
it still serves every machine over TCP/RDMA, and clients on its host that get ``real_client`` in
their config (``store_config`` sets it) join it as dummy clients whose transfers are memcpys in
shared memory.

``rollart-weightsync serve`` runs the same in the foreground.
"""

from __future__ import annotations

import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from rollart_core.errors import WeightSyncError
from rollart_core.extras import require
from rollart_core.serving import free_port
from rollart_weightsync.mooncake import INSTALL, MooncakeWeightStoreConfig, force_tcp

__all__ = ["MooncakeServerConfig", "MooncakeStoreServer", "free_port"]

log = logging.getLogger(__name__)


class MooncakeServerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    host: str = "127.0.0.1"
    """Address the master and the holder bind (loopback unless the store serves other machines)."""
    rpc_port: int | None = Field(None, ge=1, le=65535)
    """Master RPC port; None: a free port chosen at start."""
    metrics_port: int | None = Field(None, ge=1, le=65535)
    """Master HTTP metrics port; None: a free port chosen at start."""
    segment_bytes: int = Field(1 << 30, ge=16 << 20)
    """Memory the holder contributes: must fit ``keep_last + 1`` versions at the pushed dtype."""
    protocol: str = "tcp"
    """Holder transfer protocol (``tcp`` or ``rdma``; ``MC_FORCE_TCP=1`` forces TCP)."""
    rdma_devices: str = ""
    client_ttl_s: int = Field(3, ge=1)
    """Seconds without heartbeat before the master drops a client's segment (a dead holder)."""
    lease_ttl_ms: int = Field(5000, ge=100)
    """Read lease: a key being read is not deleted by retention for this long."""
    startup_timeout_s: float = Field(60.0, gt=0)
    log_dir: Path | None = None
    """Where master and holder logs go; None: a temporary directory, removed on stop."""
    shared_memory: bool = False
    """Run the holder as Mooncake's real client so same-host clients reach it through shared memory."""
    real_client_threads: int = Field(2, ge=1)
    """Service threads of the real client (``shared_memory`` only)."""


class MooncakeStoreServer:
    """Context manager (or :meth:`start` / :meth:`stop`) for a master + holder pair."""

    Config = MooncakeServerConfig

    def __init__(self, config: MooncakeServerConfig | None = None) -> None:
        self.config = config or MooncakeServerConfig()
        self.master: subprocess.Popen[bytes] | None = None
        self.holder: subprocess.Popen[bytes] | None = None
        self.rpc_port: int | None = None
        self.metrics_port: int | None = None
        self.real_client_port: int | None = None
        self._tmp: str | None = None

    @property
    def master_address(self) -> str:
        if self.rpc_port is None:
            raise WeightSyncError("mooncake server not started")
        return f"{self.config.host}:{self.rpc_port}"

    def store_config(self, **options: Any) -> MooncakeWeightStoreConfig:
        """A :class:`MooncakeWeightStoreConfig` pointing at this server."""
        options.setdefault("local_hostname", self.config.host)
        if self.config.shared_memory:
            options.setdefault("real_client", f"{self.config.host}:{self.real_client_port}")
        return MooncakeWeightStoreConfig(master=self.master_address, **options)

    def __enter__(self) -> MooncakeStoreServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _log_path(self, name: str) -> Path:
        if self.config.log_dir is not None:
            self.config.log_dir.mkdir(parents=True, exist_ok=True)
            return self.config.log_dir / name
        if self._tmp is None:
            self._tmp = tempfile.mkdtemp(prefix="rollart-mooncake-")
        return Path(self._tmp) / name

    def start(self) -> None:
        require("mooncake.store", INSTALL)
        c = self.config
        binary = _binary("mooncake_master")
        self.rpc_port = c.rpc_port or free_port(c.host)
        self.metrics_port = c.metrics_port or free_port(c.host)
        cmd = [
            binary,
            f"-rpc_port={self.rpc_port}",
            f"-rpc_address={c.host}",
            f"-metrics_port={self.metrics_port}",
            f"-metrics_host={c.host}",
            f"-client_ttl={c.client_ttl_s}",
            f"-default_kv_lease_ttl={c.lease_ttl_ms}",
        ]
        try:
            with open(self._log_path("master.log"), "ab") as logf:
                self.master = subprocess.Popen(
                    cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
                )
            self._wait_port(self.rpc_port)
            self.start_holder()
        except BaseException:
            self.stop()
            raise
        log.info(
            "mooncake store at %s (master pid %d, holder pid %d)",
            self.master_address,
            self.master.pid,
            self.holder.pid if self.holder else -1,
        )

    def _wait_port(
        self, port: int, proc: subprocess.Popen[bytes] | None = None, name: str = "master"
    ) -> None:
        proc = proc if proc is not None else self.master
        what = "mooncake_master" if name == "master" else f"mooncake {name}"
        deadline = time.monotonic() + self.config.startup_timeout_s
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise WeightSyncError(
                    f"{what} exited with {proc.returncode}; see {self._log_path(name + '.log')}"
                )
            try:
                socket.create_connection((self.config.host, port), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.05)
        raise WeightSyncError(
            f"{what} did not listen on {self.config.host}:{port} within {self.config.startup_timeout_s} s"
        )

    def start_holder(self) -> None:
        """Start the holder and wait for it to contribute its segment."""
        c = self.config
        if c.shared_memory:
            self._start_real_client()
            return
        cmd = [
            sys.executable,
            "-m",
            "rollart_weightsync.mooncake_server",
            self.master_address,
            str(c.segment_bytes),
            c.host,
            c.protocol,
            c.rdma_devices,
        ]
        with open(self._log_path("holder.log"), "ab") as logf:
            self.holder = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=logf, stdin=subprocess.DEVNULL)
        assert self.holder.stdout is not None
        deadline = time.monotonic() + c.startup_timeout_s
        line = b""
        while time.monotonic() < deadline and b"\n" not in line:
            if self.holder.poll() is not None:
                break
            ready, _, _ = select.select([self.holder.stdout], [], [], 0.1)
            if ready:
                line += os.read(self.holder.stdout.fileno(), 256)
        if not line.startswith(b"READY"):
            raise WeightSyncError(
                f"mooncake store holder did not start (said {line!r}, exit code "
                f"{self.holder.poll()}); see {self._log_path('holder.log')}"
            )

    def _start_real_client(self) -> None:
        """The holder as ``mooncake_client``: it mounts its segment, then listens (on the same port
        after a restart, so dummy clients find it again)."""
        c = self.config
        protocol = "tcp" if force_tcp() else c.protocol
        self.real_client_port = self.real_client_port or free_port(c.host)
        cmd = [
            _binary("mooncake_client"),
            f"-host={c.host}",
            f"-port={self.real_client_port}",
            f"-master_server_address={self.master_address}",
            "-metadata_server=P2PHANDSHAKE",
            f"-global_segment_size={c.segment_bytes}",
            f"-protocol={protocol}",
            f"-device_names={c.rdma_devices}",
            f"-threads={c.real_client_threads}",
        ]
        with open(self._log_path("holder.log"), "ab") as logf:
            self.holder = subprocess.Popen(
                cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        self._wait_port(self.real_client_port, self.holder, "holder")

    def stop_holder(self, kill: bool = False) -> None:
        _stop(self.holder, kill=kill)
        self.holder = None

    def restart_holder(self) -> None:
        """Kill the holder (all stored versions are lost) and start a fresh one."""
        self.stop_holder(kill=True)
        self.start_holder()

    def stop(self) -> None:
        self.stop_holder()
        _stop(self.master)
        self.master = None
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None


def _binary(name: str) -> str:
    found = shutil.which(name, path=os.path.dirname(sys.executable)) or shutil.which(name)
    if found is None:
        raise WeightSyncError(f"{name} not found next to {sys.executable} nor on PATH ({INSTALL})")
    return found


def _stop(proc: subprocess.Popen[bytes] | None, kill: bool = False) -> None:
    if proc is None or proc.poll() is not None:
        if proc is not None and proc.stdout is not None:
            proc.stdout.close()
        return
    proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
    if proc.stdout is not None:
        proc.stdout.close()


def _holder_main(master: str, segment_bytes: int, host: str, protocol: str, rdma_devices: str) -> int:
    """Contribute ``segment_bytes`` to the store and stay alive until SIGTERM/SIGINT."""
    import threading

    from mooncake.store import MooncakeDistributedStore

    stopping = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stopping.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if force_tcp():
        protocol = "tcp"
    store = MooncakeDistributedStore()
    rc = store.setup(host, "P2PHANDSHAKE", segment_bytes, 16 << 20, protocol, rdma_devices, master)
    if rc != 0:
        print(f"FAILED setup code {rc}", flush=True)
        return 1
    print("READY", flush=True)
    stopping.wait()
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(
        _holder_main(
            sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5] if len(sys.argv) > 5 else ""
        )
    )
