"""Where the machine's CPU time goes, per stage of the bench's pipeline: read off ``/proc``.

:class:`ProcessCpu` samples every process's CPU time (``/proc/<pid>/stat``: user + system, and
the time of children it reaped) and the machine's (``/proc/stat``) while active, and charges each
process to a stage by its ancestry: the engines' actor processes and what they start
(``generate``), the trainer's ranks (``train``), the reward runtime's process tree (``reward``),
the driver itself (``driver``), the rest of the driver's descendants (``ray``: the raylet, the GCS,
idle workers, the runtime's host actor), and everything else on the machine (``other``). A process
that exits between two samples is not lost: its time reaches its parent's reaped time, from which
what was already counted is taken off.

:func:`cpu_figures` turns one window's CPU seconds into the CPU-charged compute bound and the
breakdown of the machine's core-seconds (pure arithmetic, unit-tested on synthetic figures).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["BREAKDOWN", "RUN_STAGES", "ProcessCpu", "cpu_figures", "read_procs"]

RUN_STAGES = ("generate", "train", "env", "reward", "driver", "ray")
"""Where this run's own CPU time goes (``env`` and the in-driver part of ``reward`` are charged off
the driver's time per call: the bench's environments and in-process rewards run in the driver)."""
BREAKDOWN = (*RUN_STAGES, "other", "idle")
"""Every core-second of the machine: the run's stages, other processes, idle cores."""
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class Proc:
    ppid: int
    own: int
    """utime + stime, clock ticks."""
    reaped: int
    """cutime + cstime: the time of children it has waited for, clock ticks."""


def read_procs() -> dict[tuple[int, int], Proc]:
    """Every process now, keyed by (pid, start time) so that a reused pid is a new process."""
    out: dict[tuple[int, int], Proc] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                text = f.read()
        except OSError:  # exited meanwhile
            continue
        rest = text[text.rfind(b")") + 2 :].split()
        try:
            out[(int(name), int(rest[19]))] = Proc(
                int(rest[1]), int(rest[11]) + int(rest[12]), int(rest[13]) + int(rest[14])
            )
        except (IndexError, ValueError):
            continue
    return out


