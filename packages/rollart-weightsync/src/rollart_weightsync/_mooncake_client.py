"""The Mooncake store's config and this process's connection to the store: one client per endpoint,
shared by the store objects, and a dummy client's shared-memory transfer buffers."""

from __future__ import annotations

import os
import socket
import threading
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rollart_core.errors import WeightSyncError
from rollart_core.extras import require

if TYPE_CHECKING:
    import torch

__all__ = ["INSTALL", "MooncakeWeightStoreConfig", "force_tcp"]

INSTALL = (
    "pip install 'rollart-weightsync[mooncake]'  (CUDA)  or  'rollart-weightsync[mooncake-cpu]'  (no CUDA)"
)
_SHM_NOT_MAPPED = -600  # INVALID_PARAMS: a (restarted) real client does not map our shared memory


class MooncakeWeightStoreConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    master: str
    """``host:port`` of ``mooncake_master``'s RPC endpoint (see ``rollart-weightsync serve``)."""
    metadata_server: str = "P2PHANDSHAKE"
    """Transfer-engine metadata: ``P2PHANDSHAKE`` or ``http://host:port/metadata``."""
    protocol: Literal["auto", "tcp", "rdma"] = "auto"
    """``auto``: RDMA if ``rdma_devices`` is set, else TCP. ``MC_FORCE_TCP=1`` always means TCP."""
    rdma_devices: str = ""
    """Comma-separated RDMA NICs (e.g. ``mlx5_0,mlx5_1``); empty for TCP."""
    local_hostname: str = "127.0.0.1"
    """Address this client's transfer engine binds and advertises."""
    local_buffer_bytes: int = Field(16 << 20, ge=1 << 20)
    """Client staging buffer for manifests and the index (tensor data moves zero-copy)."""
    prefix: str = Field("rollart/weights", min_length=1, pattern=r"^[A-Za-z0-9_./-]+$")
    """Key namespace: one store (one writer) per prefix."""
    bucket_bytes: int = Field(32 << 20, ge=4096)
    """Size of one stored object; a version is streamed bucket by bucket."""
    batch_buckets: int = Field(4, ge=1)
    """Buckets per batched transfer call (pull memory for ``into=``: 2 staging buffers of bucket_bytes × this)."""
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """Convert floating tensors to this dtype on push (None: keep the trainer's dtype)."""
    checksum: Literal["blake3", "crc32", "sha256", "none"] = "blake3"
    """Per-bucket checksum verified on pull: blake3 (cryptographic, fastest here), crc32, sha256 or none."""
    keep_last: int = Field(2, ge=1)
    """Retention: committed versions kept; older ones' keys are deleted after a commit."""
    poll_s: float = Field(0.05, gt=0)
    """Polling period of ``wait_for`` and subscriptions."""
    push_retry_s: float = Field(20.0, ge=0)
    """How long a push retries failed puts (e.g. while the master notices a restarted holder)."""
    hard_pin: bool = True
    """Pin objects so the master's eviction never drops part of a committed version."""
    real_client: str | None = Field(None, pattern=r"^[^:\s]+:[0-9]{1,5}$")
    """``host:port`` of the holder run as Mooncake's real client on this host: join it as a dummy
    client over shared memory (see :mod:`rollart_weightsync.mooncake`). None: a regular TCP/RDMA client."""
    delta: bool = False
    """Store each version also as its difference from the previous push, and pull a newer version
    as deltas from the one this store object last pulled (full pulls where that cannot work). Costs
    one copy of the weights in the pusher's and in each puller's memory (see the README)."""


_CLIENTS: dict[tuple[Any, ...], Any] = {}
_CLIENTS_LOCK = threading.Lock()


def force_tcp() -> bool:
    """``MC_FORCE_TCP`` set to a true value: Mooncake must use TCP whatever the config says."""
    return os.environ.get("MC_FORCE_TCP", "").lower() in ("1", "true", "yes", "on")


