"""RayWeightStore: versions in Ray's object store, indexed by a small named actor.

The pusher hands each bucket to the holder actor, which puts it into the object store itself, so
the actor owns it and a version outlives the process that pushed it (this costs a second copy in
the object store). The actor keeps the last ``keep_last`` versions' references and drops older
ones (Ray then frees them); a version becomes visible only at ``commit``. Readers anywhere in the cluster fetch buckets from the object
store (shared memory on the same node). The object is picklable and finds the actor by name.
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


class _Holder:
    """The named actor: version -> (manifest, bucket refs). Tiny: it only holds references."""

    def __init__(self, keep_last: int) -> None:
        self.keep_last = keep_last
        self.versions: dict[int, tuple[bytes, list[Any]]] = {}
        self.pending: dict[int, dict[int, Any]] = {}

    def put_bucket(self, version: int, i: int, data: Any) -> None:
        import ray

        if i == 0:  # a retried push starts over
            self.pending[version] = {}
        self.pending.setdefault(version, {})[i] = ray.put(data)

    def commit(self, version: int, manifest: bytes, n_buckets: int) -> int | None:
        got = self.pending.pop(version, {})
        if sorted(got) != list(range(n_buckets)):
            raise RuntimeError(f"version {version}: have buckets {sorted(got)}, expected {n_buckets}")
        self.versions[version] = (manifest, [got[i] for i in range(n_buckets)])
        for v in sorted(self.versions)[: -self.keep_last]:
            del self.versions[v]
        for v in [v for v in self.pending if v < version]:  # abandoned by a dead pusher
            del self.pending[v]
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
        ray.get(holder.commit.remote(manifest.version, manifest.to_bytes(), len(ranges)))
        self._committed()

    def latest_version(self) -> int | None:
        import ray

        return ray.get(self._holder().latest.remote())

    def committed_versions(self) -> list[int]:
        import ray

        return ray.get(self._holder().committed.remote())

    def pull(self, version: int, into: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        import ray
        import torch

        entry = ray.get(self._holder().get.remote(version))
        if entry is None:
            raise WeightSyncError(
                f"version {version} is not committed in Ray store {self.config.name!r} "
                f"(latest: {self.latest_version()})"
            )
        m = _layout.Manifest.from_bytes(entry[0], f"version {version}")
        check_into(into, m.shapes)
        refs = entry[1]
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
