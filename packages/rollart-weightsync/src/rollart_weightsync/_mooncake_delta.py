"""The Mooncake store's side of delta sync (:mod:`rollart_weightsync._delta`): a version's delta is
put in chunks ``<prefix>/v<version>/d<i>`` before its manifest, which records it (base, bytes,
chunks); retention deletes the chunks with the version."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rollart_core.errors import WeightSyncError
from rollart_weightsync import _layout
from rollart_weightsync._delta import DeltaInfo, DeltaWriter

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from rollart_weightsync.mooncake import MooncakeWeightStoreConfig

__all__ = ["MooncakeDeltaMixin"]


class MooncakeDeltaMixin:
    config: MooncakeWeightStoreConfig
    stats: dict[str, int]
    _writer: DeltaWriter | None
    _pending_sums: dict[str, str] | None
    _vkey: Callable[[int], str]
    _rcfg: Callable[[], Any]
    _retry: Callable[..., None]
    _conn: Callable[[], Any]
    manifest: Callable[[int], _layout.Manifest]

    def delta_key(self, version: int, i: int) -> str:
        return f"{self._vkey(version)}/d{i:05d}"

    def _put_delta(self, c: Any, flat: torch.Tensor, manifest: _layout.Manifest) -> None:
        """Encode the version against the writer's last one and put it in chunks, before the manifest."""
        writer = self._writer
        if writer is None:
            return
        blob, sums = writer.encode(manifest.version, _layout.unpack(flat, manifest))
        self._pending_sums = sums
        if blob is None:
            return
        if len(blob) >= manifest.total_bytes:  # recorded, not stored: readers then know why
            manifest.delta = {"base": writer.base_version, "nbytes": len(blob), "chunks": 0}
            return
        # plain puts of bytes pass through the client's local buffer: chunks must fit it
        chunk = min(self.config.bucket_bytes, self.config.local_buffer_bytes // 2)
        pieces = [blob[i : i + chunk] for i in range(0, len(blob), chunk)]
        rcfg = self._rcfg()
        for i, piece in enumerate(pieces):
            key = self.delta_key(manifest.version, i)
            self._retry(
                f"version {manifest.version} delta chunk {i}", lambda k=key, p=piece: [c.upsert(k, p, rcfg)]
            )
        manifest.delta = {"base": writer.base_version, "nbytes": len(blob), "chunks": len(pieces)}
        self.stats["delta_pushes"] += 1
        self.stats["delta_push_bytes"] += len(blob)

    # what the delta reader asks (rollart_weightsync._delta.DeltaSource)

    def delta_info(self, version: int) -> DeltaInfo | None:
        try:
            d = self.manifest(version).delta
        except WeightSyncError:
            return None
        return DeltaInfo(int(d["base"]), int(d["nbytes"])) if d else None

    def delta_blob(self, version: int) -> bytes:
        d = self.manifest(version).delta or {}
        c = self._conn()
        pieces = []
        for i in range(int(d.get("chunks", 0))):
            raw = c.get(self.delta_key(version, i))
            if not raw:
                raise WeightSyncError(f"version {version}: delta chunk {i} is missing from the store")
            pieces.append(raw)
        return b"".join(pieces)

    def full_nbytes(self, version: int) -> int:
        return self.manifest(version).total_bytes
