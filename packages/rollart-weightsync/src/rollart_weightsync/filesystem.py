"""FilesystemWeightStore: one safetensors file per version, committed by an atomic rename.

Layout: ``<root>/v00000003/model.safetensors`` plus ``COMMITTED`` (a JSON manifest with the
checksum). A version is written to a temporary directory and renamed into place only when complete,
so a reader never sees a partial version; pulls verify the checksum.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from rollart_core.errors import WeightSyncError
from rollart_weightsync._common import PushWatchMixin, fill_into, snapshot

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

    def __getstate__(self) -> dict[str, object]:  # travels to other processes without its threads
        return {"config": self.config, "root": self.root}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__init__(state["config"], root=state["root"])  # type: ignore[misc,arg-type]

    def _dir(self, version: int) -> Path:
        return self.root / f"v{version:08d}"

    def push(self, version: int, tensors: Mapping[str, torch.Tensor]) -> Future[None]:
        if version < 0:
            raise WeightSyncError(f"version must be >= 0, got {version}")
        snap = snapshot(tensors)
        return self._submit(lambda: self._write(version, snap))

    def _write(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        final = self._dir(version)
        tmp = self.root / f".tmp-v{version:08d}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file(tensors, str(tmp / "model.safetensors"))
        digest = _sha256(tmp / "model.safetensors")
        (tmp / "COMMITTED").write_text(
            json.dumps({"version": version, "sha256": digest, "tensors": len(tensors)})
        )
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
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
                    return fill_into(load_file(str(d / "model.safetensors")), into)
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
