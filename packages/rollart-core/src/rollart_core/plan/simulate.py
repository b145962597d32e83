"""Discrete-event simulation of a rollout/training pipeline: predicts Sync+ vs async throughput.

Pure Python (``heapq``), one event per stage of every trajectory, so a cluster of thousands of GPUs
(tens of thousands of generation slots) simulates in seconds. The model follows the training loop
(:mod:`rollart_core.control`):

- a trajectory is: env reset → (generate turn → env step) × turns → reward, each stage waiting for a
  free slot of its pool (generation slots = engines × concurrent sequences; env and reward slots,
  or unbounded: serverless);
- ``sync`` (Sync+): launch a step's groups, wait for the *last* trajectory, train, update weights;
- ``async``: a producer keeps ``groups_per_step × max_pending_steps`` groups launched but not yet
  trained on; the trainer takes complete groups within the staleness bound ``alpha``, updates the
  engines' weights (generation is suspended meanwhile), trains while rollout continues, then aborts in-flight trajectories that can no
  longer meet ``alpha``.

Per-turn generation time comes from the profile's measured latencies or from a callable (the
planner's roofline model for a hardware class).
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from rollart_core.errors import ConfigError
from rollart_core.plan.workload import TaskProfile, WorkloadProfile

__all__ = ["SimResult", "simulate"]

GenTime = Callable[[TaskProfile, int, random.Random], float]
"""(task, turn index, rng) → seconds for one turn's generation (prefill + decode)."""


@dataclass
class SimResult:
    mode: str
    traj_per_s: float
    """Finished trajectories per second over the measured steps (after ``warmup_steps``)."""
    step_s: float
    steps: int
    trained: int
    aborted: int
    gen_busy: float
    """Mean fraction of generation slots busy (when bounded)."""
    step_times: list[float] = field(default_factory=list)


class _Pool:
    """``slots`` parallel servers with a FIFO queue (None: unbounded)."""

    def __init__(self, sim: _Sim, slots: int | None, tag: str) -> None:
        self.sim, self.slots, self.free, self.tag = sim, slots, slots, tag
        self.queue: deque[tuple[float, Callable[[], None]]] = deque()
        self.busy_time = 0.0
        self.active = 0
        """Requests in service now."""
        self.resume_at = 0.0
        """While suspended (weight update), work starts only from here."""

    def submit(self, service: float, done: Callable[[], None]) -> None:
        if self.free is None or self.free > 0:
            self._start(service, done)
        else:
            self.queue.append((service, done))

    def _start(self, service: float, done: Callable[[], None]) -> None:
        if self.free is not None:
            self.free -= 1
        self.busy_time += service
        self.active += 1

        def finish() -> None:
            self.active -= 1
            if self.free is not None:
                self.free += 1
                if self.queue:
                    self._start(*self.queue.popleft())
            done()

        self.sim.at(max(self.sim.now, self.resume_at) + service, finish, self.tag)


class _Traj:
    __slots__ = ("alive", "group", "task", "turn", "turns", "version")

    def __init__(self, task: TaskProfile, group: _Group, turns: int) -> None:
        self.task, self.group, self.turns, self.turn, self.alive = task, group, turns, 0, True
        self.version: int | None = None  # of its oldest token: set by its first generation turn


class _Group:
    __slots__ = ("done", "finished", "size", "version")

    def __init__(self, size: int, version: int) -> None:
        self.size, self.done, self.finished, self.version = size, 0, 0, version
        """Oldest policy version among its trajectories' tokens."""


