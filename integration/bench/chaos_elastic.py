"""The chaos run's elastic change (``chaos.py``): an engine added through the run's admin endpoint at a
seed-drawn trainer version, then, once it has served requests, one of the run's first engines removed
with a one-second drain (what it still runs is handed back). Throughput is the trainer's steps per
minute over the ``WINDOW_S`` seconds before each change began and after it ended."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

WINDOW_S = 30.0
SERVED_BEFORE_REMOVE = 20
DRAIN_S = 1.0


class ElasticPhase:
    """Polled by the chaos loop (:meth:`tick`); :meth:`result` for the report."""

    def __init__(self, seed: int) -> None:
        self.add_at = 2 + random.Random(seed + 7).randrange(4)  # a trainer version
        self.samples: list[tuple[float, int]] = []  # (time, trainer version)
        self.add: dict[str, Any] = {}
        self.remove: dict[str, Any] = {}
        self._task: asyncio.Task[dict[str, Any]] | None = None

    @property
    def done(self) -> bool:
        return bool(self.remove.get("ended_s") or self.add.get("error") or self.remove.get("error"))

    async def tick(self, p: Any, t0: float, killed: str | None) -> None:
        from rollart_core.control.admin import admin_call

        now = time.perf_counter() - t0
        self.samples.append((now, p.trainer.version))
        if self._task is not None and not self._task.done():
            return
        if self._task is not None:  # a change just ended
            target = self.add if not self.add.get("ended_s") and not self.add.get("error") else self.remove
            self._task, task = None, self._task
            try:
                target.update(answer=task.result(), ended_s=now)
            except Exception as exc:
                target.update(error=f"{type(exc).__name__}: {exc}", ended_s=now)
            print(f"[chaos] t={now:.1f}s v{p.trainer.version}: elastic {target}", flush=True)
            return
        run_dir = p.config.output_dir
        if not self.add and p.trainer.version >= self.add_at:
            self.add = {"at_version": p.trainer.version, "started_s": now}
            self._task = asyncio.create_task(
                asyncio.to_thread(admin_call, run_dir, "POST", "/engines", {"group": "gen"}, 900)
            )
        elif self.add.get("ended_s") and not self.remove and not self.add.get("error"):
            added = self.add["answer"]["name"]
            if p.proxy.workers[added].served < SERVED_BEFORE_REMOVE:
                return
            first = sorted(n for n in p.proxy.workers if n != added and n != killed) or [killed]
            self.remove = {"name": first[0], "at_version": p.trainer.version, "started_s": now}
            self._task = asyncio.create_task(
                asyncio.to_thread(
                    admin_call,
                    run_dir,
                    "DELETE",
                    f"/engines/{first[0]}?drain_timeout_s={DRAIN_S:g}",
                    None,
                    900,
                )
            )

    def _rate(self, start: float, end: float) -> float | None:
        """Trainer steps per minute between two moments (None: no sample that early or late)."""
        inside = [(t, v) for t, v in self.samples if start <= t <= end]
        if len(inside) < 2 or inside[-1][0] - inside[0][0] < 0.5 * (end - start):
            return None
        (ta, va), (tb, vb) = inside[0], inside[-1]
        return 60.0 * (vb - va) / (tb - ta)

    def result(self, p: Any) -> dict[str, Any]:
        out: dict[str, Any] = {"add": self.add, "remove": self.remove, "proxy": dict(p.proxy.elastic)}
        for change in (self.add, self.remove):
            if "started_s" in change and "ended_s" in change:
                change["steps_per_min_before"] = self._rate(
                    change["started_s"] - WINDOW_S, change["started_s"]
                )
                change["steps_per_min_after"] = self._rate(change["ended_s"], change["ended_s"] + WINDOW_S)
        added = self.add.get("answer", {}).get("name")
        out["added_served"] = p.proxy.workers[added].served if added in p.proxy.workers else None
        return out


def violations(r: dict[str, Any]) -> list[str]:
    bad = []
    add, remove = r.get("add", {}), r.get("remove", {})
    if not add or add.get("error"):
        bad.append(f"no engine was added: {add.get('error', 'the run ended first')}")
    elif not r.get("added_served"):
        bad.append(f"the added engine {add['answer']['name']} served no request")
    if not remove or remove.get("error"):
        bad.append(f"no engine was removed: {remove.get('error', 'the run ended first')}")
    return bad


def rows(r: dict[str, Any]) -> list[tuple[str, str]]:
    def rate(c: dict[str, Any]) -> str:
        b, a = c.get("steps_per_min_before"), c.get("steps_per_min_after")
        return f"steps/min {b if b is None else round(b, 1)} before, {a if a is None else round(a, 1)} after"

    add, remove = r.get("add", {}), r.get("remove", {})
    out = []
    if add.get("answer"):
        ans = add["answer"]
        out.append(
            (
                "engine added",
                f"{ans['name']} at v{add['at_version']}, served v{ans['version']} after {ans['seconds']:.0f} s; "
                f"{r.get('added_served')} requests; {rate(add)}",
            )
        )
    if remove.get("answer"):
        ans = remove["answer"]
        out.append(
            (
                "engine removed",
                f"{ans['name']} at v{remove['at_version']} in {ans['seconds']:.1f} s: {ans['drained']} drained, "
                f"{ans['handed_back']} handed back; {rate(remove)}",
            )
        )
    return out
