"""rollart_core.serving: what the member packages' servers share."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from rollart_core.serving import ApiKeys, bearer_token, is_loopback, serve_until_signalled


def test_what_counts_as_binding_beyond_loopback() -> None:
    # addresses as strings only: nothing here binds anything
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.0.0.2", "localhost", "::1"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "10.1.2.3", "::", "myhost.example"))


def test_bearer_token_reads_only_a_bearer_header() -> None:
    assert bearer_token("Bearer abc") == b"abc"
    assert bearer_token("bearer  abc ") == b"abc"
    assert bearer_token(None) is None
    assert bearer_token("Bearer ") is None
    assert bearer_token("Basic abc") is None
    assert bearer_token("abc") is None


def test_api_keys_from_a_string_a_list_or_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    keys = ApiKeys("k1, k2,", "UNUSED")
    p1, ok = keys.check(b"k1")
    p2, _ = keys.check(b"k2")
    assert ok is None and p1 and p2 and p1 != p2 and "k1" not in p1  # a principal names, never holds, a key
    assert keys.check(None) == (None, "missing API key (Authorization: Bearer <key>)")
    assert keys.check(b"k3") == (None, "invalid API key")
    assert keys.matches(b"k2") and not keys.matches(b"k")
    assert ApiKeys(["k1"], "UNUSED").check(b"k1") == (p1, None)  # the same key, the same principal

    monkeypatch.setenv("ROLLART_TEST_KEYS", "e1,e2")
    from_env = ApiKeys(None, "ROLLART_TEST_KEYS")
    assert from_env and from_env.check(b"e2")[1] is None
    none = ApiKeys("", "ROLLART_TEST_KEYS")  # an empty string means none, the variable unread
    assert not none and none.check(None) == (None, None) and none.check(b"e1") == (None, None)


async def test_serve_until_signalled_stops_on_sigterm() -> None:
    stopped = asyncio.Event()

    async def stop() -> None:
        stopped.set()

    serving = asyncio.create_task(serve_until_signalled(stop))
    await asyncio.sleep(0)  # the handlers are installed once the task runs
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(serving, 10)
        assert stopped.is_set()
    finally:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
