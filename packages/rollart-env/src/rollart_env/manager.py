"""EnvManager: environments in Ray actors on the CPU pool, each with its own lifecycle.

Many environments live in one :class:`EnvWorker` actor (asyncio inside, one coroutine per call), so
a slow environment never blocks the others. Per task (``groups``) the manager keeps ``num_envs``
environment *slots*; each slot goes through

    starting (create + start(): container pull, ...) → ready → busy (leased to one trajectory)
        → ready again (healthy, reused)            or → failed → a replacement slot is started

A trajectory leases a slot with :meth:`EnvManager.acquire`, which returns a :class:`ManagedEnv`:
an ordinary :class:`~rollart_core.protocols.Environment`, so
:func:`rollart_core.control.runner.run_trajectory` drives it unchanged, and ``close()`` gives the slot back.

Whose fault: a ``step`` that raises :class:`~rollart_core.errors.InvalidActionError` failed because
of the model's action; it reaches the runner as that error (the episode ends with its failure
reward, scored, fate ``finished``) and the environment stays in service. Everything else is the
environment's own fault.

Failures are masked, never propagated to the run: a call that raises is re-raised as
:class:`~rollart_core.errors.EnvError` (fate ``env_failed``); a call that exceeds its per-call or
per-episode timeout raises :class:`~rollart_core.errors.EnvTimeoutError` (fate ``timed_out``); an
actor that dies fails every environment on it. In each case the slot is retired (its hung call is
cancelled inside the actor) and a replacement is started in the background; starts run
concurrently, so slow start-ups delay nobody else. Needs Ray (``pip install 'rollart-env[ray]'``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rollart_core.errors import ConfigError, EnvError, EnvTimeoutError, InvalidActionError
from rollart_core.extras import require
from rollart_core.registry import resolve, validate_options
from rollart_core.resources import affinity, get_affinity, ray_actor_options
from rollart_core.types import Fate, StepResult, Trajectory
from rollart_env.faults import FaultSpec
from rollart_env.replicas import ReplicatedEnv

__all__ = ["EnvGroupConfig", "EnvManager", "EnvManagerConfig", "EnvWorker", "ManagedEnv"]

log = logging.getLogger(__name__)
_INSTALL = "pip install 'rollart-env[ray]'"


class EnvGroupConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    impl: str
    """Registered env name (``rollart.env`` entry point) or ``package.module:Class``."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Validated by the env's own ``Config`` inside the actor."""
    num_envs: int = Field(8, ge=1)
    """Environments kept alive for this task (replacements restore the count)."""
    faults: FaultSpec | None = None
    """Wrap every instance in :class:`~rollart_env.faults.FaultyEnv` (tests, benchmarks)."""
    replicas: int | None = Field(None, ge=1)
    """Environments per trajectory (:class:`~rollart_env.replicas.ReplicatedEnv`): every call goes to
    each, the first answer wins, so one replica's straggling step, crash or hang is masked without
    more generation. Only for environments deterministic given seed and actions. Extra replicas are
    taken from idle ready environments no waiting trajectory needs (size ``num_envs`` for
    ``replicas`` x concurrent trajectories); 1 disables; None: the manager's ``replicas``."""
    replica_scope: Literal["actors", "actor"] = "actors"
    """``actors``: a trajectory's replicas are other ready environments of the group, on other actors
    first (an actor's death is masked too; every env call is ``replicas`` Ray calls from the caller).
    ``actor``: every environment of the group is itself ``replicas`` instances in one actor, hedged
    on the actor's event loop: one Ray call per env call (for callers whose CPU is the limit), a
    replica dropped in an episode is rebuilt at the next reset, and an actor's death takes all the
    replicas (the trajectory fails as env_failed; ``num_envs`` counts the hedged environments)."""


class EnvManagerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    groups: dict[str, EnvGroupConfig] = Field(min_length=1)
    """Task name → its environments."""
    envs_per_actor: int = Field(16, ge=1)
    num_cpus_per_actor: float = Field(0.25, ge=0)
    pool: str | None = "env"
    """Ray custom resource of the CPU pool (one unit per actor); None = any node."""
    start_timeout_s: float = Field(300.0, gt=0)
    """Creating + starting one environment (image pulls can be slow)."""
    reset_timeout_s: float = Field(60.0, gt=0)
    step_timeout_s: float = Field(60.0, gt=0)
    episode_timeout_s: float | None = Field(None, gt=0)
    """Wall clock from reset; a call after it (or running past it) raises EnvTimeoutError."""
    acquire_timeout_s: float | None = Field(600.0, gt=0)
    """Waiting for a ready environment."""
    reuse: bool = True
    """Reuse a healthy environment for the next episode (False: a fresh one per episode)."""
    max_start_failures: int = Field(5, ge=1)
    """Consecutive failed starts of a group after which acquiring from it raises EnvError."""
    replicas: int = Field(1, ge=1)
    """Default environment replicas per trajectory for groups that do not set ``replicas`` (a run
    config reaches it as ``env_manager.options.replicas``); 1 = no replication."""

    @model_validator(mode="after")
    def _check(self) -> EnvManagerConfig:
        for name, g in self.groups.items():
            if g.impl == "faulty" and g.faults is not None:
                raise ValueError(f"groups.{name}: use either impl 'faulty' or 'faults', not both")
        return self


@affinity(pool="env", num_cpus=0.25)
class EnvWorker:
    """Ray actor hosting many environments; every method is a coroutine on one event loop."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.envs: dict[str, Any] = {}
        self._running: dict[str, set[asyncio.Task[Any]]] = {}
        self.calls: Counter[str] = Counter()
        self.replica_stats: Counter[str] = Counter()
        """Hedging counters of the in-actor replicated environments (``replica_scope: actor``)."""

    async def _tracked(self, env_id: str, coro: Any) -> Any:
        task = asyncio.current_task()
        assert task is not None  # always inside a task on the actor's loop
        self._running.setdefault(env_id, set()).add(task)
        try:
            return await coro
        finally:
            self._running.get(env_id, set()).discard(task)

    def _env(self, env_id: str) -> Any:
        env = self.envs.get(env_id)
        if env is None:
            raise EnvError(f"{self.name}: no environment {env_id!r}")
        return env

    async def create(
        self,
        env_id: str,
        impl: str,
        options: dict[str, Any],
        faults: dict[str, Any] | None,
        instance: int,
        replicas: int = 1,
    ) -> dict[str, Any]:
        """Build (and start) environment ``env_id``; ``replicas > 1``: a :class:`ReplicatedEnv` of
        that many instances (fault-injection instances ``instance * replicas + i``: independent; a
        respawned replica is a new incarnation, with fresh faults)."""
        from rollart_core.registry import build

        rebuilt = itertools.count(1)

        def make(i: int, incarnation: int = 0) -> Any:
            env = build("env", impl, options, f"{env_id}.options")
            if faults is not None:
                from rollart_env.faults import FaultyEnv

                env = FaultyEnv(
                    inner=env,
                    spec=FaultSpec(**faults),
                    instance=instance * replicas + i,
                    incarnation=incarnation,
                )
            return env

        async def start(env: Any) -> Any:
            fn = getattr(env, "start", None)
            if callable(fn):
                await fn()
            return env

        parts = [make(i) for i in range(replicas)]
        env: Any = (
            parts[0]
            if replicas == 1
            else ReplicatedEnv(
                parts, stats=self.replica_stats, respawn=lambda i: start(make(i, next(rebuilt)))
            )
        )
        self.envs[env_id] = env  # registered before its start: destroy() during a slow start closes it
        await self._tracked(env_id, asyncio.gather(*(start(e) for e in parts)))
        vocab = env.action_vocabulary
        return {"action_vocabulary": tuple(vocab) if vocab else None, "system_prompt": env.system_prompt}

    async def reset(self, env_id: str, seed: int) -> tuple[str, dict[str, Any]]:
        self.calls["reset"] += 1
        return await self._tracked(env_id, self._env(env_id).reset(seed))

    async def step(self, env_id: str, action_text: str) -> StepResult:
        self.calls["step"] += 1
        return await self._tracked(env_id, self._env(env_id).step(action_text))

    async def destroy(self, env_id: str) -> None:
        """Cancel the env's running calls (a hang), close it best-effort and forget it."""
        for task in list(self._running.pop(env_id, ())):
            task.cancel()
        env = self.envs.pop(env_id, None)
        if env is not None:
            try:
                await asyncio.wait_for(env.close(), timeout=5.0)
            except Exception as exc:  # a broken env must not take the actor with it
                log.warning("%s: closing %s failed: %r", self.name, env_id, exc)

    async def info(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "envs": len(self.envs),
            "running": sum(map(len, self._running.values())),
            "calls": dict(self.calls),
            "replicas": dict(self.replica_stats),
        }


