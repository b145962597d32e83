"""Helpers shared by the simple back-ends: a one-thread pusher and snapshotting tensors."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from rollart_core.errors import WeightSyncError

if TYPE_CHECKING:
    import torch

__all__ = ["Pusher", "snapshot", "wait_until"]


def snapshot(tensors: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Detached, contiguous CPU copies, so the caller may keep training while the push runs."""
    out = {}
    for name, t in tensors.items():
        t = t.detach()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        out[name] = t.to("cpu", copy=True).contiguous()
    return out


class Pusher:
    """Runs pushes one at a time, in order, off the caller's thread."""

    def __init__(self, name: str) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    def submit(self, fn: Callable[[], None]) -> Future[None]:
        return self._pool.submit(fn)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def wait_until(latest: Callable[[], int | None], version: int, timeout: float | None,
               cond: threading.Condition | None = None, poll_s: float = 0.02) -> int:
    """Block until ``latest() >= version``; condition-notified where possible, else polled."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        v = latest()
        if v is not None and v >= version:
            return v
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            raise WeightSyncError(f"version {version} not committed within {timeout} s (latest: {v})")
        wait = poll_s if remaining is None else min(poll_s, remaining)
        if cond is not None:
            with cond:
                cond.wait(wait)
        else:
            time.sleep(wait)
