"""Discrete-event simulation of a rollout/training pipeline: predicts Sync+, One-off and async throughput.

Pure Python (``heapq``), one event per stage of every trajectory, so a cluster of thousands of GPUs
(tens of thousands of generation slots) simulates in seconds. The model follows the training loop's
recipes (:mod:`rollart_core.control`) step by step:

- a trajectory is: env reset → (generate turn → env step) × turns → reward, each stage waiting for a
  free slot of its pool (generation slots = engines × concurrent sequences; env and reward slots,
  or unbounded: serverless). An env call longer than the task's ``env_timeout_s`` ends the trajectory
  at the timeout; with ``fail_prob`` one of its first ``fail_within_calls`` calls fails;
- a group launches ``group_size + redundancy`` trajectories and cancels the surplus once
  ``group_size`` finished; it is ready when every member has a fate, and the batch takes ready groups
  oldest first, ``groups_per_step`` of each task, behind the staleness gate (as the SampleBuffer);
- ``sync`` (Sync+): launch a step's groups, wait for all of them, train, push, update; a group with
  nothing trainable is relaunched;
- ``one_off``: as Sync+, but the next step's groups launch as soon as the batch is taken, so their
  rollout overlaps training (they start one version old);
- ``async``: a producer keeps up to ``max_pending_steps`` (default alpha + 1) steps of groups launched
  and not yet trained on, admitting a group only if it can still be trained within alpha
  (:func:`rollart_core.control.admission.on_time`, the loop's own rule, per task), and with
  ``update_on_arrival`` already on the coming version as soon as a batch is taken (its first
  generation then waits for that version); the trainer trains beside rollout, the new weights land
  after ``push_s`` and the engines suspend for ``sync_s`` to load them; in-flight trajectories that
  can no longer meet alpha are aborted.

The versions are kept by the loop's own :class:`~rollart_core.control.clock.VersionClock`. Per-turn
generation time comes from the profile's measured latencies or from a callable (the planner's
roofline model for a hardware class).
"""

from __future__ import annotations

import functools
import heapq
import itertools
import random
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from rollart_core.control.admission import on_time
from rollart_core.control.clock import VersionClock
from rollart_core.errors import ConfigError
from rollart_core.plan.workload import TaskProfile, WorkloadProfile

__all__ = ["MODES", "SimResult", "simulate"]

Mode = Literal["sync", "one_off", "async"]
MODES: tuple[Mode, ...] = ("sync", "one_off", "async")
GenTime = Callable[[TaskProfile, int, random.Random], float]
"""(task, turn index, rng) → seconds for one turn's generation (prefill + decode)."""


@dataclass
class SimResult:
    mode: str
    traj_per_s: float
    """Trained trajectories per second over the measured steps (after ``warmup_steps``), the
    bench's steady-state figure."""
    step_s: float
    steps: int
    trained: int
    """Trajectories trained over all steps."""
    aborted: int
    """Trajectories aborted in flight because they could no longer meet alpha."""
    gen_busy: float
    """Mean fraction of generation slots busy (when bounded)."""
    train_busy: float = 0.0
    """Fraction of the time the trainer trains."""
    step_times: list[float] = field(default_factory=list)
    launched: int = 0
    fates: dict[str, int] = field(default_factory=dict)
    """Every launched trajectory's fate (those still in flight at the end: ``in_flight``)."""
    stale_groups: int = 0
    """Groups that ended with nothing trainable because their trajectories went stale."""
    lag_max: int = 0
    """Largest policy lag (trainer version − oldest token's version) of a trained trajectory."""
    warmup_steps: int = 0
    window_fill: float | None = None
    """async: mean number of groups launched and not yet taken over the measured steps, as a share
    of the most admission allows (``max_pending_steps`` steps of groups); what the bench's
    achieved / window bound estimates by Little's law."""


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


