"""What every engine back-end (in-process vLLM, vLLM's and SGLang's servers) does the same way."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from rollart_core.errors import EngineError
from rollart_proxy.metrics import WorkerMetrics


def check_stop_strings(stop: Sequence[Any]) -> None:
    """Stop strings are untrusted request input: an empty or non-string one is refused, not sent."""
    if any(not isinstance(x, str) or not x for x in stop):
        raise EngineError(f"invalid sampling parameters: stop strings must be non-empty, got {list(stop)}")


def count_update(stats: dict[str, Any], metrics: WorkerMetrics, t0: float, own_pause: bool) -> float:
    """Book a finished weight update; returns how long generation was paused for it (seconds since
    ``t0``). A pause the caller held (``own_pause`` False) is the caller's to report as suspended."""
    paused = time.perf_counter() - t0
    stats["updates"] += 1
    stats["update_pause_s"] += paused
    if own_pause:
        metrics.add_suspended(paused)
    return paused


def engine_stats(
    stats: dict[str, Any], metrics: WorkerMetrics, inflight: int, version: int, paused: bool
) -> dict[str, Any]:
    """An engine's ``get_stats()``: its counters plus queue depth, tokens/s, prefill (cache misses) vs
    decode tokens and the time generation was suspended (the engine's own pauses included)."""
    m = metrics.snapshot(inflight)
    return {
        **stats,
        "inflight": inflight,
        "version": version,
        "paused": paused,
        "tokens_per_s": m["tokens_per_s"],
        "prefill_tokens": m["prefill_tokens"],
        "decode_tokens": m["decode_tokens"],
        "suspended_s": m["suspended_s"] + stats.get("suspended_s", 0.0),
    }
