"""Replicated environments: hedge every call of a deterministic environment across replicas.

A trajectory's time is the sum of its environment calls, so one heavy-tailed step (a slow container,
a noisy neighbour) delays the whole group and the batch. Launching more *trajectories* (``run_group``
with ``k``) masks that only at the price of more generation, and a backup trajectory starts from
scratch. Environments that are deterministic given the seed and the actions (the Environment protocol
asks for that; every built-in env is) can be hedged per call instead, as "The Tail at Scale" hedges
requests to replicated servers: :class:`ReplicatedEnv` runs ``r`` replicas of the same episode, sends
every ``reset``/``step`` to all of them and returns the first answer. Generation load is unchanged;
the cost is ``r`` times the environment calls (CPU pool, cheap).

Each replica executes its calls in order: a replica still busy with step i gets step i+1 when it is
done, so a replica that straggled once lags behind and may win again later. A replica that raises,
times out or answers differently from the winner (a non-deterministic env) is dropped for the rest of
the episode; the call fails only when every replica has failed (the last error is raised, so the
trajectory's fate is that of the last replica). So a single replica's crash or hang is masked too.
An :class:`~rollart_core.errors.InvalidActionError` (the model's action, not the replica, failed) is
an answer like any other: the first one is raised at once and no replica is dropped for it.

``close()`` cancels the calls still running on lagging replicas and closes every replica.

Because each replica runs every call in order (an environment's state needs every action), replicas
hedge a trajectory's *cumulative* env time: the minimum over replicas of their sums, not the sum of
per-call minima. With log-normal step latency (median 0.1 s, sigma 1) over 5 calls, 3 replicas
take the episode's median from 0.71 s to 0.47 s and its p99 from 2.55 s to 1.07 s.

Where to put the replicas: the EnvManager (``replicas`` per group, in other actors or in one actor,
``replica_scope``), or in-process with the ``replicated`` env entry point (``{"impl": "replicated",
"options": {"env": {...}, "replicas": 3}}``), which builds a fresh ReplicatedEnv per trajectory.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from rollart_core.config import ComponentConfig
from rollart_core.errors import EnvError, InvalidActionError
from rollart_core.protocols import Environment
from rollart_core.types import StepResult

__all__ = ["ReplicatedEnv", "ReplicatedEnvConfig"]

log = logging.getLogger(__name__)


_ANY = object()


class _Dropped(EnvError):
    """This replica left the episode earlier (failed or diverged); its error was counted then."""


@dataclass(eq=False)
class _Replica:
    env: Any
    tail: asyncio.Task[Any] | None = None
    """This replica's latest call (the next one waits for it)."""
    alive: bool = True
    wins: int = 0
    running: set[asyncio.Task[Any]] = field(default_factory=set)
    """Calls not yet done (a lagging replica can have several queued)."""

    def settle(self, task: asyncio.Task[Any]) -> None:
        self.running.discard(task)
        if not task.cancelled():
            task.exception()  # a loser's error was counted in _run; mark it retrieved


def _key(result: Any) -> Any:
    """What replicas must agree on: observation, reward and flags (info may differ, e.g. env ids)."""
    if isinstance(result, StepResult):
        return (result.observation, result.reward, result.terminated, result.truncated)
    return result[0]  # reset: (observation, info)


