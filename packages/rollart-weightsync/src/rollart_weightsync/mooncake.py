"""MooncakeWeightStore: versioned weights in a Mooncake distributed store (TCP here, RDMA where set).

Keys under ``<prefix>/``::

    v0000000003/b00000 … b000NN   buckets: the version's flat byte stream cut into ``bucket_bytes``
    v0000000003/d00000 … d0000MM   with ``delta=True``: the delta from the previous push, in chunks
    v0000000003/manifest          tensor layout + bucket checksums, written LAST (the commit)
    index                         {"latest", "versions", "garbage"}: what ``latest_version`` reads

A pusher (the trainer) and pullers (inference workers) are Mooncake clients that contribute no
memory; the store's memory is the global segment of a long-lived holder process
(:class:`~rollart_weightsync.mooncake_server.MooncakeStoreServer`), because Mooncake drops the
objects of a client that exits. One writer per ``prefix`` is assumed (the trainer's rank 0).

Two ways to reach the holder:

- a regular client (``real_client=None``): transfers go through Mooncake's transfer engine, TCP or
  RDMA, from any machine;
- on the holder's own host, a *dummy* client of the holder run as Mooncake's standalone real client
  (``MooncakeServerConfig(shared_memory=True)`` sets ``real_client``): this process's transfer
  buffers are shared memory that the holder maps, so a put or get is one memcpy inside the holder
  instead of a TCP stream through the loopback device.

The object is picklable: a copy sent to a Ray actor or a vLLM worker reconnects lazily.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from rollart_core.errors import ConfigError, WeightSyncError
from rollart_weightsync import _layout
from rollart_weightsync._common import PushWatchMixin, check_into, fill_into
from rollart_weightsync._delta import DeltaReader, DeltaWriter, new_stats
from rollart_weightsync._mooncake_client import (
    _SHM,
    _SHM_NOT_MAPPED,
    MooncakeWeightStoreConfig,
    _client,
    _resolve_protocol,
    _ShmLost,
)

# re-exported: mooncake_server imports these from here
from rollart_weightsync._mooncake_client import INSTALL as INSTALL
from rollart_weightsync._mooncake_client import force_tcp as force_tcp
from rollart_weightsync._mooncake_delta import MooncakeDeltaMixin

if TYPE_CHECKING:
    import torch

__all__ = ["MooncakeWeightStore", "MooncakeWeightStoreConfig"]

log = logging.getLogger(__name__)
_NOT_FOUND = -704


class _Packed:
    """How much of a push's flat buffer is final: the caller packs while the commit puts the
    buckets already packed and checksums them."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._bytes = 0
        self._error: BaseException | None = None

    def advance(self, nbytes: int) -> None:
        with self._cv:
            self._bytes = max(self._bytes, nbytes)
            self._cv.notify_all()

    def fail(self, exc: BaseException) -> None:
        with self._cv:
            self._error = exc
            self._cv.notify_all()

    def wait(self, nbytes: int) -> None:
        with self._cv:
            self._cv.wait_for(lambda: self._bytes >= nbytes or self._error is not None)
            if self._bytes < nbytes:
                raise WeightSyncError(f"packing the pushed tensors failed: {self._error!r}")