class _Sim:
    def __init__(
        self,
        profile: WorkloadProfile,
        mode: str,
        alpha: int,
        gen_slots: int | None,
        env_slots: int | None,
        reward_slots: int | None,
        gen_time: GenTime | None,
        seed: int,
    ) -> None:
        self.p, self.mode, self.alpha = profile, mode, alpha
        self.rng = random.Random(seed)
        self.now, self._seq = 0.0, 0
        self.events: list[tuple[float, int, Callable[[], None], str]] = []
        self.gen = _Pool(self, gen_slots, "gen")
        self.env = _Pool(self, env_slots, "env")
        self.reward = _Pool(self, reward_slots, "reward")
        self.gen_time = gen_time
        self.version = 0  # trainer's version
        self.served = 0  # engines' version (new trajectories start at it)
        self.training = False
        self.inflight: set[_Traj] = set()
        self.ready: deque[_Group] = deque()
        self.finished = 0
        self.aborted = 0
        self.on_group: Callable[[], None] = lambda: None

    def at(self, t: float, fn: Callable[[], None], tag: str = "") -> None:
        self._seq += 1
        heapq.heappush(self.events, (t, self._seq, fn, tag))

    def suspend_generation(self, seconds: float) -> None:
        """Suspend → Update → Resume: in-flight turns keep their state but make no progress."""
        if seconds <= 0:
            return
        self.events = [
            (t + seconds, q, fn, tag) if tag == "gen" else (t, q, fn, tag) for t, q, fn, tag in self.events
        ]
        heapq.heapify(self.events)
        self.gen.resume_at = self.now + seconds

    def run_until(self, cond: Callable[[], bool]) -> None:
        while not cond():
            if not self.events:
                raise RuntimeError("simulation deadlocked (no events left)")
            self.now, _, fn, _ = heapq.heappop(self.events)
            fn()

    # one trajectory ---------------------------------------------------------------------------------

    def launch_group(self, task: TaskProfile) -> None:
        g = _Group(task.group_size, 1 << 62)
        for _ in range(task.group_size):
            tr = _Traj(task, g, task.sample_turns(self.rng))
            self.inflight.add(tr)
            self.env.submit(task.env_latency_s.sample(self.rng), lambda tr=tr: self._after_env(tr))

    def _after_env(self, tr: _Traj) -> None:
        if not tr.alive:
            return
        if tr.turn >= tr.turns:
            self.reward.submit(tr.task.reward_s.sample(self.rng), lambda: self._done(tr, True))
            return
        if tr.version is None:
            tr.version = self.served
            tr.group.version = min(tr.group.version, tr.version)
        self.gen.submit(self._gen_service(tr), lambda: self._after_gen(tr))

    def _gen_service(self, tr: _Traj) -> float:
        task = tr.task
        if self.gen_time is not None:
            t = self.gen_time(task, tr.turn, self.rng)
        elif task.generate_s is not None:
            t = task.generate_s.sample(self.rng)
        else:
            raise ConfigError(
                f"task {task.name!r}: no generation latency (measure one or give a hardware class)"
            )
        if self.training and self.p.train.colocated_slowdown:
            t *= 1 + self.p.train.colocated_slowdown
        return t

    def _after_gen(self, tr: _Traj) -> None:
        if not tr.alive:
            return
        tr.turn += 1
        self.env.submit(tr.task.env_latency_s.sample(self.rng), lambda: self._after_env(tr))

    def _done(self, tr: _Traj, ok: bool) -> None:
        if not tr.alive:
            return
        tr.alive = False
        self.inflight.discard(tr)
        g = tr.group
        g.done += 1
        if ok:
            g.finished += 1
            self.finished += 1
        if g.done == g.size:
            self.ready.append(g)
            self.on_group()

    def abort_stale(self) -> None:
        for tr in list(self.inflight):
            if tr.version is not None and self.version - tr.version > self.alpha:
                self.aborted += 1
                self._done(tr, False)


