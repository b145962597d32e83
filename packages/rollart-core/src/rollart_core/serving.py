"""What the member packages' servers share: whether a bind address stays on this machine, and
serving until SIGTERM or SIGINT (``rollart-env serve``, ``rollart-reward serve``)."""

from __future__ import annotations

import asyncio
import ipaddress
import signal
from collections.abc import Awaitable, Callable

__all__ = ["is_loopback", "serve_until_signalled"]


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses; any other name is assumed to reach beyond this
    machine (servers warn, or refuse to start without an API key, when bound there)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def serve_until_signalled(stop: Callable[[], Awaitable[None]]) -> None:
    """Wait for SIGTERM or SIGINT, then await ``stop()`` (also when the wait is cancelled)."""
    stopped = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopped.set)
    try:
        await stopped.wait()
    finally:
        await stop()
