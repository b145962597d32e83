"""MemoryWeightStore: versions held in this process (single-process stacks and tests)."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from rollart_core.errors import WeightSyncError
from rollart_weightsync._common import PushWatchMixin, fill_into, snapshot

if TYPE_CHECKING:
    import torch

__all__ = ["MemoryWeightStore", "MemoryWeightStoreConfig"]


class MemoryWeightStoreConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    keep_last: int = Field(2, ge=1)
    """Retention: how many committed versions to keep."""


class MemoryWeightStore(PushWatchMixin):
    Config = MemoryWeightStoreConfig

    def __init__(self, config: MemoryWeightStoreConfig | None = None) -> None:
        self.config = config or MemoryWeightStoreConfig()
        self._versions: dict[int, dict[str, torch.Tensor]] = {}
        self._cond = threading.Condition()
        self._init_push_watch("mem", 0.5, cond=self._cond, wait_poll_s=0.02)

    def push(self, version: int, tensors: Mapping[str, torch.Tensor]) -> Future[None]:
        snap = snapshot(tensors)

        def commit() -> None:
            with self._cond:
                self._versions[version] = snap
                for v in sorted(self._versions)[: -self.config.keep_last]:
                    del self._versions[v]
                self._cond.notify_all()
            self._committed()

        return self._submit(commit)

    def latest_version(self) -> int | None:
        with self._cond:
            return max(self._versions) if self._versions else None

    def pull(self, version: int, into: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """The stored tensors themselves (shared, do not modify), or copied into ``into``."""
        with self._cond:
            if version not in self._versions:
                raise WeightSyncError(f"version {version} is not committed (have {sorted(self._versions)})")
            tensors = dict(self._versions[version])
        return fill_into(tensors, into)