def _machine() -> tuple[int, int]:
    """(busy, total) clock ticks of all cores (``/proc/stat``)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields[:8]) - idle, sum(fields[:8])


class ProcessCpu:
    """Per-stage CPU seconds of this run while active (``async with ProcessCpu(roots) as cpu``).

    ``roots``: stage → pids whose process trees are that stage's (engines, trainer ranks, reward
    runtime); ``driver``: this run's driver process (default: this one). Read a window with
    :meth:`seconds`."""

    def __init__(
        self, roots: Mapping[str, Iterable[int]], driver: int | None = None, period: float = 0.5
    ) -> None:
        self.roots = {pid: stage for stage, pids in roots.items() for pid in pids}
        self.driver = os.getpid() if driver is None else driver
        self.period = period
        self.samples: list[tuple[float, int, int, dict[str, int]]] = []
        """(time, machine busy, machine total, cumulative ticks per stage of the run)."""
        self._procs: dict[tuple[int, int], Proc] = {}
        self._stage: dict[tuple[int, int], str] = {}
        self._pending: dict[tuple[int, int], int] = {}
        self._acc: dict[str, int] = {}
        self._task: asyncio.Task[None] | None = None

    def _classify(self, key: tuple[int, int], procs: Mapping[int, tuple[int, int]]) -> str:
        """The stage of a process: its own or its nearest ancestor's root; ``ray`` under the driver;
        ``other`` elsewhere. Kept once known (a process whose parent dies is re-parented)."""
        known = self._stage.get(key)
        if known is not None:
            return known
        pid, seen = key[0], 0
        stage = "other"
        while pid > 1 and seen < 64:
            if pid in self.roots:
                stage = self.roots[pid]
                break
            if pid == self.driver:
                stage = "driver" if pid == key[0] else "ray"
                break
            parent = procs.get(pid)
            if parent is None:
                break
            pid, seen = parent[0], seen + 1
        self._stage[key] = stage
        return stage

    def sample(self) -> None:
        now = read_procs()
        by_pid = {pid: (p.ppid, start) for (pid, start), p in now.items()}
        first = not self.samples
        # a process gone since the last sample: its last counted time will come back in its
        # parent's reaped time, which must not count it twice
        parents = {pid: (pid, start) for pid, start in now}
        for key, old in self._procs.items():
            if key not in now:
                parent = parents.get(old.ppid)
                if parent is not None:
                    self._pending[parent] = self._pending.get(parent, 0) + old.own + old.reaped
        for key, p in now.items():
            stage = self._classify(key, by_pid)
            if stage == "other" or first:
                continue
            before = self._procs.get(key)
            if before is None:  # born since the last sample: all its time is in the window
                delta = p.own + p.reaped
            else:
                reaped = p.reaped - before.reaped
                owed = min(reaped, self._pending.get(key, 0))
                if owed:
                    self._pending[key] -= owed
                delta = p.own - before.own + reaped - owed
            self._acc[stage] = self._acc.get(stage, 0) + max(0, delta)
        self._procs = {k: p for k, p in now.items() if self._stage.get(k) != "other"}
        busy, total = _machine()
        self.samples.append((time.perf_counter(), busy, total, dict(self._acc)))

    async def _run(self) -> None:
        while True:
            await asyncio.to_thread(self.sample)
            await asyncio.sleep(self.period)

    async def __aenter__(self) -> ProcessCpu:
        self.sample()
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.sample()

    def seconds(self, window: tuple[float, float]) -> dict[str, float] | None:
        """CPU seconds in ``window`` (between the samples nearest its ends): per stage of the run
        (``generate``, ``train``, ``reward``, ``driver``, ``ray``), ``busy`` and ``total`` of the
        machine (all cores), and ``wall``; None without two samples."""
        if len(self.samples) < 2:
            return None
        a = min(self.samples, key=lambda s: abs(s[0] - window[0]))
        b = min(self.samples, key=lambda s: abs(s[0] - window[1]))
        if b[0] <= a[0]:
            return None
        out = {
            st: (b[3].get(st, 0) - a[3].get(st, 0)) / _TICK
            for st in ("generate", "train", "reward", "driver", "ray")
        }
        out.update(busy=(b[1] - a[1]) / _TICK, total=(b[2] - a[2]) / _TICK, wall=b[0] - a[0])
        return out


def cpu_figures(
    seconds: Mapping[str, float],
    trained: int,
    cores: int,
    in_driver: Mapping[str, float] | None = None,
) -> dict[str, Any] | None:
    """The CPU-charged compute bound of one window and where its core-seconds went.

    ``seconds``: :meth:`ProcessCpu.seconds` (or their sums over windows); ``in_driver``: CPU seconds
    of the driver's time that were the environments' (``env``) and the in-process reward's
    (``reward``), estimated per call. Each stage's CPU seconds per trained trajectory add up to what
    one trajectory costs the ``cores`` the stages share: the bound is ``cores / that``. The
    breakdown is each stage's share of the machine's core-seconds, plus ``other`` (other processes)
    and ``idle``: achieved / this bound is the run's own share (``run``), so what the run leaves
    to the bound is exactly ``other + idle``. None without a trajectory or a window."""
    total = seconds.get("total", 0.0)
    if trained <= 0 or total <= 0:
        return None
    extra = dict(in_driver or {})
    driver = seconds.get("driver", 0.0)
    env = min(driver, extra.get("env", 0.0))
    reward_in = min(driver - env, extra.get("reward", 0.0))
    by_stage = {
        "generate": seconds.get("generate", 0.0),
        "train": seconds.get("train", 0.0),
        "env": env,
        "reward": seconds.get("reward", 0.0) + reward_in,
        "driver": driver - env - reward_in,
        "ray": seconds.get("ray", 0.0),
    }
    run = sum(by_stage.values())
    busy = max(seconds.get("busy", 0.0), run)  # samples of /proc and /proc/stat are not atomic
    share = {st: v / total for st, v in by_stage.items()}
    share["other"] = (busy - run) / total
    share["idle"] = max(0.0, 1.0 - busy / total)
    per_traj = {st: v / trained for st, v in by_stage.items()}
    return {
        "bound": cores / (run / trained) if run > 0 else None,
        "cpu_s_per_traj": run / trained,
        "cpu_s_per_traj_by_stage": per_traj,
        "run_share": run / total,
        "share": share,
        "cores": cores,
    }
