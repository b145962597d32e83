"""Per-worker metrics kept by the proxy: queue depth, tokens/s, prefill vs decode, time suspended.

The proxy sees every request, so these numbers exist for every engine kind (in-process, Ray actor,
HTTP server) without asking the engine. Engines that report more (``get_stats``) are merged in by
:meth:`LLMProxy.metrics`.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

__all__ = ["WorkerMetrics"]


@dataclass
class WorkerMetrics:
    window_s: float = 30.0
    """Tokens/s are averaged over this sliding window."""
    queued: int = 0
    """Requests waiting for one of the worker's in-flight slots (back-pressure)."""
    requests: int = 0
    failures: int = 0
    restarts_seen: int = 0
    """Times the worker came back restarted (its engine not started: a fresh Ray actor)."""
    recovered: int = 0
    """Times the worker was brought back to healthy (started and on the served weights)."""
    update_failures: int = 0
    """Weight updates (or prefetches) it failed while other workers made them: taken out each time."""
    aborted: int = 0
    prefill_tokens: int = 0
    """Prompt tokens sent to the worker (the engine may serve part of them from its prefix cache)."""
    decode_tokens: int = 0
    """Generated tokens."""
    suspended_s: float = 0.0
    _suspended_since: float | None = None
    _events: deque[tuple[float, int]] = field(default_factory=deque)

    def record(self, prompt_tokens: int, output_tokens: int, finish_reason: str) -> None:
        self.requests += 1
        self.prefill_tokens += prompt_tokens
        self.decode_tokens += output_tokens
        if finish_reason == "abort":
            self.aborted += 1
        now = time.monotonic()
        self._events.append((now, output_tokens))
        self._trim(now)

    def _trim(self, now: float) -> None:
        while self._events and self._events[0][0] < now - self.window_s:
            self._events.popleft()

    def suspend(self) -> None:
        if self._suspended_since is None:
            self._suspended_since = time.monotonic()

    def unsuspend(self) -> None:
        if self._suspended_since is not None:
            self.suspended_s += time.monotonic() - self._suspended_since
            self._suspended_since = None

    def add_suspended(self, seconds: float) -> None:
        self.suspended_s += seconds

    def tokens_per_s(self) -> float:
        now = time.monotonic()
        self._trim(now)
        if not self._events:
            return 0.0
        span = max(now - self._events[0][0], 1.0)
        return sum(n for _, n in self._events) / min(span, self.window_s)

    def snapshot(self, inflight: int) -> dict[str, Any]:
        susp = self.suspended_s
        if self._suspended_since is not None:
            susp += time.monotonic() - self._suspended_since
        return {
            "inflight": inflight,
            "queued": self.queued,
            "queue_depth": inflight + self.queued,
            "requests": self.requests,
            "failures": self.failures,
            "restarts_seen": self.restarts_seen,
            "recovered": self.recovered,
            "update_failures": self.update_failures,
            "aborted": self.aborted,
            "prefill_tokens": self.prefill_tokens,
            "decode_tokens": self.decode_tokens,
            "tokens_per_s": round(self.tokens_per_s(), 2),
            "suspended_s": round(susp, 4),
            "suspended": self._suspended_since is not None,
        }
