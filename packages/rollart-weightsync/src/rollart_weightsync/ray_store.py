"""RayWeightStore: versions in Ray's object store, indexed by a small named actor.

The pusher hands each bucket to the holder actor, which puts it into the object store itself, so
the actor owns it and a version outlives the process that pushed it (this costs a second copy in
the object store). The actor keeps the last ``keep_last`` versions' references and drops older
ones (Ray then frees them); a version becomes visible only at ``commit``. Readers anywhere in the cluster fetch buckets from the object
store (shared memory on the same node). The object is picklable and finds the actor by name.
With ``delta=True`` each version's delta from the previous push is one more object (see
:mod:`rollart_weightsync._delta`).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rollart_core.errors import ConfigError, WeightSyncError
from rollart_core.extras import require
from rollart_weightsync import _layout
from rollart_weightsync._common import PushWatchMixin, check_into, fill_into
from rollart_weightsync._delta import DeltaInfo, DeltaReader, DeltaWriter, new_stats

if TYPE_CHECKING:
    import torch

__all__ = ["RayWeightStore", "RayWeightStoreConfig"]

_INSTALL = "pip install 'rollart-weightsync[ray]'"


class RayWeightStoreConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    name: str = Field("rollart-weight-store", min_length=1)
    """Name of the holder actor (one store per name and namespace)."""
    namespace: str | None = None
    """Ray namespace of the holder actor (None: the job's)."""
    bucket_bytes: int = Field(64 << 20, ge=4096)
    """Size of one object in the object store."""
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """Convert floating tensors to this dtype on push."""
    checksum: Literal["blake3", "crc32", "sha256", "none"] = "blake3"
    keep_last: int = Field(2, ge=1)
    """Retention: committed versions whose objects are kept."""
    poll_s: float = Field(0.05, gt=0)
    delta: bool = False
    """Store each version also as its difference from the previous push, and pull a newer version
    as deltas from the one this store object last pulled (full pulls where that cannot work). Costs
    one copy of the weights in the pusher's and in each puller's memory (see the README)."""


class _Holder:
    """The named actor: version -> (manifest, bucket refs). Tiny: it only holds references."""

    def __init__(self, keep_last: int) -> None:
        self.keep_last = keep_last
        self.versions: dict[int, tuple[bytes, list[Any]]] = {}
        self.pending: dict[int, dict[int, Any]] = {}
        self.deltas: dict[int, Any] = {}

    def put_bucket(self, version: int, i: int, data: Any) -> None:
        import ray

        if i == 0:  # a retried push starts over
            self.pending[version] = {}
        self.pending.setdefault(version, {})[i] = ray.put(data)

    def put_delta(self, version: int, data: Any) -> None:
        """The delta stored with ``version`` (its manifest, committed after, says from which base)."""
        import ray

        self.deltas[version] = ray.put(data)

    def get_delta(self, version: int) -> list[Any] | None:
        ref = self.deltas.get(version)
        return None if ref is None else [ref]  # in a list: a returned ref would be resolved

    def commit(self, version: int, manifest: bytes, n_buckets: int) -> int | None:
        got = self.pending.pop(version, {})
        if sorted(got) != list(range(n_buckets)):
            raise RuntimeError(f"version {version}: have buckets {sorted(got)}, expected {n_buckets}")
        self.versions[version] = (manifest, [got[i] for i in range(n_buckets)])
        for v in sorted(self.versions)[: -self.keep_last]:
            del self.versions[v]
        for v in [v for v in self.pending if v < version]:  # abandoned by a dead pusher
            del self.pending[v]
        for v in [v for v in self.deltas if v < version and v not in self.versions]:
            del self.deltas[v]
        return max(self.versions)

    def get(self, version: int) -> tuple[bytes, list[Any]] | None:
        return self.versions.get(version)

    def latest(self) -> int | None:
        return max(self.versions) if self.versions else None

    def committed(self) -> list[int]:
        return sorted(self.versions)


class RayWeightStore(PushWatchMixin):
    Config = RayWeightStoreConfig

    def __init__(self, config: RayWeightStoreConfig | None = None, **options: Any) -> None:
        if config is None:
            config = RayWeightStoreConfig(**options)
        elif options:
            raise ConfigError(f"give either a config or options, not both ({sorted(options)})")
        self.config = config
        self._actor: Any = None
        self._lock = threading.Lock()
        self._init_push_watch("ray", config.poll_s)
        self.stats = new_stats()
        self._writer = DeltaWriter() if config.delta else None
        self._reader = DeltaReader(self.stats, f"ray store {config.name!r}") if config.delta else None

    def __getstate__(self) -> dict[str, Any]:
        return {"config": self.config}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["config"])  # type: ignore[misc]

    def _holder(self) -> Any:
        with self._lock:
            if self._actor is not None:
                return self._actor
            ray = require("ray", _INSTALL)
            if not ray.is_initialized():
                raise WeightSyncError(
                    "RayWeightStore needs a running Ray (ray.init / rollart_core.resources.RayCluster)"
                )
            cls = ray.remote(num_cpus=0)(_Holder)
            self._actor = cls.options(
                name=self.config.name, namespace=self.config.namespace, get_if_exists=True
            ).remote(self.config.keep_last)
            return self._actor

    def push(self, version: int, tensors: Mapping[str, torch.Tensor]) -> Future[None]:
        if version < 0:
            raise WeightSyncError(f"version must be >= 0, got {version}")
        import torch

        dtype = getattr(torch, self.config.dtype) if self.config.dtype else None
        flat, manifest = _layout.pack(tensors, version, self.config.bucket_bytes, self.config.checksum, dtype)
        return self._submit(lambda: self._commit(flat, manifest))

    def _commit(self, flat: torch.Tensor, manifest: _layout.Manifest) -> None:
        import ray

        holder = self._holder()
        _layout.seal(flat, manifest)
        arr = flat.numpy()
        ranges = manifest.ranges() if manifest.total_bytes else []
        ray.get([holder.put_bucket.remote(manifest.version, i, arr[s:e]) for i, (s, e) in enumerate(ranges)])
        if self._writer is not None:
            import numpy as np

            tensors = _layout.unpack(flat, manifest)
            blob, sums = self._writer.encode(manifest.version, tensors)
            if blob is not None:  # recorded even when not stored: readers then know why
                manifest.delta = {"base": self._writer.base_version, "nbytes": len(blob)}
                if len(blob) < manifest.total_bytes:
                    ray.get(holder.put_delta.remote(manifest.version, np.frombuffer(blob, dtype=np.uint8)))
                    self.stats["delta_pushes"] += 1
                    self.stats["delta_push_bytes"] += len(blob)
        ray.get(holder.commit.remote(manifest.version, manifest.to_bytes(), len(ranges)))
        if self._writer is not None:
            self._writer.hold(manifest.version, tensors, sums)
        self._committed()

    def latest_version(self) -> int | None:
        import ray

        return ray.get(self._holder().latest.remote())

    def committed_versions(self) -> list[int]:
        import ray

        return ray.get(self._holder().committed.remote())

    def pull(self, version: int, into: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        if self._reader is not None:
            return self._reader.pull(self, version, into, fill_into)
        return self._pull(version, into)

    def _entry(self, version: int) -> tuple[_layout.Manifest, list[Any]] | None:
        import ray

        entry = ray.get(self._holder().get.remote(version))
        if entry is None:
            return None
        return _layout.Manifest.from_bytes(entry[0], f"version {version}"), entry[1]

    # what the delta reader asks (rollart_weightsync._delta.DeltaSource)

    def delta_info(self, version: int) -> DeltaInfo | None:
        entry = self._entry(version)
        d = entry[0].delta if entry is not None else None
        return DeltaInfo(int(d["base"]), int(d["nbytes"])) if d else None

    def delta_blob(self, version: int) -> bytes:
        import ray

        ref = ray.get(self._holder().get_delta.remote(version))
        if ref is None:
            raise WeightSyncError(f"version {version}: no delta object in Ray store {self.config.name!r}")
        try:
            return bytes(ray.get(ref[0]))
        except ray.exceptions.RayError as exc:
            raise WeightSyncError(f"version {version}: delta lost from the object store: {exc}") from None

    def full_nbytes(self, version: int) -> int:
        entry = self._entry(version)
        return entry[0].total_bytes if entry is not None else 0

    def pull_full(self, version: int) -> dict[str, torch.Tensor]:
        """``version`` read whole (no delta), checksums verified."""
        return self._pull(version, None)

    def _pull(self, version: int, into: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        import ray
        import torch

        entry = self._entry(version)
        if entry is None:
            raise WeightSyncError(
                f"version {version} is not committed in Ray store {self.config.name!r} "
                f"(latest: {self.latest_version()})"
            )
        m, refs = entry
        check_into(into, m.shapes)
        flat = torch.empty(m.total_bytes, dtype=torch.uint8)
        out = flat.numpy()
        for i, ((s, e), ref) in enumerate(zip(m.ranges() if m.total_bytes else [], refs, strict=True)):
            arr = self._get_bucket(ray, ref, m, i)
            out[s:e] = arr  # one copy out of the (read-only, shared) object store
        return fill_into(_layout.unpack(flat, m), into)

    def _get_bucket(self, ray: Any, ref: Any, m: _layout.Manifest, i: int) -> Any:
        for _attempt in range(2):
            try:
                arr = ray.get(ref)
            except ray.exceptions.RayError as exc:
                raise WeightSyncError(
                    f"version {m.version} bucket {i} lost from the object store: {exc}"
                ) from None
            if _layout.checksum(arr, m.checksum) == m.bucket_sums[i]:
                return arr
        raise WeightSyncError(f"version {m.version}: checksum mismatch in bucket {i} after re-fetch")
