"""The C heap of long-running processes that allocate and free large tensors from several threads.

glibc's malloc gives each thread that allocates an arena of its own (up to 8 per core) and returns
little of a freed arena's memory to the system: a driver whose training step runs in a pool thread
(``asyncio.to_thread``) while weight pushes snapshot in another grew by about a gigabyte a step on
SmolLM2-135M until the node's OOM killer stopped the run. Two remedies, both no-ops off glibc:

- :func:`limit_arenas` at a process's start (``mallopt(M_ARENA_MAX, n)``, as ``MALLOC_ARENA_MAX``
  does from the environment);
- :func:`release_free_memory` after a step (``malloc_trim(0)``: freed pages go back to the system).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import sys
from typing import Any

__all__ = ["limit_arenas", "release_free_memory"]

log = logging.getLogger(__name__)
_M_ARENA_MAX = -8  # <malloc.h>


@functools.cache
def _glibc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "gnu_get_libc_version") else None  # glibc only (not musl)


def limit_arenas(n: int = 2) -> bool:
    """At most ``n`` malloc arenas in this process (True when set). Call it before threads start."""
    if n < 1:
        raise ValueError(f"limit_arenas: need at least 1 arena, got {n}")
    libc = _glibc()
    if libc is None:
        return False
    ok = bool(libc.mallopt(_M_ARENA_MAX, n))
    if not ok:
        log.warning("mallopt(M_ARENA_MAX, %d) failed: the heap may grow with the threads", n)
    return ok


def release_free_memory() -> bool:
    """Give the heap's free pages back to the system (True when glibc released any)."""
    libc = _glibc()
    return bool(libc.malloc_trim(0)) if libc is not None else False