@dataclass(eq=False)
class _Actor:
    name: str
    handle: Any
    alive: bool = True
    envs: set[str] = field(default_factory=set)


@dataclass(eq=False)
class _Slot:
    env_id: str
    group: str
    instance: int
    actor: _Actor
    state: str = "starting"  # starting | ready | busy | draining | retired
    action_vocabulary: tuple[str, ...] | None = None
    system_prompt: str | None = None
    pending: Any = None
    """ObjectRef of a call whose caller was cancelled before it returned."""
    episodes: int = 0


class ManagedEnv:
    """A leased environment slot; implements the Environment protocol. ``close()`` gives it back."""

    def __init__(self, manager: EnvManager, slot: _Slot) -> None:
        self._manager = manager
        self._slot = slot
        self.env_id = slot.env_id
        self.action_vocabulary: Sequence[str] | None = slot.action_vocabulary  # as Environment declares it
        self.system_prompt = slot.system_prompt
        self.deadline: float | None = None
        self.closed = False

    async def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        cfg = self._manager.config
        if cfg.episode_timeout_s is not None:
            self.deadline = time.monotonic() + cfg.episode_timeout_s
        obs, info = await self._manager._call(self, "reset", seed, timeout=cfg.reset_timeout_s)
        self._slot.episodes += 1
        return obs, {**info, "env_id": self.env_id}

    async def step(self, action_text: str) -> StepResult:
        return await self._manager._call(
            self, "step", action_text, timeout=self._manager.config.step_timeout_s
        )

    async def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._manager._release(self._slot)


async def _await_ref(ref: Any) -> Any:
    return await ref


