"""One pull per node: engines on the same machine share a version through node-local memory.

``weight_store: {impl: node_cache, options: {store: {impl: mooncake, options: {...}}}}`` wraps any
store. When several engines of a node pull the same version, the first to take the version's lock
pulls it from the wrapped store and writes it once to ``cache_dir`` (default: a directory in
``/dev/shm``, the node's shared memory); the others wait for that lock and map the cached copy
instead of pulling again. A node's network moves each version once, and the CPU work of a pull
(transfer, decode, checksum) is done once, not once per engine.

- **Never wrong weights.** The cached copy is one flat file in the layout of the bucketed stores
  (:mod:`._layout`) with its manifest and per-bucket checksums, written under a temporary name and
  renamed; a reader checks every bucket before it hands out a tensor. A copy that is missing,
  truncated or fails a checksum is dropped and the version pulled from the wrapped store (counted in
  ``stats``).
- **Never a silent wait.** Waiting for another engine's pull is bounded by ``lock_timeout_s``; a
  leader that fails or dies releases the lock (an ``flock``, released by the kernel with the process)
  and the next engine pulls from the wrapped store itself.
- **Nothing left in shared memory.** The process that built the store (a run's driver) removes its
  directory when it closes; every other process that uses a cache holds a shared lock on its
  ``.users`` file and the last to close removes it (on nodes without the driver, and for a shared
  ``cache_key``); a store built later on the node removes directories whose builder died.
- Pushes, ``latest_version``, ``wait_for`` and ``subscribe`` go to the wrapped store unchanged; the
  cache keeps the newest ``keep_last`` versions it wrote (each the model's size in node memory).
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rollart_core.config import ComponentConfig
from rollart_core.errors import WeightSyncError
from rollart_weightsync._common import fill_into, wrapped_store
from rollart_weightsync._layout import Manifest, checksum, pack, seal, unpack

if TYPE_CHECKING:
    import torch

__all__ = ["NodeCacheWeightStore", "NodeCacheWeightStoreConfig"]
log = logging.getLogger(__name__)

DEFAULT_DIR = "/dev/shm/rollart-weights"


class NodeCacheWeightStoreConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    store: ComponentConfig
    """The store to wrap (``impl`` + ``options``)."""
    cache_dir: str = DEFAULT_DIR
    """A node-local directory every engine of the node reaches (the same path in each): shared
    memory (``/dev/shm``) by default. Each store keeps its versions in a directory of its own below."""
    cache_key: str | None = None
    """The name of that directory. Default: a fresh one per store built, which reaches the engines
    with the store object (how the pipeline hands it to them), so two runs never share versions.
    Processes that each build the store from this config share a cache only with the same key."""
    keep_last: int = Field(1, ge=1)
    """Cached versions kept; older ones are deleted after a newer one is written."""
    lock_timeout_s: float = Field(600.0, gt=0)
    """Longest wait for another engine's pull of the same version, then an error naming it."""
    bucket_mb: int = Field(64, ge=1)
    """Checksum granularity of the cached copy."""

    @model_validator(mode="after")
    def _no_nesting(self) -> NodeCacheWeightStoreConfig:
        if self.store.impl == "node_cache":
            raise ValueError("store: a node_cache store cannot wrap another node_cache store")
        return self