class MooncakeWeightStore(MooncakeDeltaMixin, PushWatchMixin):
    """See the module docstring. ``push`` returns at once; ``pull`` streams bucket by bucket;
    ``close`` finishes queued pushes (the process-wide client stays for other store objects)."""

    Config = MooncakeWeightStoreConfig

    def __init__(self, config: MooncakeWeightStoreConfig | None = None, **options: Any) -> None:
        if config is None:
            config = MooncakeWeightStoreConfig(**options)
        elif options:
            raise ConfigError(f"give either a config or options, not both ({sorted(options)})")
        self.config = config
        self._init_push_watch("mooncake", config.poll_s)
        self._index_lock = threading.Lock()
        self._spare: torch.Tensor | None = None
        """The flat buffer of the last committed push, reused by the next push of the same size."""
        self._spare_lock = threading.Lock()
        self.stats = {"pushes": 0, "pulls": 0, "refetches": 0, "push_retries": 0, "shm_fallbacks": 0}
        self.stats.update(new_stats())
        self._writer = DeltaWriter() if config.delta else None
        self._reader = DeltaReader(self.stats, f"mooncake store {config.prefix!r}") if config.delta else None
        self._base_flat: torch.Tensor | None = None
        """With deltas: the flat buffer of the last committed push, which the writer holds (not reused)."""
        self._pending_sums: dict[str, str] | None = None
        """With deltas: the checksums of the version being committed, for the writer to hold."""

    def __getstate__(self) -> dict[str, Any]:  # threads and the client stay behind
        return {"config": self.config}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["config"])  # type: ignore[misc]

    def _conn(self) -> Any:
        """This process's client: the dummy client while the real client maps our shared memory,
        else (no ``real_client``, or it was restarted) a regular TCP/RDMA client."""
        c = _client(self.config)
        shm = _SHM.get(id(c))
        if shm is not None and shm.lost:
            return _client(self.config.model_copy(update={"real_client": None}))
        return c

    def _shm_lost(self, c: Any, what: str) -> None:
        _SHM[id(c)].lost = True
        self.stats["shm_fallbacks"] += 1
        log.warning(
            "mooncake real client %s no longer maps this process's shared memory (restarted?); "
            "%s and later transfers go over %s",
            self.config.real_client,
            what,
            _resolve_protocol(self.config),
        )

    # keys ------------------------------------------------------------------------------------

    def _vkey(self, version: int) -> str:
        return f"{self.config.prefix}/v{version:010d}"

    def bucket_key(self, version: int, i: int) -> str:
        return f"{self._vkey(version)}/b{i:05d}"

    def manifest_key(self, version: int) -> str:
        return f"{self._vkey(version)}/manifest"

    @property
    def index_key(self) -> str:
        return f"{self.config.prefix}/index"

    def _rcfg(self) -> Any:
        from mooncake.store import ReplicateConfig

        r = ReplicateConfig()
        r.with_hard_pin = self.config.hard_pin
        return r

    # push ------------------------------------------------------------------------------------

    def push(self, version: int, tensors: Mapping[str, torch.Tensor]) -> Future[None]:
        if version < 0:
            raise WeightSyncError(f"version must be >= 0, got {version}")
        import torch

        dtype = getattr(torch, self.config.dtype) if self.config.dtype else None
        with self._spare_lock:
            spare, self._spare = self._spare, None
        shm = _SHM.get(id(self._conn()))
        flat, manifest, srcs = _layout.plan(
            tensors,
            version,
            self.config.bucket_bytes,
            self.config.checksum,
            dtype,
            spare,
            alloc=shm.take if shm is not None else None,
        )
        # the copy into the push buffer happens here, before push returns (the caller may change the
        # tensors afterwards), while the commit already puts the buckets packed so far
        packed = _Packed()
        future = self._submit(lambda: self._commit(flat, manifest, packed))
        try:
            _layout.fill(flat, manifest, srcs, packed.advance)
        except BaseException as exc:
            packed.fail(exc)
            raise
        return future

    def _commit(self, flat: torch.Tensor, manifest: _layout.Manifest, packed: _Packed) -> None:
        c = self._conn()
        ok = False
        self._pending_sums = None
        try:
            try:
                self._put_version(c, flat, manifest, packed)
            except _ShmLost:
                self._shm_lost(c, f"version {manifest.version}")
                self._put_version(self._conn(), flat, manifest, packed)
            self._update_index(
                self._conn(),
                manifest.version,
                len(manifest.ranges()) if manifest.total_bytes else 0,
                manifest.delta["chunks"] if manifest.delta else 0,
            )
            ok = True
        finally:
            with self._spare_lock:
                if ok and self._writer is not None:  # the writer holds this buffer now: reuse the old one
                    self._spare, self._base_flat = self._base_flat, flat
                else:
                    self._spare = flat
        if self._writer is not None and self._pending_sums is not None:
            self._writer.hold(manifest.version, _layout.unpack(flat, manifest), self._pending_sums)
        self.stats["pushes"] += 1
        self._committed()

    def _put_version(self, c: Any, flat: torch.Tensor, manifest: _layout.Manifest, packed: _Packed) -> None:
        v = manifest.version
        ranges = manifest.ranges() if manifest.total_bytes else []
        ptr = flat.data_ptr()
        shm = _SHM.get(id(c))
        if ranges and shm is None:  # a dummy client's buffers are registered when allocated
            c.register_buffer(ptr, flat.numel())
        # the checksums only go into the manifest, written last: compute them (GIL released) while
        # the buckets are being put
        sealer = ThreadPoolExecutor(1, thread_name_prefix="mooncake-seal")
        try:
            sealed = sealer.submit(_layout.seal, flat, manifest, packed.wait)
            rcfg = self._rcfg()
            step = self.config.batch_buckets
            for g in range(0, len(ranges), step):
                idx = range(g, min(g + step, len(ranges)))
                packed.wait(ranges[idx.stop - 1][1])
                keys = [self.bucket_key(v, i) for i in idx]
                ptrs = [ptr + ranges[j][0] for j in idx]
                sizes = [ranges[j][1] - ranges[j][0] for j in idx]
                self._retry(
                    f"version {v} buckets {idx.start}..{idx.stop - 1}",
                    functools.partial(c.batch_upsert_from, keys, ptrs, sizes, rcfg),
                    shm=shm is not None,
                )
            sealed.result()
            if self._writer is not None:
                packed.wait(manifest.total_bytes)
                self._put_delta(c, flat, manifest)
            raw = manifest.to_bytes()
            self._retry(f"version {v} manifest", lambda: [c.upsert(self.manifest_key(v), raw, rcfg)])
        finally:
            sealer.shutdown(wait=True)
            if ranges and shm is None:
                c.unregister_buffer(ptr)

    def _retry(self, what: str, call: Callable[[], list[int]], shm: bool = False) -> None:
        deadline = time.monotonic() + self.config.push_retry_s
        while True:
            codes = call()
            bad = [rc for rc in codes if rc != 0]
            if not bad:
                return
            if shm and _SHM_NOT_MAPPED in bad:
                raise _ShmLost(what)
            if time.monotonic() >= deadline:
                raise WeightSyncError(
                    f"mooncake put of {what} failed (codes {sorted(set(bad))}); "
                    "is the store holder running and its segment large enough?"
                )
            self.stats["push_retries"] += 1
            time.sleep(0.2)

    # index and retention ---------------------------------------------------------------------

    def _read_index(self, c: Any) -> dict[str, Any]:
        raw = c.get(self.index_key)
        if not raw:
            return {"latest": None, "versions": {}, "garbage": {}}
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise WeightSyncError(f"unreadable index at {self.index_key!r}: {exc}") from None

    def _update_index(self, c: Any, version: int, n_buckets: int, n_delta_chunks: int = 0) -> None:
        rcfg = self._rcfg()
        with self._index_lock:
            idx = self._read_index(c)
            idx["versions"][str(version)] = n_buckets
            deltas = idx.setdefault("deltas", {})  # version -> delta chunks, until the version is deleted
            if n_delta_chunks:
                deltas[str(version)] = n_delta_chunks
            else:
                deltas.pop(str(version), None)
            kept = sorted(idx["versions"], key=int)
            for old in kept[: -self.config.keep_last]:
                idx["garbage"][old] = idx["versions"].pop(old)
            idx["latest"] = max(int(k) for k in idx["versions"])
            self._retry("index", lambda: [c.upsert(self.index_key, json.dumps(idx).encode(), rcfg)])
            removed = [
                v
                for v, n in list(idx["garbage"].items())
                if self._delete_version(c, int(v), n, deltas.get(v, 0))
            ]
            if removed:
                for v in removed:
                    idx["garbage"].pop(v)
                    deltas.pop(v, None)
                self._retry("index", lambda: [c.upsert(self.index_key, json.dumps(idx).encode(), rcfg)])

    def _delete_version(self, c: Any, version: int, n_buckets: int, n_delta_chunks: int = 0) -> bool:
        """Delete a retired version. The manifest goes first and at once, so the version stops
        being pullable; a bucket still leased by a reader mid-pull stays until the next commit
        (False), so that reader finishes intact."""
        rc = c.remove(self.manifest_key(version), True)
        keys = [self.bucket_key(version, i) for i in range(n_buckets)]
        keys += [self.delta_key(version, i) for i in range(n_delta_chunks)]
        codes = c.batch_remove(keys) if keys else []
        return all(code in (0, _NOT_FOUND) for code in [rc, *codes])

    def latest_version(self) -> int | None:
        return self._read_index(self._conn())["latest"]

    def committed_versions(self) -> list[int]:
        return sorted(int(v) for v in self._read_index(self._conn())["versions"])

    # pull ------------------------------------------------------------------------------------

    def manifest(self, version: int) -> _layout.Manifest:
        raw = self._conn().get(self.manifest_key(version))
        if not raw:
            raise WeightSyncError(
                f"version {version} is not committed in mooncake store "
                f"{self.config.prefix!r} (latest: {self.latest_version()})"
            )
        return _layout.Manifest.from_bytes(raw, f"version {version}")

    def pull(self, version: int, into: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        if self._reader is not None:
            return self._reader.pull(self, version, into, fill_into)
        return self._pull_any(version, into)

    def pull_full(self, version: int) -> dict[str, torch.Tensor]:
        """``version`` read whole (no delta), checksums verified."""
        return self._pull_any(version, None)

    def _pull_any(self, version: int, into: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        c = self._conn()
        try:
            return self._pull(c, version, into)
        except _ShmLost:
            self._shm_lost(c, f"the pull of version {version}")
            return self._pull(self._conn(), version, into)

    def _pull(self, c: Any, version: int, into: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        import torch

        shm = _SHM.get(id(c))
        m = self.manifest(version)
        check_into(into, m.shapes)
        ranges = m.ranges() if m.total_bytes else []
        step = self.config.batch_buckets

        def alloc(nbytes: int) -> torch.Tensor:
            return shm.take(nbytes) if shm is not None else torch.empty(nbytes, dtype=torch.uint8)

        if into is None:  # zero-copy: buckets land in one buffer that the tensors then view
            flat = alloc(m.total_bytes)
            self._fetch_all(c, m, [flat], ranges, step, lambda piece, start: None, whole=True)
            self.stats["pulls"] += 1
            return _layout.unpack(flat, m)
        out = dict(into)
        for e in m.tensors:
            if e["name"] not in out:
                out[e["name"]] = torch.empty(e["shape"], dtype=getattr(torch, e["dtype"]))
        partial: dict[str, torch.Tensor] = {}
        n = min(m.total_bytes, m.bucket_bytes * step)
        self._fetch_all(
            c,
            m,
            [alloc(n), alloc(n)],
            ranges,
            step,
            lambda piece, start: _layout.copy_out(piece, start, m, out, partial),
            whole=False,
        )
        self.stats["pulls"] += 1
        return out

    def _fetch_all(
        self,
        c: Any,
        m: _layout.Manifest,
        bufs: list[torch.Tensor],
        ranges: list[tuple[int, int]],
        step: int,
        consume: Callable[[torch.Tensor, int], None],
        *,
        whole: bool,
    ) -> None:
        """Fetch the version group by group (``step`` buckets per call) into ``bufs``: one buffer for
        the whole version, or staging buffers used in turn. Group g is verified and consumed in a
        thread (checksums release the GIL) while group g+1 is transferred; a staging buffer is
        refilled only after its group was consumed."""
        if not ranges:
            return
        registered = [] if id(c) in _SHM else bufs  # a dummy client's buffers are registered already
        for b in registered:
            c.register_buffer(b.data_ptr(), b.numel())
        pool = ThreadPoolExecutor(1, thread_name_prefix="mooncake-verify")
        pending: Future[None] | None = None
        try:
            for k, g in enumerate(range(0, len(ranges), step)):
                idx = list(range(g, min(g + step, len(ranges))))
                base = 0 if whole else ranges[g][0]
                buf = bufs[k % len(bufs)]
                views = [buf[ranges[i][0] - base : ranges[i][1] - base] for i in idx]
                keys = [self.bucket_key(m.version, i) for i in idx]
                codes = c.batch_get_into(keys, [v.data_ptr() for v in views], [v.numel() for v in views])
                if _SHM_NOT_MAPPED in codes and id(c) in _SHM:
                    raise _ShmLost(keys[0])
                if pending is not None:
                    pending.result()

                def check(
                    idx: list[int] = idx,
                    keys: list[str] = keys,
                    views: list[torch.Tensor] = views,
                    codes: list[int] = codes,
                ) -> None:
                    for i, key, view, rc in zip(idx, keys, views, codes, strict=True):
                        self._verify(c, m, i, key, view, rc)
                        consume(view, ranges[i][0])

                pending = pool.submit(check)
            if pending is not None:
                pending.result()
        finally:
            pool.shutdown(wait=True)
            for b in registered:
                c.unregister_buffer(b.data_ptr())

    def _verify(self, c: Any, m: _layout.Manifest, i: int, key: str, view: torch.Tensor, rc: int) -> None:
        n = view.numel()
        if rc == n and _layout.checksum(view, m.checksum) == m.bucket_sums[i]:
            return
        self.stats["refetches"] += 1
        log.warning(
            "version %d bucket %d: %s; fetching it again",
            m.version,
            i,
            f"read failed (code {rc})" if rc != n else "checksum mismatch",
        )
        rc = c.get_into(key, view.data_ptr(), n)
        if rc != n:
            raise WeightSyncError(
                f"version {m.version}: bucket {key!r} could not be read (code {rc}); "
                "deleted by retention or lost with the store holder"
            )
        if _layout.checksum(view, m.checksum) != m.bucket_sums[i]:
            raise WeightSyncError(f"version {m.version}: checksum mismatch in bucket {key!r} after re-fetch")
