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

The actor is :mod:`rollart_env.worker`; the configuration is :mod:`rollart_env.manager_config`.
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
from typing import Any

from rollart_core.errors import ConfigError, EnvError, EnvTimeoutError, InvalidActionError
from rollart_core.extras import require
from rollart_core.registry import resolve, validate_options
from rollart_core.resources import get_affinity, ray_actor_options
from rollart_core.types import Fate, StepResult, Trajectory
from rollart_env.manager_config import EnvGroupConfig, EnvManagerConfig
from rollart_env.replicas import ReplicatedEnv
from rollart_env.worker import EnvWorker

__all__ = ["EnvGroupConfig", "EnvManager", "EnvManagerConfig", "EnvWorker", "ManagedEnv"]

log = logging.getLogger(__name__)
_INSTALL = "pip install 'rollart-env[ray]'"


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