class NodeCacheWeightStore:
    """Wraps a weight store (see the module doc); only ``pull`` goes through the node's cache."""

    Config = NodeCacheWeightStoreConfig

    def __init__(self, config: NodeCacheWeightStoreConfig, *, inner: Any | None = None) -> None:
        self.config = config
        self.inner = wrapped_store(config.store) if inner is None else inner
        self.dir = Path(config.cache_dir) / (config.cache_key or f"{os.getpid()}-{uuid.uuid4().hex[:12]}")
        self._users: int | None = None  # this process's shared lock on ``.users`` (never pickled)
        self._builder = os.getpid()
        _sweep(Path(config.cache_dir))
        self.stats: dict[str, int] = {"inner_pulls": 0, "cache_hits": 0, "cache_rejected": 0}
        """This process's pulls: from the wrapped store, from the cache, cached copies refused."""

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_users": None}  # a file descriptor means nothing in another process

    # the cache -----------------------------------------------------------------------------------

    def _use(self) -> None:
        """Make the directory (again, if the driver removed it) and hold this process's user lock."""
        self.dir.mkdir(parents=True, exist_ok=True)
        if self._users is None:
            fd = os.open(self.dir / ".users", os.O_CREAT | os.O_RDWR, 0o600)
            fcntl.flock(fd, fcntl.LOCK_SH)
            self._users = fd

    def _paths(self, version: int) -> tuple[Path, Path, Path]:
        stem = self.dir / f"v{version:010d}"
        return stem.with_suffix(".bin"), stem.with_suffix(".json"), stem.with_suffix(".lock")

    def _lock(self, path: Path, version: int) -> int:
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
        deadline = time.monotonic() + self.config.lock_timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    raise WeightSyncError(
                        f"node cache {self.dir}: another engine's pull of version {version} held its "
                        f"lock for over lock_timeout_s={self.config.lock_timeout_s:g}"
                    ) from None
                time.sleep(0.005)  # a file lock has no waiter to notify: poll it

    def _read_cached(self, version: int) -> dict[str, torch.Tensor] | None:
        """The cached copy as tensors over a private mapping of the file, every bucket checked; None
        if there is none or it is damaged (then it is removed)."""
        data, meta, _ = self._paths(version)
        if not meta.is_file():
            return None
        import torch

        try:
            manifest = Manifest.from_bytes(meta.read_bytes(), f"node cache v{version}")
            if manifest.version != version or data.stat().st_size != manifest.total_bytes:
                raise WeightSyncError(f"node cache v{version}: size or version does not match its manifest")
            flat = torch.from_file(str(data), shared=False, size=manifest.total_bytes, dtype=torch.uint8)
            ranges = manifest.ranges()
            if len(ranges) != len(manifest.bucket_sums):
                raise WeightSyncError(f"node cache v{version}: bucket count does not match its manifest")
            for (s, e), want in zip(ranges, manifest.bucket_sums, strict=True):
                if checksum(flat[s:e], manifest.checksum) != want:
                    raise WeightSyncError(f"node cache v{version}: checksum mismatch in bytes {s}-{e}")
            return unpack(flat, manifest)
        except (OSError, RuntimeError, WeightSyncError, ValueError) as exc:
            self.stats["cache_rejected"] += 1
            for p in (meta, data):
                p.unlink(missing_ok=True)
            log.warning("node cache: dropped version %d (%s); pulling it again", version, exc)
            return None

    def _pull_into_cache(self, version: int) -> dict[str, torch.Tensor]:
        """Pull ``version`` from the wrapped store and cache it: laid out straight into a shared
        mapping of the cached file (one copy, no intermediate buffer), checksummed, committed."""
        import torch

        tensors = dict(self.inner.pull(version))
        self.stats["inner_pulls"] += 1
        tmp = self._paths(version)[0].with_suffix(f".tmp{os.getpid()}")

        def mapped(nbytes: int) -> torch.Tensor:
            with open(tmp, "wb") as f:  # reserved, not sparse: a full /dev/shm is an OSError here,
                if nbytes:  # not a SIGBUS in the copy below
                    os.posix_fallocate(f.fileno(), 0, nbytes)
            return torch.from_file(str(tmp), shared=True, size=nbytes, dtype=torch.uint8)

        try:
            flat, manifest = pack(tensors, version, self.config.bucket_mb << 20, "blake3", alloc=mapped)
            seal(flat, manifest)
            self._commit(version, tmp, manifest)
        # a full /dev/shm (or a mapping refused): each engine then pulls on its own, nothing is wrong
        except (OSError, RuntimeError) as exc:
            log.warning("node cache: could not cache version %d: %s", version, exc)
        finally:
            tmp.unlink(missing_ok=True)
        return tensors

    def _commit(self, version: int, tmp: Path, manifest: Manifest) -> None:
        data, meta, _ = self._paths(version)
        os.replace(tmp, data)
        tmp_meta = meta.with_suffix(f".tmp{os.getpid()}")
        tmp_meta.write_bytes(manifest.to_bytes())
        os.replace(tmp_meta, meta)  # the manifest last: its presence is the commit
        self._retain(version)

    def _retain(self, newest: int) -> None:
        cached = sorted(int(p.stem[1:]) for p in self.dir.glob("v*.json") if p.stem[1:].isdigit())
        for v in [v for v in cached if v < newest][: max(0, len(cached) - self.config.keep_last)]:
            for p in self._paths(v):
                p.unlink(missing_ok=True)  # a reader that mapped it keeps its pages

    # WeightStore ---------------------------------------------------------------------------------

    def pull(self, version: int, into: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        try:
            self._use()
        except OSError as exc:  # no node-local directory to share through: this engine pulls alone
            log.warning("node cache %s unusable (%s): pulling version %d directly", self.dir, exc, version)
            self.stats["inner_pulls"] += 1
            return dict(self.inner.pull(version, into))
        cached = self._read_cached(version)  # the common case after the first engine: no lock needed
        if cached is None:
            fd = self._lock(self._paths(version)[2], version)
            try:
                cached = self._read_cached(version)  # written while we waited
                if cached is None:
                    return fill_into(self._pull_into_cache(version), into)
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
        self.stats["cache_hits"] += 1
        return fill_into(cached, into)

    def push(self, version: int, tensors: Mapping[str, torch.Tensor]) -> Future[None]:
        fut: Future[None] = self.inner.push(version, tensors)
        return fut

    def latest_version(self) -> int | None:
        v: int | None = self.inner.latest_version()
        return v

    def wait_for(self, version: int, timeout: float | None = None) -> int:
        return int(self.inner.wait_for(version, timeout))

    def subscribe(self, callback: Callable[[int], None]) -> Callable[[], None]:
        unsubscribe: Callable[[], None] = self.inner.subscribe(callback)
        return unsubscribe

    def close(self) -> None:
        """Close the wrapped store and leave nothing in node memory: the store's builder (the run's
        driver, closing at the end of the run) removes its cache at once; any other process (an
        engine, a store built from a shared ``cache_key``) removes it if it is the last user."""
        fd, self._users = self._users, None
        builder = self._builder == os.getpid() and self.config.cache_key is None
        if fd is None and not builder and (self.dir / ".users").is_file():
            fd = os.open(self.dir / ".users", os.O_RDWR)
        try:
            if builder:  # engines still mapping a version keep its pages; a later pull re-pulls
                shutil.rmtree(self.dir, ignore_errors=True)
            elif fd is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # nobody else holds it
                    shutil.rmtree(self.dir, ignore_errors=True)
                except BlockingIOError:
                    pass  # another process still uses it and removes it when it closes
        finally:
            if fd is not None:
                os.close(fd)
        self.inner.close()


def _sweep(root: Path) -> None:
    """Remove the caches under ``root`` that a store built with a default key left behind when its
    builder died (a killed run), once no process uses them."""
    for d in root.glob("*-*"):
        pid = d.name.split("-", 1)[0]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        try:
            fd = os.open(d / ".users", os.O_CREAT | os.O_RDWR, 0o600)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            shutil.rmtree(d, ignore_errors=True)
            log.info("node cache: removed %s, left by a run that ended without closing it", d)
        except BlockingIOError:
            pass
        finally:
            os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