class _Group:
    __slots__ = (
        "aborted",
        "done",
        "finished",
        "members",
        "need",
        "seq",
        "size",
        "start_version",
        "task",
        "versions",
    )

    def __init__(self, task: TaskProfile, start_version: int, seq: int) -> None:
        self.task, self.start_version, self.seq = task, start_version, seq
        self.need = task.group_size
        self.size = task.group_size + task.redundancy
        self.done = 0
        self.finished = 0
        self.aborted = 0
        self.members: list[_Traj] = []
        self.versions: list[int] = []
        """Oldest token's version of each finished member."""


class _Traj:
    __slots__ = ("alive", "calls", "fail_at", "group", "task", "turn", "turns", "version")

    def __init__(self, task: TaskProfile, group: _Group, turns: int, fail_at: int) -> None:
        self.task, self.group, self.turns, self.turn, self.alive = task, group, turns, 0, True
        self.calls = 0
        self.fail_at = fail_at
        """Env call (0 = reset) that fails; -1: none."""
        self.version: int | None = None
        """Version of its oldest token: set by its first generation turn."""

    def min_version(self) -> int:
        return self.group.start_version if self.version is None else self.version


class _Sim:
    def __init__(
        self,
        profile: WorkloadProfile,
        alpha: int,
        gen_slots: int | None,
        env_slots: int | None,
        reward_slots: int | None,
        gen_time: GenTime | None,
        seed: int,
    ) -> None:
        self.p, self.alpha = profile, alpha
        self.rng = random.Random(seed)
        self.now, self._seq = 0.0, 0
        self.events: list[tuple[float, int, Callable[[], None], str]] = []
        self.gen = _Pool(self, gen_slots, "gen")
        self.env = _Pool(self, env_slots, "env")
        self.reward = _Pool(self, reward_slots, "reward")
        self.gen_time = gen_time
        self.clock = VersionClock()
        self.training = False
        self.train_time = 0.0
        """Seconds the trainer trained."""
        self.inflight: set[_Traj] = set()
        self.waiting: list[_Traj] = []
        """Trajectories launched ahead on the coming version, waiting for it to be served."""
        self.groups: dict[int, _Group] = {}
        """Launched groups not yet taken, by launch number (the buffer's pending groups)."""
        self.ready: list[_Group] = []
        """Pending groups whose every member has a fate."""
        self.changed = True
        """A group became ready since the buffer last looked."""
        self.dropped_in_a_row = 0
        """Groups that ended with nothing trainable since the last batch (the loop's stall check)."""
        self.pending: Counter[str] = Counter()
        self.fates: Counter[str] = Counter()
        self.launched = 0
        self.stale_groups = 0
        self.on_change: Callable[[], None] = lambda: None
        """Called whenever admission may have changed (a group taken, a version served or expected)."""
        self.group_count: list[tuple[float, int]] = [(0.0, 0)]
        """(time, pending groups from then on) at every change: the window's fill over time."""

    def at(self, t: float, fn: Callable[[], None], tag: str = "") -> None:
        self._seq += 1
        heapq.heappush(self.events, (t, self._seq, fn, tag))

    def next_event(self) -> None:
        if not self.events:
            raise RuntimeError("simulation deadlocked (no events left)")
        self.now, _, fn, _ = heapq.heappop(self.events)
        fn()

    def suspend_generation(self, seconds: float) -> None:
        """Suspend → Update → Resume: in-flight turns keep their state but make no progress."""
        if seconds <= 0:
            return
        self.events = [
            (t + seconds, q, fn, tag) if tag == "gen" else (t, q, fn, tag) for t, q, fn, tag in self.events
        ]
        heapq.heapify(self.events)
        self.gen.resume_at = self.now + seconds

    def serve(self, version: int) -> None:
        self.clock.serve(version)
        ready = [tr for tr in self.waiting if tr.group.start_version <= version]
        self.waiting = [tr for tr in self.waiting if tr.group.start_version > version]
        for tr in ready:
            if tr.alive:
                self._generate(tr)
        self.on_change()

    # one trajectory ---------------------------------------------------------------------------------

    def launch_group(self, task: TaskProfile, start_version: int | None = None) -> _Group:
        g = _Group(task, self.clock.served if start_version is None else start_version, self.launched)
        self.groups[g.seq] = g
        self.group_count.append((self.now, len(self.groups)))
        self.pending[task.name] += 1
        for _ in range(g.size):
            fail_at = self.rng.randrange(task.fail_within_calls) if self.rng.random() < task.fail_prob else -1
            tr = _Traj(task, g, task.sample_turns(self.rng), fail_at)
            g.members.append(tr)
            self.inflight.add(tr)
            self.launched += 1
            self._env_call(tr)
        return g

    def _env_call(self, tr: _Traj) -> None:
        task = tr.task
        latency = task.env_latency_s.sample(self.rng)
        timed_out = False
        if task.env_timeout_s is not None and latency > task.env_timeout_s:
            latency, timed_out = task.env_timeout_s, True  # the call ends at the timeout
        fails = tr.calls == tr.fail_at
        tr.calls += 1
        if timed_out or fails:
            fate = "timed_out" if timed_out else "env_failed"
            self.env.submit(latency, lambda: self._done(tr, fate))
        else:
            self.env.submit(latency, lambda: self._after_env(tr))

    def _after_env(self, tr: _Traj) -> None:
        if not tr.alive:
            return
        if tr.turn >= tr.turns:
            self.reward.submit(tr.task.reward_s.sample(self.rng), lambda: self._done(tr, "finished"))
        elif tr.version is None and tr.group.start_version > self.clock.served:
            self.waiting.append(tr)  # launched ahead: its first generation waits for that version
        else:
            self._generate(tr)

    def _generate(self, tr: _Traj) -> None:
        if tr.version is None:
            tr.version = self.clock.served
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
        self._env_call(tr)

    def _done(self, tr: _Traj, fate: str) -> None:
        if not tr.alive:
            return
        tr.alive = False
        self.inflight.discard(tr)
        self.fates[fate] += 1
        g = tr.group
        g.done += 1
        if fate == "finished":
            g.finished += 1
            g.versions.append(tr.min_version())
            if g.finished == g.need:  # the group is complete: cancel its surplus now
                for other in g.members:
                    if other.alive:
                        other.alive = False
                        self.inflight.discard(other)
                        self.fates["cancelled_redundant"] += 1
                        g.done += 1
        if g.done == g.size:
            self.ready.append(g)
            self.changed = True

    def abort_stale(self) -> int:
        n = 0
        for tr in list(self.inflight):
            if self.clock.trained - tr.min_version() > self.alpha:
                n += 1
                tr.group.aborted += 1
                self._done(tr, "aborted_stale")
        return n

    # the buffer -------------------------------------------------------------------------------------

    def take_batch(self, mix: dict[str, int], relaunch: bool, trained: list[int], lags: list[int]) -> bool:
        """The SampleBuffer's ``get_batch`` at the trainer's version, if the batch is there: drop
        ready groups with nothing trainable (relaunching them in sync/one_off), then take the oldest
        ready groups of each task's quota. Appends the trained count and lags; False: not yet."""
        version = self.clock.trained
        ready = sorted(self.ready, key=lambda g: g.seq)  # oldest first, as the buffer
        dropped = [g for g in ready if not any(version - v <= self.alpha for v in g.versions)]
        self.dropped_in_a_row += len(dropped)
        if self.dropped_in_a_row > 10 * sum(mix.values()) + 10:
            raise RuntimeError(
                f"simulation stalled: {self.dropped_in_a_row} groups in a row ended with nothing "
                f"trainable ({dict(self.fates)}); check env_timeout_s, fail_prob and alpha"
            )
        for g in dropped:
            self._remove(g)
            self.fates["aborted_stale"] += len(g.versions)  # finished, but stale: relabelled
            self.fates["finished"] -= len(g.versions)
            self.stale_groups += bool(g.versions or g.aborted)
            if relaunch:
                self.launch_group(g.task)
        useful = [g for g in ready if g not in dropped]
        chosen: list[_Group] = []
        for name, quota in mix.items():
            of_task = [g for g in useful if g.task.name == name][:quota]
            if len(of_task) < quota:
                if dropped:
                    self.on_change()  # admission may launch in their place
                return False
            chosen += of_task
        n = 0
        for g in chosen:
            self._remove(g)
            for v in g.versions:
                if version - v <= self.alpha:
                    n += 1
                    lags.append(version - v)
                else:
                    self.fates["aborted_stale"] += 1
                    self.fates["finished"] -= 1
        trained.append(n)
        self.dropped_in_a_row = 0
        self.clock.batch_taken()
        return True

    def _remove(self, g: _Group) -> None:
        del self.groups[g.seq]
        self.group_count.append((self.now, len(self.groups)))
        self.ready.remove(g)
        self.pending[g.task.name] -= 1


