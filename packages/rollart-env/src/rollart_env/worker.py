"""EnvWorker: the Ray actor that hosts many environments for :class:`~rollart_env.manager.EnvManager`,
one coroutine per call on its event loop (a slow environment never blocks the others)."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import Counter
from typing import Any

from rollart_core.errors import EnvError
from rollart_core.resources import affinity
from rollart_core.types import StepResult
from rollart_env.faults import FaultSpec
from rollart_env.replicas import ReplicatedEnv

__all__ = ["EnvWorker"]

log = logging.getLogger(__name__)


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
