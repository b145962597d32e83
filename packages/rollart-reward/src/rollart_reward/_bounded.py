"""CPU-bound reward work off the event loop, in killable worker processes.

A thread cannot bound work on untrusted input: sympy evaluating ``9**9**9**9`` or a backtracking regex
holds the GIL inside C code, stalling the event loop and every other thread, and cannot be interrupted.
:func:`call` runs a top-level function in one of a few long-lived worker processes (started once, so a
heavy import such as sympy is paid once per worker), waits at most ``timeout_s``, and on timeout kills
that worker (a fresh one replaces it on the next call) and raises :class:`~rollart_core.errors.RewardError`.
Workers have an address-space limit and exit when the parent goes away (their pipe closes).
"""

from __future__ import annotations

import asyncio
import atexit
import multiprocessing
import os
import queue
import threading
from typing import Any

from rollart_core.errors import RewardError

__all__ = ["call", "shutdown"]

MAX_WORKERS = max(1, min(4, os.cpu_count() or 1))
WORKER_MEMORY_BYTES = 4 << 30


def _serve(conn: Any, memory: int) -> None:
    import importlib
    import resource

    try:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    except (ValueError, OSError):
        pass
    while True:
        try:
            target, args = conn.recv()
        except (EOFError, OSError):
            return
        module, _, name = target.partition(":")
        try:
            result = (True, getattr(importlib.import_module(module), name)(*args))
        except BaseException as exc:  # the caller re-raises it as a RewardError
            result = (False, f"{type(exc).__name__}: {exc}"[:2000])
        try:
            conn.send(result)
        except (EOFError, OSError):
            return


class _Worker:
    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_serve, args=(child, WORKER_MEMORY_BYTES), daemon=True, name="rollart-reward-bounded"
        )
        self.proc.start()
        child.close()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()


_idle: queue.LifoQueue[_Worker] = queue.LifoQueue()
_slots = threading.BoundedSemaphore(MAX_WORKERS)
_all: set[_Worker] = set()
_lock = threading.Lock()


def _call_blocking(target: str, args: tuple[Any, ...], timeout_s: float, what: str) -> Any:
    with _slots:
        try:
            worker = _idle.get_nowait()
        except queue.Empty:
            worker = _Worker()
            with _lock:
                _all.add(worker)
        healthy = False
        try:
            worker.conn.send((target, args))
            if not worker.conn.poll(timeout_s):
                raise RewardError(f"{what}: timed out after {timeout_s:g} s (the worker was killed)")
            ok, value = worker.conn.recv()
            healthy = True
        except (EOFError, OSError, BrokenPipeError) as exc:
            raise RewardError(f"{what}: the worker process died ({exc!r})") from None
        finally:
            if healthy:
                _idle.put(worker)
            else:
                worker.kill()
                with _lock:
                    _all.discard(worker)
    if not ok:
        raise RewardError(f"{what}: {value}")
    return value


async def call(target: str, *args: Any, timeout_s: float, what: str) -> Any:
    """``module:function(*args)`` in a worker process, at most ``timeout_s`` (RewardError naming ``what``)."""
    return await asyncio.to_thread(_call_blocking, target, args, timeout_s, what)


@atexit.register
def shutdown() -> None:
    """Stop every worker (also run at interpreter exit)."""
    with _lock:
        workers = list(_all)
        _all.clear()
    for w in workers:
        w.kill()
    while True:
        try:
            _idle.get_nowait()
        except queue.Empty:
            return