def _resolve_protocol(cfg: MooncakeWeightStoreConfig) -> str:
    if force_tcp():
        return "tcp"
    if cfg.protocol == "auto":
        return "rdma" if cfg.rdma_devices else "tcp"
    return cfg.protocol


def _client(cfg: MooncakeWeightStoreConfig) -> Any:
    """One Mooncake client per process and endpoint (pickled copies in one process share it)."""
    protocol = _resolve_protocol(cfg)
    key = (cfg.master, cfg.metadata_server, protocol, cfg.rdma_devices, cfg.local_hostname, cfg.real_client)
    with _CLIENTS_LOCK:
        if key in _CLIENTS:
            return _CLIENTS[key]
        require("mooncake.store", INSTALL)
        from mooncake.store import MooncakeDistributedStore

        for what, addr in (("master", cfg.master), ("real client", cfg.real_client)):
            if addr is None:
                continue
            host, _, port = addr.rpartition(":")
            try:  # fail fast: setup() against a dead master retries for a long time
                socket.create_connection((host, int(port)), timeout=3).close()
            except (OSError, ValueError) as exc:
                raise WeightSyncError(f"mooncake {what} {addr!r} is not reachable: {exc}") from None
        c = MooncakeDistributedStore()
        if cfg.real_client:
            rc = c.setup_dummy(0, cfg.local_buffer_bytes, cfg.real_client)
        else:
            rc = c.setup(
                cfg.local_hostname,
                cfg.metadata_server,
                0,
                cfg.local_buffer_bytes,
                protocol,
                cfg.rdma_devices,
                cfg.master,
            )
        if rc != 0:
            raise WeightSyncError(
                f"mooncake client setup failed (code {rc}) for master {cfg.master}"
                + (f" through real client {cfg.real_client}" if cfg.real_client else "")
            )
        _CLIENTS[key] = c
        if cfg.real_client:
            _SHM[id(c)] = _ShmBuffers(c)
        return c


class _ShmBuffers:
    """Transfer buffers of a dummy client: shared memory segments that the real client maps.

    Mooncake only moves a dummy client's data to or from such segments, registered whole. A segment
    is allocated per size when none is free and goes back to the free list when the last tensor
    viewing it is gone (a pulled version's tensors included). Segments are kept for the process's
    life: Mooncake's Python API frees them only with the client."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self._free: dict[int, list[int]] = {}
        self._lock = threading.Lock()
        self.allocated = 0
        """Segments allocated so far (reuse keeps this at the number used at once)."""
        self.lost = False
        """The real client stopped mapping our segments (it was restarted): use a regular client."""

    def take(self, nbytes: int) -> torch.Tensor:
        import ctypes
        import weakref

        import torch

        if nbytes == 0:  # nothing to transfer (a version of empty tensors)
            return torch.empty(0, dtype=torch.uint8)
        with self._lock:
            free = self._free.get(nbytes)
            ptr = free.pop() if free else 0
        if not ptr:
            ptr = self._client.alloc_from_mem_pool(nbytes)
            if not ptr or self._client.register_buffer(ptr, nbytes) != 0:
                raise WeightSyncError(
                    f"mooncake dummy client could not get {nbytes} bytes of shared memory "
                    "registered with the real client (is /dev/shm large enough?)"
                )
            self.allocated += 1
        arr = (ctypes.c_uint8 * nbytes).from_address(ptr)
        weakref.finalize(arr, self._release, nbytes, ptr)  # the tensor below keeps arr alive
        return torch.frombuffer(arr, dtype=torch.uint8)

    def _release(self, nbytes: int, ptr: int) -> None:
        with self._lock:
            self._free.setdefault(nbytes, []).append(ptr)


_SHM: dict[int, _ShmBuffers] = {}


class _ShmLost(Exception):
    """A transfer of a dummy client failed because its real client does not map its segments."""
