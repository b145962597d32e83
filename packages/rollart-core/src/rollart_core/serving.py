"""What the member packages' servers share: whether a bind address stays on this machine, a free port,
bearer
API keys (the proxy's OpenAI server, ``rollart-env``'s EnvServer), and serving until SIGTERM or
SIGINT (``rollart-env serve``, ``rollart-reward serve``)."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import os
import signal
import socket
from collections.abc import Awaitable, Callable, Sequence

__all__ = [
    "INT64_MAX",
    "INT64_MIN",
    "ApiKeys",
    "bearer_token",
    "free_port",
    "is_loopback",
    "serve_until_signalled",
]


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
"""The range of a seed at every server's edge (vLLM's OpenAI server bounds ``seed`` the same way:
a larger one breaks the engine)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the OS picks it; a caller binding later can still race)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


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


def bearer_token(authorization: str | None) -> bytes | None:
    """The token of an ``Authorization: Bearer <token>`` header, or None."""
    scheme, _, value = (authorization or "").partition(" ")
    value = value.strip()
    return value.encode() if scheme.lower() == "bearer" and value else None


class ApiKeys:
    """A server's API keys: ``keys`` as a comma-separated string or a list; None reads the
    environment variable ``env_var`` (keeps keys out of ``ps`` and config files); empty means none.
    Each key has a principal that names it without holding it (what a session's owner is recorded as)."""

    def __init__(self, keys: str | Sequence[str] | None, env_var: str) -> None:
        if keys is None:
            keys = os.environ.get(env_var, "")
        listed = [k.strip() for k in keys.split(",")] if isinstance(keys, str) else list(keys)
        self._keys = [(k.encode(), "key-" + hashlib.sha256(k.encode()).hexdigest()[:16]) for k in listed if k]

    def __bool__(self) -> bool:
        return bool(self._keys)

    def matches(self, token: bytes) -> bool:
        """Whether ``token`` is one of the keys (compared in constant time)."""
        return any(hmac.compare_digest(token, key) for key, _ in self._keys)

    def check(self, token: bytes | None) -> tuple[str | None, str | None]:
        """``(principal, None)``; ``(None, None)`` when there are no keys; ``(None, why)`` for a
        request that must get 401."""
        if not self._keys:
            return None, None
        if token is None:
            return None, "missing API key (Authorization: Bearer <key>)"
        for key, principal in self._keys:
            if hmac.compare_digest(token, key):
                return principal, None
        return None, "invalid API key"