class EnvManager:
    """``async with EnvManager(cfg) as m: env = await m.acquire("task")`` (Ray must be initialised)."""

    Config = EnvManagerConfig

    def __init__(self, config: EnvManagerConfig) -> None:
        self.config = config
        self.actors: list[_Actor] = []
        self.slots: dict[str, _Slot] = {}
        self.stats: Counter[str] = Counter()
        self._ids = itertools.count()
        self._queues: dict[str, asyncio.Queue[_Slot | None]] = {}
        self._start_failures: Counter[str] = Counter()
        self._waiting: Counter[str] = Counter()
        self._broken: dict[str, str] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closing = False
        self._started = False

    # lifecycle -------------------------------------------------------------------------------

    async def start(self) -> EnvManager:
        if self._started:
            return self
        ray = require("ray", _INSTALL)
        if not ray.is_initialized():
            raise EnvError("EnvManager needs a running Ray cluster (use rollart_core.resources.RayCluster)")
        pool = self.config.pool
        if pool is not None and ray.cluster_resources().get(pool, 0) < 1:
            raise ConfigError(
                f"EnvManager: the Ray cluster has no {pool!r} resource (the CPU pool); start Ray "
                f"with resources={{{pool!r}: N}} or set pool: null"
            )
        for name, g in self.config.groups.items():  # invalid env options fail here, naming the field
            validate_options(resolve("env", g.impl), g.options, f"groups.{name}.options")
        self._started = True
        self._queues = {name: asyncio.Queue() for name in self.config.groups}
        total = sum(g.num_envs for g in self.config.groups.values())
        for _ in range(math.ceil(total / self.config.envs_per_actor)):
            self._new_actor()
        for name, g in self.config.groups.items():
            for _ in range(g.num_envs):
                self._spawn(name)
        return self

    async def __aenter__(self) -> EnvManager:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    async def shutdown(self) -> None:
        self._closing = True
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for q in self._queues.values():
            q.put_nowait(None)  # wake every waiter
        if self.actors:
            import ray

            for a in self.actors:
                if a.alive:
                    a.alive = False
                    ray.kill(a.handle)
        self.actors.clear()

    def _bg(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _new_actor(self) -> _Actor:
        import ray

        spec = get_affinity(EnvWorker, num_cpus=self.config.num_cpus_per_actor)
        opts = ray_actor_options(spec)
        if self.config.pool is None:
            opts.pop("resources", None)
        else:
            opts["resources"] = {self.config.pool: 1}
        name = f"env-worker-{len(self.actors)}"
        handle = ray.remote(EnvWorker).options(**opts, max_concurrency=1000, max_restarts=0).remote(name)
        actor = _Actor(name, handle)
        self.actors.append(actor)
        self.stats["actors_started"] += 1
        return actor

    def _spawn(self, group: str) -> None:
        if self._closing:
            return
        live = [a for a in self.actors if a.alive and len(a.envs) < self.config.envs_per_actor]
        actor = min(live, key=lambda a: len(a.envs)) if live else self._new_actor()
        n = next(self._ids)
        slot = _Slot(f"{group}-{n}", group, n, actor)
        actor.envs.add(slot.env_id)
        self.slots[slot.env_id] = slot
        self.stats["envs_started"] += 1
        self._bg(self._start_slot(slot))

    async def _start_slot(self, slot: _Slot) -> None:
        from ray.exceptions import RayActorError

        g = self.config.groups[slot.group]
        faults = g.faults.model_dump() if g.faults is not None else None
        in_actor = self._replicas(g) if g.replica_scope == "actor" else 1
        ref = slot.actor.handle.create.remote(
            slot.env_id, g.impl, dict(g.options), faults, slot.instance, in_actor
        )
        try:
            spec = await asyncio.wait_for(_await_ref(ref), timeout=self.config.start_timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if isinstance(exc, RayActorError):
                self._actor_died(slot.actor)
            self.stats["start_failures"] += 1
            self._start_failures[slot.group] += 1
            reason = "timed out" if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {_cause(exc)}"
            log.warning("env %s failed to start: %s", slot.env_id, reason)
            if self._start_failures[slot.group] >= self.config.max_start_failures:
                self._broken[slot.group] = f"{self._start_failures[slot.group]} starts failed, last: {reason}"
                self._retire(slot, replace=False, reason="start_failed")
                self._queues[slot.group].put_nowait(None)
                return
            self._retire(slot, reason="start_failed")
            return
        self._start_failures[slot.group] = 0
        if slot.state != "starting":  # retired meanwhile (its actor died)
            return
        slot.action_vocabulary, slot.system_prompt = spec["action_vocabulary"], spec["system_prompt"]
        slot.state = "ready"
        self._queues[slot.group].put_nowait(slot)

    def _retire(self, slot: _Slot, *, replace: bool = True, reason: str) -> None:
        """Drop a slot (cancelling its calls in the actor) and start a replacement."""
        if slot.state == "retired":
            return
        slot.state = "retired"
        slot.actor.envs.discard(slot.env_id)
        self.slots.pop(slot.env_id, None)
        if slot.actor.alive:
            slot.actor.handle.destroy.remote(slot.env_id)  # fire and forget
        if reason != "recycled":
            self.stats[f"retired_{reason}"] += 1
        if replace and not self._closing:
            self.stats["replacements" if reason != "recycled" else "recycled"] += 1
            self._spawn(slot.group)

    def _actor_died(self, actor: _Actor) -> None:
        if not actor.alive:
            return
        actor.alive = False
        self.stats["actor_deaths"] += 1
        log.warning("env actor %s died; replacing its %d environments", actor.name, len(actor.envs))
        for env_id in list(actor.envs):
            slot = self.slots.get(env_id)
            if slot is not None and slot.state in ("ready", "starting", "draining"):
                self._retire(slot, reason="actor_died")
            # busy slots fail on their next call and are retired when released

    # leasing ---------------------------------------------------------------------------------

    async def acquire(self, group: str) -> ManagedEnv | ReplicatedEnv:
        """Wait for a ready environment of ``group``; EnvTimeoutError after ``acquire_timeout_s``.

        With ``replicas > 1`` the lease is a :class:`ReplicatedEnv` over this environment and up to
        ``replicas - 1`` more ready ones (fewer if none are idle: no waiting for them)."""
        first = await self._acquire_one(group)
        g = self.config.groups[group]
        want = self._replicas(g) - 1 if g.replica_scope == "actors" else 0
        if not want:
            return first
        extra = self._take_idle(group, want, avoid=first._slot.actor)
        if len(extra) < want:
            self.stats["replica_shortfall"] += want - len(extra)
        if not extra:
            return first
        return ReplicatedEnv([first, *extra], stats=self.stats)

    def _replicas(self, g: EnvGroupConfig) -> int:
        return g.replicas or self.config.replicas

    def _take_idle(self, group: str, n: int, avoid: _Actor) -> list[ManagedEnv]:
        """Up to ``n`` ready slots that no waiting acquire() needs, on other actors first."""
        q = self._queues[group]
        ready: list[_Slot] = []
        while not q.empty():
            slot = q.get_nowait()
            if slot is None:
                q.put_nowait(None)
                break
            if slot.state == "ready" and slot.actor.alive:
                ready.append(slot)
        spare = max(0, len(ready) - self._waiting[group])
        ready.sort(key=lambda s: s.actor is avoid)  # stable: other actors first, queue order kept
        take = ready[: min(n, spare)]
        for slot in ready:
            if slot not in take:
                q.put_nowait(slot)
        out = []
        for slot in take:
            slot.state = "busy"
            self.stats["replica_leases"] += 1
            out.append(ManagedEnv(self, slot))
        return out

    async def _acquire_one(self, group: str) -> ManagedEnv:
        if not self._started:
            raise EnvError("EnvManager.start() was not called")
        if group not in self._queues:
            raise ConfigError(f"unknown env group {group!r} (known: {sorted(self._queues)})")
        q = self._queues[group]
        timeout = self.config.acquire_timeout_s
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if group in self._broken:
                raise EnvError(f"env group {group!r} cannot start environments: {self._broken[group]}")
            if self._closing:
                raise EnvError("EnvManager is shut down")
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise EnvTimeoutError(f"no ready {group!r} environment within {timeout}s")
            self._waiting[group] += 1
            try:
                slot = await asyncio.wait_for(q.get(), timeout=remaining)
            except TimeoutError:
                continue
            finally:
                self._waiting[group] -= 1
            if slot is None:
                q.put_nowait(None)  # pass the wake-up on to the next waiter
                continue
            if slot.state != "ready" or not slot.actor.alive:
                continue  # retired while queued
            slot.state = "busy"
            self.stats["leases"] += 1
            return ManagedEnv(self, slot)

    async def _call(self, handle: ManagedEnv, method: str, arg: Any, *, timeout: float) -> Any:
        from ray.exceptions import RayActorError, RayTaskError

        slot = handle._slot
        if handle.closed:
            raise EnvError(f"{slot.env_id}: {method}() after close()")
        if not slot.actor.alive:
            self._retire(slot, reason="actor_died")
            raise EnvError(f"{slot.env_id}: environment lost (its actor {slot.actor.name} died)")
        if slot.state != "busy":
            raise EnvError(f"{slot.env_id}: environment was retired (state {slot.state})")
        limit, what = timeout, f"{method} timeout {timeout}s"
        if handle.deadline is not None:
            left = handle.deadline - time.monotonic()
            if left <= 0:
                self.stats["timeouts_episode"] += 1
                self._retire(slot, reason="timeout")
                raise EnvTimeoutError(
                    f"{slot.env_id}: episode timeout {self.config.episode_timeout_s}s exceeded"
                )
            if left < limit:
                limit, what = left, f"episode timeout {self.config.episode_timeout_s}s"
        ref = getattr(slot.actor.handle, method).remote(slot.env_id, arg)
        slot.pending = ref
        try:
            result = await asyncio.wait_for(_await_ref(ref), timeout=limit)
        except TimeoutError:
            self.stats["timeouts"] += 1
            self._retire(slot, reason="timeout")
            raise EnvTimeoutError(f"{slot.env_id}: {method} exceeded the {what}") from None
        except RayActorError:
            self._actor_died(slot.actor)
            self._retire(slot, reason="actor_died")
            raise EnvError(f"{slot.env_id}: its actor {slot.actor.name} died during {method}") from None
        except RayTaskError as exc:
            cause = _cause(exc)
            if isinstance(cause, InvalidActionError):  # the model's fault: the environment is sound
                slot.pending = None
                self.stats["invalid_actions"] += 1
                raise InvalidActionError(str(cause), cause.reward) from None
            self.stats["errors"] += 1
            self._retire(slot, reason="raised")
            raise EnvError(f"{slot.env_id}: {method} raised {type(cause).__name__}: {cause}") from None
        slot.pending = None
        return result

    def _release(self, slot: _Slot) -> None:
        if slot.state != "busy":
            return  # already retired (failed) or shut down
        if slot.pending is not None:
            # the trajectory was cancelled mid-call: reuse the env only once that call has returned
            slot.state = "draining"
            self._bg(self._drain(slot))
        elif self.config.reuse:
            slot.state = "ready"
            self._queues[slot.group].put_nowait(slot)
        else:
            self._retire(slot, reason="recycled")

    async def _drain(self, slot: _Slot) -> None:
        try:
            await asyncio.wait_for(_await_ref(slot.pending), timeout=self.config.step_timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception:
            if slot.state == "draining":
                self._retire(slot, reason="drain_failed")
            return
        slot.pending = None
        if slot.state == "draining":
            slot.state = "busy"
            self._release(slot)

    # convenience -----------------------------------------------------------------------------

    async def run_trajectory(
        self, traj: Trajectory, group: str | None = None, **runner_kwargs: Any
    ) -> Trajectory:
        """Lease an env of ``group`` (default: the trajectory's task) and run ``traj`` with the core runner.

        A failure to lease is a fate too (``timed_out`` / ``env_failed``); a cancellation while
        waiting is ``cancelled_redundant``. Never raises except CancelledError.
        """
        from rollart_core.control.runner import run_trajectory

        t0 = time.perf_counter()
        try:
            env = await self.acquire(group or traj.task)
        except asyncio.CancelledError:
            traj.fate = traj.fate or Fate.CANCELLED_REDUNDANT
            raise
        except EnvTimeoutError as exc:
            traj.fate, traj.error = Fate.TIMED_OUT, repr(exc)
            return traj
        except EnvError as exc:
            traj.fate, traj.error = Fate.ENV_FAILED, repr(exc)
            return traj
        finally:
            traj.add_timing("env_acquire", time.perf_counter() - t0)
        # traj.env_id stays the implementation; the instance (a ReplicatedEnv lease carries its first
        # replica's id, one of our ManagedEnvs) goes into info
        traj.info["env_instance"] = str(env.env_id)
        return await run_trajectory(traj, env=env, **runner_kwargs)

    def snapshot(self) -> dict[str, Any]:
        """Counters plus slot states (for metrics and tests)."""
        states = Counter(s.state for s in self.slots.values())
        return {**self.stats, "slots": dict(states), "actors_alive": sum(a.alive for a in self.actors)}

    async def hedge_stats(self, timeout: float = 10.0) -> Counter[str]:
        """The hedging counters of every replicated environment: this manager's (``replica_scope:
        actors``) plus those the live env actors keep for their in-actor replicas (``actor``)."""
        total = Counter({k: v for k, v in self.stats.items() if k.startswith(("hedge", "replicas_"))})
        live = [a for a in self.actors if a.alive]
        infos = await asyncio.gather(
            *(asyncio.wait_for(_await_ref(a.handle.info.remote()), timeout) for a in live),
            return_exceptions=True,
        )
        for a, info in zip(live, infos, strict=True):
            if isinstance(info, BaseException):  # a dead actor's counters are gone with it
                log.warning("env actor %s: no hedging counters (%r)", a.name, info)
                continue
            total.update(info["replicas"])
        return total

    async def wait_ready(self, group: str, n: int, timeout: float = 60.0) -> None:
        """Wait until ``n`` environments of ``group`` are ready (polls with a deadline)."""
        deadline = time.monotonic() + timeout
        while sum(s.group == group and s.state == "ready" for s in self.slots.values()) < n:
            if time.monotonic() > deadline:
                raise EnvTimeoutError(f"fewer than {n} ready {group!r} environments after {timeout}s")
            await asyncio.sleep(0.05)


def _cause(exc: BaseException) -> BaseException:
    return getattr(exc, "cause", None) or exc