class ReplicatedEnvConfig(BaseModel):
    """Options of the ``replicated`` entry point."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    env: ComponentConfig
    """The environment to replicate (``impl`` + ``options``): deterministic given seed and actions."""
    replicas: int = Field(3, ge=1)
    """Copies built per environment; every call goes to all of them. Each copy is built from the
    same options, so randomness seeded only by the options (``faulty`` with one ``instance``) is the
    same in every copy and hedges nothing; ``straggler`` (:class:`~rollart_env.faults.StragglerEnv`)
    numbers its copies."""


class ReplicatedEnv:
    """The Environment protocol over ``replicas`` (identical, deterministic environments), or over
    ``config.replicas`` copies built from a :class:`ReplicatedEnvConfig` (the ``replicated`` entry
    point)."""

    Config = ReplicatedEnvConfig

    @classmethod
    def check_config(cls, config: ReplicatedEnvConfig) -> None:
        """The replicated env's own check (``SupportsConfigCheck``)."""
        from rollart_core.registry import check

        check("env", config.env.impl, config.env.options, "env.options")

    def __init__(
        self,
        replicas: Sequence[Environment] | ReplicatedEnvConfig,
        stats: Counter[str] | None = None,
        respawn: Callable[[int], Awaitable[Environment]] | None = None,
    ) -> None:
        if isinstance(replicas, ReplicatedEnvConfig):
            from rollart_core.registry import build

            cfg = replicas
            replicas = [
                build("env", cfg.env.impl, cfg.env.options, "replicated.env.options")
                for _ in range(cfg.replicas)
            ]
        if not replicas:
            raise ValueError("ReplicatedEnv needs at least one replica")
        self._replicas = [_Replica(env) for env in replicas]
        self._respawn = respawn
        """Builds (and starts) a fresh replica ``i``. Given, a replica dropped in an episode, or still
        busy with it when the next ``reset`` comes (it straggled or hung), is replaced at that reset,
        which waits for the rebuilt replicas: an env reused across episodes keeps its replica count."""
        first = replicas[0]
        self.action_vocabulary = first.action_vocabulary
        self.system_prompt = first.system_prompt
        self.env_id = getattr(first, "env_id", None)
        self.stats: Counter[str] = stats if stats is not None else Counter()
        """``hedged_calls``, ``hedge_wins`` (a call won by a replica other than the first),
        ``replicas_failed``, ``replicas_diverged``, ``replicas_respawned``; shared with the EnvManager
        (or the env actor, for in-actor replicas) that built this."""
        self._last: Any = None
        self.closed = False

    @property
    def live(self) -> int:
        """Replicas still in the episode."""
        return sum(r.alive for r in self._replicas)

    async def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        if self._respawn is not None and not self.closed:
            # dropped, or still busy with the last episode (a straggler, a hang): rebuilt, side by side
            stale = [i for i, r in enumerate(self._replicas) if not r.alive or r.running]
            for i in stale:
                await _close(self._replicas[i])
            fresh = await asyncio.gather(*(self._respawn(i) for i in stale))
            for i, env in zip(stale, fresh, strict=True):
                self._replicas[i] = _Replica(env)
            self.stats["replicas_respawned"] += len(stale)
        obs, info = await self._call("reset", seed)
        return obs, {**info, "replicas": self.live}

    async def step(self, action_text: str) -> StepResult:
        result: StepResult = await self._call("step", action_text)
        return result

    async def _run(
        self, r: _Replica, prev: asyncio.Task[Any] | None, expect: Any, method: str, arg: Any
    ) -> Any:
        if prev is not None:
            await asyncio.wait([prev])  # in order; does not cancel prev if this is cancelled
            if (
                expect is not _ANY
                and not prev.cancelled()
                and prev.exception() is None
                and _key(prev.result()) != expect
            ):
                self._drop(r, "diverged")
        if not r.alive:
            raise _Dropped
        try:
            return await getattr(r.env, method)(arg)
        except (asyncio.CancelledError, InvalidActionError):  # the latter is an answer: the model's fault
            raise
        except Exception:
            self._drop(r, "failed")
            raise

    def _drop(self, r: _Replica, why: str) -> None:
        if r.alive:
            r.alive = False
            self.stats[f"replicas_{why}"] += 1
            if why == "diverged":
                log.warning(
                    "replica %s diverged from the winning replica: is the environment deterministic?",
                    getattr(r.env, "env_id", r.env),
                )

    async def _call(self, method: str, arg: Any) -> Any:
        if self.closed:
            raise EnvError(f"{method}() after close()")
        # the previous call's winning answer, which a lagging replica's answer must equal
        expect = _key(self._last) if self._last is not None and method == "step" else _ANY
        tasks: dict[asyncio.Task[Any], _Replica] = {}
        for r in self._replicas:
            if r.alive:
                r.tail = asyncio.ensure_future(self._run(r, r.tail, expect, method, arg))
                r.running.add(r.tail)
                r.tail.add_done_callback(r.settle)
                tasks[r.tail] = r
        if not tasks:
            raise EnvError("every replica of this environment has failed")
        self.stats["hedged_calls"] += 1
        pending = set(tasks)
        error: BaseException | None = None
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    exc = t.exception() if not t.cancelled() else asyncio.CancelledError()
                    if exc is None:
                        r = tasks[t]
                        r.wins += 1
                        if r is not self._replicas[0]:
                            self.stats["hedge_wins"] += 1
                        self._last = t.result()
                        return self._last
                    if isinstance(exc, InvalidActionError):
                        raise exc  # the first answer, as a success would be
                    if not isinstance(exc, _Dropped):
                        error = exc
        except asyncio.CancelledError:
            for t in pending:
                t.cancel()
            raise
        raise error or EnvError("every replica of this environment has failed")

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for r in self._replicas:
            await _close(r)


async def _close(r: _Replica) -> None:
    """Cancel the replica's calls still running (a loser's are of no use any more) and close it."""
    running = list(r.running)
    for t in running:
        t.cancel()
    if running:
        await asyncio.gather(*running, return_exceptions=True)
    try:
        await r.env.close()
    except Exception as exc:
        log.warning("closing a replica failed: %r", exc)