def simulate(
    profile: WorkloadProfile,
    *,
    mode: Literal["sync", "async"] = "sync",
    alpha: int = 1,
    steps: int = 8,
    warmup_steps: int = 1,
    gen_slots: int | None = None,
    env_slots: int | None = None,
    reward_slots: int | None = None,
    max_pending_steps: int | None = None,
    gen_time: GenTime | None = None,
    seed: int = 0,
) -> SimResult:
    """Simulate ``steps`` training steps; ``gen_slots`` defaults to the profile's ``gen_slots``."""
    if mode not in ("sync", "async"):
        raise ConfigError(f"simulate: mode must be 'sync' or 'async', got {mode!r}")
    if steps <= warmup_steps:
        raise ConfigError("simulate: steps must exceed warmup_steps")
    sim = _Sim(
        profile,
        mode,
        alpha if mode == "async" else 0,
        gen_slots or profile.gen_slots,
        env_slots,
        reward_slots,
        gen_time,
        seed,
    )
    groups_per_task = [(t, max(1, t.trajectories_per_step // t.group_size)) for t in profile.tasks]
    groups_per_step = sum(n for _, n in groups_per_task)
    order = [t for t, n in groups_per_task for _ in range(n)]  # round-robin like the loop's producer
    train = profile.train
    step_ends: list[tuple[float, int]] = [(0.0, 0)]
    trained = 0
    if mode == "sync":
        for _ in range(steps):
            for t in order:
                sim.launch_group(t)
            sim.run_until(lambda: len(sim.ready) >= groups_per_step)
            trained += sum(g.finished for g in sim.ready)
            sim.ready.clear()
            sim.now += train.train_s + train.sync_s  # rollout is idle: nothing can happen meanwhile
            sim.version += 1
            sim.served = sim.version
            step_ends.append((sim.now, sim.finished))
    else:
        pending_max = groups_per_step * (max_pending_steps or max(alpha, 1))
        state = {"pending": 0, "i": 0}

        def produce() -> None:
            while state["pending"] < pending_max:
                sim.launch_group(order[state["i"] % len(order)])
                state["i"] += 1
                state["pending"] += 1

        def take_batch() -> list[_Group]:
            batch: list[_Group] = []
            while sim.ready and len(batch) < groups_per_step:
                g = sim.ready.popleft()
                state["pending"] -= 1
                if g.finished and sim.version - min(g.version, sim.served) <= alpha:
                    batch.append(g)
            return batch

        produce()
        for step in range(steps):
            batch: list[_Group] = []
            while len(batch) < groups_per_step:
                sim.run_until(lambda: bool(sim.ready))
                batch += take_batch()
                produce()
            if step:  # Suspend/Update/Resume: the engines load the previous step's weights
                sim.suspend_generation(train.sync_s)
                _advance(sim, train.sync_s)
                sim.served = sim.version
            trained += sum(g.finished for g in batch)
            sim.training = True
            _stretch_generation(sim, 1 + train.colocated_slowdown)
            _train_beside_rollout(sim, train.train_s, train.train_colocated_slowdown)
            _stretch_generation(sim, 1 / (1 + train.colocated_slowdown))
            sim.training = False
            sim.version += 1
            sim.abort_stale()
            produce()
            step_ends.append((sim.now, sim.finished))
    t0, f0 = step_ends[warmup_steps]
    t1, f1 = step_ends[-1]
    times = [b[0] - a[0] for a, b in itertools.pairwise(step_ends)]
    busy = sim.gen.busy_time / (sim.gen.slots * t1) if sim.gen.slots and t1 > 0 else 0.0
    return SimResult(
        mode,
        (f1 - f0) / (t1 - t0) if t1 > t0 else 0.0,
        (t1 - t0) / (steps - warmup_steps),
        steps,
        trained,
        sim.aborted,
        min(busy, 1.0),
        times,
    )


def _stretch_generation(sim: _Sim, factor: float) -> None:
    """Generation turns in progress go ``factor`` times slower from now on (processor sharing with
    the trainer on shared hardware: > 1 when training starts, its inverse when it ends)."""
    if factor == 1:
        return
    sim.events = [
        (sim.now + (t - sim.now) * factor, q, fn, tag) if tag == "gen" and t > sim.now else (t, q, fn, tag)
        for t, q, fn, tag in sim.events
    ]
    heapq.heapify(sim.events)


def _train_beside_rollout(sim: _Sim, work_s: float, slowdown: float) -> None:
    """Rollout goes on while the trainer runs ``work_s`` seconds of work; on shared hardware the
    trainer progresses at ``1 / (1 + slowdown)`` of its speed whenever generation is running."""
    while work_s > 1e-12:
        rate = 1.0 / (1.0 + slowdown) if slowdown and sim.gen.active else 1.0
        if not sim.events or sim.now + work_s / rate < sim.events[0][0]:
            sim.now += work_s / rate
            return
        t, _, fn, _ = heapq.heappop(sim.events)
        work_s -= (t - sim.now) * rate
        sim.now = t
        fn()


def _advance(sim: _Sim, seconds: float) -> None:
    end = sim.now + seconds
    while sim.events and sim.events[0][0] <= end:
        sim.now, _, fn, _ = heapq.heappop(sim.events)
        fn()
    sim.now = end
