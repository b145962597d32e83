"""Helpers shared by the back-ends: a one-thread pusher, snapshots, waiting, subscriptions, and
:class:`PushWatchMixin`, which gives every store the same ``wait_for`` / ``subscribe`` / ``close``."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from rollart_core.errors import WeightSyncError

if TYPE_CHECKING:
    import torch

__all__ = [
    "PushWatchMixin",
    "Pusher",
    "Subscriptions",
    "check_into",
    "fill_into",
    "full_tensor",
    "snapshot",
    "wait_until",
    "wrapped_store",
]

log = logging.getLogger(__name__)


def full_tensor(t: Any) -> torch.Tensor:
    """The whole tensor: ``DTensor.full_tensor()`` for sharded (FSDP2/TP) tensors, else ``t``."""
    if hasattr(t, "full_tensor") and hasattr(t, "placements"):
        return t.full_tensor()
    return t


def snapshot(
    tensors: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """Detached, contiguous CPU copies, so the caller may keep training while the push runs."""
    out = {}
    for name, t in tensors.items():
        t = full_tensor(t).detach()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        out[name] = t.to("cpu", copy=True).contiguous()
    return out


def fill_into(
    tensors: Mapping[str, torch.Tensor], into: Mapping[str, torch.Tensor] | None
) -> dict[str, torch.Tensor]:
    """Copy ``tensors`` into the preallocated ``into`` (same names/shapes); others pass through."""
    if into is None:
        return dict(tensors)
    unknown = sorted(set(into) - set(tensors))
    if unknown:
        raise WeightSyncError(f"into= names tensors the version does not have: {unknown[:5]}")
    out = dict(tensors)
    for name, dst in into.items():
        src = tensors[name]
        if tuple(dst.shape) != tuple(src.shape):
            raise WeightSyncError(
                f"into[{name!r}] has shape {tuple(dst.shape)}, version has {tuple(src.shape)}"
            )
        dst.copy_(src)
        out[name] = dst
    return out


def check_into(into: Mapping[str, torch.Tensor] | None, shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Validate ``into`` against a version's shapes before any byte is written into it."""
    if into is None:
        return
    unknown = sorted(set(into) - set(shapes))
    if unknown:
        raise WeightSyncError(f"into= names tensors the version does not have: {unknown[:5]}")
    for name, dst in into.items():
        if tuple(dst.shape) != tuple(shapes[name]):
            raise WeightSyncError(
                f"into[{name!r}] has shape {tuple(dst.shape)}, version has {tuple(shapes[name])}"
            )


class Pusher:
    """Runs pushes one at a time, in order, off the caller's thread."""

    def __init__(self, name: str) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    def submit(self, fn: Callable[[], None]) -> Future[None]:
        return self._pool.submit(fn)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def wait_until(
    latest: Callable[[], int | None],
    version: int,
    timeout: float | None,
    cond: threading.Condition | None = None,
    poll_s: float = 0.02,
) -> int:
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


class Subscriptions:
    """Delivers newly committed versions to callbacks from one watcher thread.

    The watcher polls ``latest()`` (or wakes on :meth:`notify`); a subscriber that falls behind
    is handed only the newest version, never a backlog. A callback that raises is logged and
    stays subscribed.
    """

    def __init__(self, latest: Callable[[], int | None], poll_s: float, name: str) -> None:
        self._latest = latest
        self._poll_s = poll_s
        self._name = name
        self._subs: dict[int, list[Any]] = {}  # id -> [callback, last version delivered or seen]
        self._next_id = 0
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def subscribe(self, callback: Callable[[int], None]) -> Callable[[], None]:
        seen = self._safe_latest()  # read before returning: a later commit is always delivered
        with self._cond:
            sid = self._next_id
            self._next_id += 1
            self._subs[sid] = [callback, seen]
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"{self._name}-watch", daemon=True)
                self._thread.start()

        def unsubscribe() -> None:
            with self._cond:
                self._subs.pop(sid, None)
                self._cond.notify_all()

        return unsubscribe

    def notify(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._subs:
                    self._thread = None
                    return
                self._cond.wait(self._poll_s)
            v = self._safe_latest()
            if v is None:
                continue
            with self._cond:
                due = [sub for sub in self._subs.values() if sub[1] is None or v > sub[1]]
                for sub in due:
                    sub[1] = v
            for callback, _ in due:
                try:
                    callback(v)
                except Exception:  # a subscriber's bug must not stop deliveries to the others
                    log.exception("%s: weight-version subscriber failed on version %d", self._name, v)

    def _safe_latest(self) -> int | None:
        try:
            return self._latest()
        except WeightSyncError as exc:
            log.warning("%s: cannot read latest version: %s", self._name, exc)
            return None


class PushWatchMixin:
    """What every store shares: one pusher thread (started by the first push, again after
    :meth:`close`), one subscription watcher, and ``wait_for`` / ``subscribe`` / ``close``.

    A store calls :meth:`_init_push_watch` in ``__init__``, runs each commit through
    :meth:`_submit`, calls :meth:`_committed` once a version is visible, and defines
    ``latest_version``.
    """

    latest_version: Callable[[], int | None]
    _pusher: Pusher | None
    _subs: Subscriptions

    def _init_push_watch(
        self,
        name: str,
        poll_s: float,
        *,
        cond: threading.Condition | None = None,
        wait_poll_s: float | None = None,
    ) -> None:
        """``name`` prefixes the thread names; ``poll_s`` is the watcher's polling period and, unless
        ``wait_poll_s`` is given, ``wait_for``'s. ``cond``: notified at each commit, so ``wait_for``
        wakes at once instead of at its next poll."""
        self._push_watch_name = name
        self._pusher = None
        self._subs = Subscriptions(self.latest_version, poll_s, f"{name}-weights")
        self._wait_cond = cond
        self._wait_poll_s = poll_s if wait_poll_s is None else wait_poll_s

    def _submit(self, commit: Callable[[], None]) -> Future[None]:
        if self._pusher is None:
            self._pusher = Pusher(f"{self._push_watch_name}-weight-push")
        return self._pusher.submit(commit)

    def _committed(self) -> None:
        """Wake the subscription watcher: a version was just committed by this process."""
        self._subs.notify()

    def wait_for(self, version: int, timeout: float | None = None) -> int:
        return wait_until(
            self.latest_version, version, timeout, cond=self._wait_cond, poll_s=self._wait_poll_s
        )

    def subscribe(self, callback: Callable[[int], None]) -> Callable[[], None]:
        return self._subs.subscribe(callback)

    def close(self) -> None:
        """Finish queued pushes; a later push starts a new pusher thread."""
        if self._pusher is not None:
            self._pusher.close()
            self._pusher = None


def wrapped_store(store: Any) -> Any:
    """The store a wrapper (``faulty``, ``node_cache``) wraps, built from its ``store:`` section
    (a :class:`~rollart_core.config.ComponentConfig`)."""
    from rollart_core.registry import build

    return build("weight_store", store.impl, store.options, "weight_store.options.store")
