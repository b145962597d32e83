"""FilesystemWeightStore: one safetensors file per version, committed by an atomic rename.

Layout: ``<root>/v00000003/model.safetensors`` plus ``COMMITTED`` (a JSON manifest with the
checksum) and, with ``delta=True``, ``delta.bin`` (the version as a difference from the previous
push, see :mod:`rollart_weightsync._delta`). A version is written to a temporary directory and
renamed into place only when complete, so a reader never sees a partial version; pulls verify the
checksum.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rollart_core.errors import WeightSyncError
from rollart_weightsync._common import PushWatchMixin, fill_into, snapshot
from rollart_weightsync._delta import DeltaInfo, DeltaReader, DeltaWriter, new_stats

if TYPE_CHECKING:
    import torch

__all__ = ["FilesystemWeightStore", "FilesystemWeightStoreConfig"]


class FilesystemWeightStoreConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    root: Path = Path("weights")
    """Directory holding the versions (shared by pusher and pullers)."""
    keep_last: int = Field(2, ge=1)
    """Retention: how many committed versions to keep."""
    poll_s: float = Field(0.05, gt=0)
    """Polling period of ``wait_for`` and subscriptions (other processes commit by rename)."""
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """Convert floating tensors to this dtype on push (None: keep the trainer's dtype)."""
    delta: bool = False
    """Store each version also as its difference from the previous push, and pull a newer version
    as deltas from the one this store object last pulled (full pulls where that cannot work). Costs
    one copy of the weights in the pusher's and in each puller's memory (see the README)."""
    shared: bool = False
    """The directory is on a file system every node mounts (NFS, a parallel FS). A pipeline on a
    multi-node cluster refuses this store unless it is set: engines on another node would never see
    the versions."""


class FilesystemWeightStore(PushWatchMixin):
    Config = FilesystemWeightStoreConfig

    def __init__(
        self, config: FilesystemWeightStoreConfig | None = None, *, root: str | Path | None = None
    ) -> None:
        self.config = config or FilesystemWeightStoreConfig()
        self.root = Path(root) if root is not None else self.config.root
        self.root.mkdir(parents=True, exist_ok=True)
        self._init_push_watch("fs", self.config.poll_s)
        self.stats = new_stats()
        self._writer = DeltaWriter() if self.config.delta else None
        self._reader = DeltaReader(self.stats, f"fs store {self.root}") if self.config.delta else None

    def __getstate__(self) -> dict[str, object]:  # travels to other processes without its threads
        return {"config": self.config, "root": self.root}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__init__(state["config"], root=state["root"])  # type: ignore[misc]

    def _dir(self, version: int) -> Path:
        return self.root / f"v{version:08d}"

    def push(self, version: int, tensors: Mapping[str, torch.Tensor]) -> Future[None]:
        if version < 0:
            raise WeightSyncError(f"version must be >= 0, got {version}")
        import torch

        snap = snapshot(tensors, getattr(torch, self.config.dtype) if self.config.dtype else None)
        return self._submit(lambda: self._write(version, snap))

    def _write(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        final = self._dir(version)
        tmp = self.root / f".tmp-v{version:08d}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file(tensors, str(tmp / "model.safetensors"))
        digest = _sha256(tmp / "model.safetensors")
        nbytes = (tmp / "model.safetensors").stat().st_size
        marker: dict[str, Any] = {
            "version": version,
            "sha256": digest,
            "tensors": len(tensors),
            "nbytes": nbytes,
        }
        if self._writer is not None:
            blob, sums = self._writer.encode(version, tensors)
            if blob is not None:  # recorded even when not stored: readers then know why
                marker["delta"] = {"base": self._writer.base_version, "nbytes": len(blob)}
                if len(blob) < nbytes:
                    (tmp / "delta.bin").write_bytes(blob)
                    self.stats["delta_pushes"] += 1
                    self.stats["delta_push_bytes"] += len(blob)
        (tmp / "COMMITTED").write_text(json.dumps(marker))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        if self._writer is not None:
            self._writer.hold(version, tensors, sums)
        self._retain()
        self._committed()

    def _retain(self) -> None:
        versions = self.committed_versions()
        for v in versions[: -self.config.keep_last]:
            shutil.rmtree(self._dir(v), ignore_errors=True)

    def committed_versions(self) -> list[int]:
        out = []
        for d in self.root.glob("v*"):
            if (d / "COMMITTED").is_file():
                try:
                    out.append(int(d.name[1:]))
                except ValueError:
                    continue
        return sorted(out)

    def latest_version(self) -> int | None:
        vs = self.committed_versions()
        return vs[-1] if vs else None

    def pull(self, version: int, into: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        if self._reader is not None:
            return self._reader.pull(self, version, into, fill_into)
        return fill_into(self.pull_full(version), into)

    def _marker(self, version: int) -> dict[str, Any]:
        """The version's COMMITTED manifest ({} if it is not committed)."""
        try:
            m = json.loads((self._dir(version) / "COMMITTED").read_text())
        except (OSError, ValueError):
            return {}
        return m if isinstance(m, dict) else {}

    # what the delta reader asks (rollart_weightsync._delta.DeltaSource)

    def delta_info(self, version: int) -> DeltaInfo | None:
        d = self._marker(version).get("delta")
        return DeltaInfo(int(d["base"]), int(d["nbytes"])) if isinstance(d, dict) else None

    def delta_blob(self, version: int) -> bytes:
        try:
            return (self._dir(version) / "delta.bin").read_bytes()
        except OSError as exc:
            raise WeightSyncError(f"version {version}: delta unreadable in {self.root}: {exc}") from None

    def full_nbytes(self, version: int) -> int:
        m = self._marker(version)
        if "nbytes" in m:
            return int(m["nbytes"])
        try:
            return (self._dir(version) / "model.safetensors").stat().st_size
        except OSError:
            return 0

    def pull_full(self, version: int) -> dict[str, torch.Tensor]:
        """``version`` read whole (no delta), checksum verified."""
        from safetensors.torch import load_file

        d = self._dir(version)
        marker = d / "COMMITTED"
        if not marker.is_file():
            raise WeightSyncError(
                f"version {version} is not committed in {self.root} (latest: {self.latest_version()})"
            )
        try:
            manifest = json.loads(marker.read_text())
            for attempt in range(2):
                if _sha256(d / "model.safetensors") == manifest["sha256"]:
                    return load_file(str(d / "model.safetensors"))
                if attempt == 0:
                    continue  # re-read once: a concurrent retention pass may have raced us
        except OSError as exc:  # removed by retention (or a re-push) while we read it
            raise WeightSyncError(f"version {version} vanished from {d} while pulling: {exc}") from exc
        raise WeightSyncError(f"version {version}: checksum mismatch in {d}")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
