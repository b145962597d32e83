"""Utilisation accounting shared by the executors and the function runtime.

``utilisation = busy_s / provisioned_s``: busy is the time reward code ran; provisioned is the time
capacity was held for it (fixed pools: slots x wall time; elastic runtimes: the lifetime of every
worker, cold starts and idle tails included). ``billed_s`` is what a per-request serverless bill
counts instead (AWS Lambda / Function Compute on-demand: each invocation's duration rounded up to 1 ms,
plus the init phase of a cold start; idle keep-alive is not billed), reported as ``utilisation_billed``.
"""

from __future__ import annotations

import time

__all__ = ["UtilisationMeter"]


class UtilisationMeter:
    """Counters for one executor or runtime. ``slots``: fixed capacity (None: provisioned is reported
    by :meth:`add_provisioned`). ``billed``: report ``billed_s`` (recorded per call) in :meth:`stats`."""

    def __init__(self, slots: int | None = None, billed: bool = False) -> None:
        self.slots = slots
        self.billed = billed
        self.reset()

    def reset(self) -> None:
        self.t0 = time.monotonic()
        self.calls = 0
        self.failures = 0
        self.retries = 0
        self.busy_s = 0.0
        self.billed_s = 0.0
        self.queue_s = 0.0
        self.queue_max_s = 0.0
        self.cold_starts = 0
        self.in_flight = 0
        self.peak_in_flight = 0
        self._provisioned_s = 0.0

    def enter(self) -> None:
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)

    def leave(self) -> None:
        self.in_flight -= 1

    def record(
        self,
        *,
        busy_s: float,
        queue_s: float = 0.0,
        ok: bool = True,
        cold: bool = False,
        billed_s: float = 0.0,
    ) -> None:
        self.calls += 1
        self.failures += 0 if ok else 1
        self.busy_s += busy_s
        self.billed_s += billed_s
        self.queue_s += queue_s
        self.queue_max_s = max(self.queue_max_s, queue_s)
        self.cold_starts += int(cold)

    def add_provisioned(self, seconds: float) -> None:
        self._provisioned_s += seconds

    def provisioned_s(self, extra: float = 0.0) -> float:
        if self.slots is not None:
            return self.slots * (time.monotonic() - self.t0)
        return self._provisioned_s + extra

    def stats(self, provisioned_extra: float = 0.0) -> dict[str, float]:
        prov = self.provisioned_s(provisioned_extra)
        out: dict[str, float] = {
            "calls": self.calls,
            "failures": self.failures,
            "retries": self.retries,
            "busy_s": round(self.busy_s, 6),
            "provisioned_s": round(prov, 6),
            "utilisation": self.busy_s / prov if prov > 0 else 0.0,
            "queue_delay_s_mean": self.queue_s / self.calls if self.calls else 0.0,
            "queue_delay_s_max": self.queue_max_s,
            "cold_starts": self.cold_starts,
            "in_flight": self.in_flight,
            "peak_in_flight": self.peak_in_flight,
        }
        if self.billed:
            out["billed_s"] = round(self.billed_s, 6)
            out["utilisation_billed"] = self.busy_s / self.billed_s if self.billed_s > 0 else 0.0
        return out