def simulate(
    profile: WorkloadProfile,
    *,
    mode: Mode = "sync",
    alpha: int = 1,
    steps: int = 8,
    warmup_steps: int | None = None,
    gen_slots: int | None = None,
    env_slots: int | None = None,
    reward_slots: int | None = None,
    max_pending_steps: int | None = None,
    update_on_arrival: bool = True,
    abort_stale: bool = True,
    staleness_admission: bool = True,
    gen_time: GenTime | None = None,
    seed: int = 0,
) -> SimResult:
    """Simulate ``steps`` training steps of ``mode``; ``gen_slots`` defaults to the profile's
    ``gen_slots``; ``warmup_steps`` (left out of the throughput) defaults to the mode's pipeline
    depth: 0 for Sync+, 1 for One-off, ``max_pending_steps`` for async (the bench also leaves out
    Sync+'s first step, to measure the groups One-off measures; every Sync+ step is alike).
    ``staleness_admission=False`` admits groups up to the depth without the ``on_time`` rule (an
    ablation: what the loop did before it)."""
    if mode not in MODES:
        raise ConfigError(f"simulate: mode must be one of {', '.join(MODES)}, got {mode!r}")
    if alpha < 0 or (mode == "one_off" and alpha < 1):
        raise ConfigError(f"simulate: alpha {alpha} is not allowed in mode {mode!r} (one_off needs >= 1)")
    if mode == "async" and alpha == 0 and not update_on_arrival:
        raise ConfigError(  # as the run config: no group could ever be launched on time
            "simulate: async with alpha 0 needs update_on_arrival (groups must start on the coming version)"
        )
    alpha = 0 if mode == "sync" else alpha
    depth = max_pending_steps or alpha + 1
    if warmup_steps is None:
        warmup_steps = {"sync": 0, "one_off": 1, "async": depth}[mode]
    if steps <= warmup_steps:
        raise ConfigError(f"simulate: steps ({steps}) must exceed warmup_steps ({warmup_steps})")
    sim = _Sim(profile, alpha, gen_slots or profile.gen_slots, env_slots, reward_slots, gen_time, seed)
    mix = {t.name: max(1, t.trajectories_per_step // t.group_size) for t in profile.tasks}
    tasks = {t.name: t for t in profile.tasks}
    train = profile.train
    step_ends: list[tuple[float, int]] = [(0.0, 0)]
    trained: list[int] = []
    lags: list[int] = []
    aborted = 0

    def launch_step() -> None:
        for name, n in mix.items():
            for _ in range(n):
                sim.launch_group(tasks[name])

    def get_batch(relaunch: bool) -> None:
        sim.changed = True  # the trainer's version moved: what is trainable may have too
        while not (sim.changed and sim.take_batch(mix, relaunch, trained, lags)):
            sim.changed = False
            sim.next_event()

    def train_and_push() -> None:
        """6. Train beside whatever rollout runs, then the trainer's version moves on."""
        sim.training, start = True, sim.now
        _stretch_generation(sim, 1 + train.colocated_slowdown)
        _train_beside_rollout(sim, train.train_s, train.train_colocated_slowdown)
        _stretch_generation(sim, 1 / (1 + train.colocated_slowdown))
        sim.training = False
        sim.train_time += sim.now - start
        sim.clock.trained_to(sim.clock.trained + 1)

    def update_now() -> None:
        """Wait for the push to land, then Suspend → Update → Resume (the loop waits for both)."""
        version = sim.clock.trained
        _advance(sim, train.push_s)
        sim.suspend_generation(train.sync_s)
        _advance(sim, train.sync_s)
        sim.serve(version)

    if mode in ("sync", "one_off"):
        if mode == "one_off":
            launch_step()
        for _ in range(steps):
            if mode == "sync":
                launch_step()
            get_batch(relaunch=True)
            if mode == "one_off":
                launch_step()  # the next step's rollout overlaps this step's training
            train_and_push()
            if abort_stale and mode == "one_off":
                aborted += sim.abort_stale()
            update_now()
            step_ends.append((sim.now, sum(trained[warmup_steps:])))
    else:
        on_arrival = update_on_arrival
        pending_max = sum(mix.values()) * depth

        def produce() -> None:
            while len(sim.groups) < pending_max:
                nv = sim.clock.next_batch_version()
                starts: dict[str, int] = {}
                for name, gps in mix.items():
                    for v in sim.clock.start_versions():
                        if not staleness_admission or on_time(sim.pending[name], gps, nv, v, alpha):
                            starts[name] = v
                            break
                if not starts:
                    return
                # the task with the fewest pending groups for its share of the batch (next_task)
                name = min(starts, key=lambda n: sim.pending[n] / mix[n])
                sim.launch_group(tasks[name], start_version=starts[name])

        sim.on_change = produce
        landing: dict[str, bool] = {"busy": False}

        def land(version: int) -> None:
            sim.suspend_generation(train.sync_s)
            sim.at(sim.now + train.sync_s, lambda: served(version))

        def served(version: int) -> None:
            sim.serve(version)
            landing["busy"] = False

        produce()
        for _ in range(steps):
            get_batch(relaunch=False)
            produce()
            while landing["busy"]:  # the last push landed (on arrival: and was swapped in)
                sim.next_event()
            if on_arrival:
                sim.clock.expect(sim.clock.trained + 1)
                produce()
            elif sim.clock.served < sim.clock.trained:
                sim.suspend_generation(train.sync_s)  # 2-5 at the step's start, the loop waits
                _advance(sim, train.sync_s)
                sim.serve(sim.clock.trained)
            train_and_push()
            version = sim.clock.trained
            landing["busy"] = True
            if on_arrival:
                sim.at(sim.now + train.push_s, functools.partial(land, version))
            else:
                sim.at(sim.now + train.push_s, lambda: landing.update(busy=False))
            if abort_stale:
                aborted += sim.abort_stale()
            step_ends.append((sim.now, sum(trained[warmup_steps:])))
    t0, _ = step_ends[warmup_steps]
    t1, n1 = step_ends[-1]
    fill = None
    if mode == "async" and t1 > t0:
        fill = _time_mean(sim.group_count, t0, t1) / (sum(mix.values()) * depth)
    times = [b[0] - a[0] for a, b in itertools.pairwise(step_ends)]
    busy = sim.gen.busy_time / (sim.gen.slots * t1) if sim.gen.slots and t1 > 0 else 0.0
    fates = dict(sim.fates)
    if sim.inflight:
        fates["in_flight"] = len(sim.inflight)
    return SimResult(
        mode,
        n1 / (t1 - t0) if t1 > t0 else 0.0,
        (t1 - t0) / (steps - warmup_steps),
        steps,
        sum(trained),
        aborted,
        min(busy, 1.0),
        min(sim.train_time / t1, 1.0) if t1 > 0 else 0.0,
        times,
        launched=sim.launched,
        fates={k: v for k, v in fates.items() if v},
        stale_groups=sim.stale_groups,
        lag_max=max(lags, default=0),
        warmup_steps=warmup_steps,
        window_fill=fill,
    )


def _time_mean(steps: list[tuple[float, int]], t0: float, t1: float) -> float:
    """Mean over [t0, t1] of a step function given as (time, value from then on), in time order."""
    area = 0.0
    for (t, n), (t_next, _) in itertools.pairwise([*steps, (t1, 0)]):
        lo, hi = max(t, t0), min(t_next, t1)
        if hi > lo:
            area += n * (hi - lo)
    return area / (t1 - t0)


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
