"""A weight store that fails or hangs chosen pulls: fault injection for tests and chaos runs.

``weight_store: {impl: faulty, options: {store: {impl: filesystem, options: {...}}, fail_pull: [3],
claim_dir: /shared/dir}}`` wraps any store. The first ``readers`` engines to pull a listed version get
the fault (a pull of a ``fail_pull`` version raises :class:`~rollart_core.errors.WeightSyncError`, one
of a ``hang_pull`` version blocks for ``hang_s`` first); every other pull, and every push, goes to the
wrapped store unchanged. Which readers take a fault is decided across processes by claiming a file in
``claim_dir`` (``O_CREAT | O_EXCL``): the directory must be one every engine reaches (on one machine,
any local directory). A claimed fault stays claimed: a reader that retries pulls normally.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from rollart_core.config import ComponentConfig
from rollart_core.errors import WeightSyncError
from rollart_weightsync._common import wrapped_store

__all__ = ["FaultyWeightStore", "FaultyWeightStoreConfig"]


class FaultyWeightStoreConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    store: ComponentConfig
    """The store to wrap (``impl`` + ``options``)."""
    claim_dir: str
    """A directory every reader reaches: where readers claim the faults."""
    fail_pull: list[int] = Field(default_factory=list)
    """Versions whose pull fails for the first ``readers`` readers."""
    hang_pull: list[int] = Field(default_factory=list)
    """Versions whose pull blocks ``hang_s`` (then fails) for the first ``readers`` readers."""
    hang_s: float = Field(3600.0, gt=0)
    readers: int = Field(1, ge=1)
    """How many readers take each fault."""

    @model_validator(mode="after")
    def _disjoint(self) -> FaultyWeightStoreConfig:
        both = sorted(set(self.fail_pull) & set(self.hang_pull))
        if both:
            raise ValueError(f"versions {both} are in both fail_pull and hang_pull")
        if self.store.impl == "faulty":
            raise ValueError("store: a faulty store cannot wrap another faulty store")
        return self


class FaultyWeightStore:
    """Wraps a weight store (see the module doc); everything it does not inject goes to the wrapped one."""

    Config = FaultyWeightStoreConfig

    def __init__(self, config: FaultyWeightStoreConfig, *, inner: Any | None = None) -> None:
        self.config = config
        self.inner = wrapped_store(config.store) if inner is None else inner
        Path(config.claim_dir).mkdir(parents=True, exist_ok=True)
        self.injected: dict[str, int] = {"fail": 0, "hang": 0}
        """Faults this instance (one reader's process) took."""

    def _claim(self, kind: str, version: int) -> bool:
        """Whether this pull takes the fault: one of the first ``readers`` claims of it, machine-wide."""
        for slot in range(self.config.readers):
            path = Path(self.config.claim_dir) / f"{kind}-v{version}-{slot}"
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                continue
            with os.fdopen(fd, "w") as f:
                f.write(f"{os.getpid()}\n")
            return True
        return False

    def pull(self, version: int, into: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        c = self.config
        if version in c.fail_pull and self._claim("fail", version):
            self.injected["fail"] += 1
            raise WeightSyncError(f"injected fault: the pull of version {version} failed")
        if version in c.hang_pull and self._claim("hang", version):
            self.injected["hang"] += 1
            threading.Event().wait(c.hang_s)
            raise WeightSyncError(f"injected fault: the pull of version {version} hung for {c.hang_s:g} s")
        return dict(self.inner.pull(version, into))

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
        self.inner.close()

    async def aclose(self) -> None:
        aclose = getattr(self.inner, "aclose", None)
        if aclose is not None:
            await aclose()
        else:
            self.inner.close()
