"""The elastic rollout pool: engines added to and removed from a running pipeline.

:class:`ElasticEngines` is owned by the :class:`~rollart_core.control.pipeline.Pipeline` (which starts
the first engines through :func:`engine_actor` too). Adding an engine of a group: a Ray placement for
one replica (a bundle a removed engine of the group left reserved, else a new placement group on the
group's pool, checked against the cluster as it is now: a node that joined counts), the actor started,
then the proxy's ``add_actor_worker`` brings it to the served weights before it takes a request.
Removing one: the proxy drains it and hands the rest of its requests back
(:class:`~rollart_core.protocols.SupportsElasticWorkers`), then the actor is shut down and killed.
Driven by :mod:`rollart_core.control.admin` (``rollart engines``) and by the node watch below.

Automatic changes (an engine group's ``elastic`` section): every ``check_period_s`` the watch compares
the cluster's alive nodes with the last ones seen. When a node joined, each elastic group below its
``max_count`` is grown one engine at a time while its pool has room (a placement that cannot be
reserved within ``place_timeout_s`` ends the growth until the next change). When a node left, the
engines that ran there are removed (their requests fail over; nothing to drain on a dead node) and the
group is grown back to its ``min_count`` where the cluster has room.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rollart_core.errors import ConfigError, RollartError
from rollart_core.protocols import SupportsElasticWorkers

if TYPE_CHECKING:
    from rollart_core.config import EngineGroupConfig
    from rollart_core.control.pipeline import Pipeline

__all__ = ["ElasticEngines", "ElasticError", "engine_actor"]
log = logging.getLogger(__name__)

ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}


class ElasticError(RollartError):
    """An engine could not be added or removed; ``status`` is the admin endpoint's HTTP answer."""

    def __init__(self, message: str, status: int = 409) -> None:
        super().__init__(message)
        self.status = status


def engine_actor(
    cls: type,
    group: EngineGroupConfig,
    engine_cfg: Any,
    name: str,
    options: dict[str, Any],
    pipeline: Pipeline,
) -> Any:
    """A (not yet started) engine actor of ``group`` named ``name``, placed by ``options``."""
    import ray

    return (
        ray.remote(cls)
        .options(
            **options,
            name=f"rollart-{pipeline.tag}-{name}",
            max_concurrency=1024,
            runtime_env={"env_vars": ENGINE_ENV},
            max_restarts=group.max_restarts,
            max_task_retries=0,
        )
        .remote(
            engine_cfg, model_path=str(pipeline.config.model.path), weight_store=pipeline.store, name=name
        )
    )


@dataclass
class _Engine:
    name: str
    group: str
    actor: Any
    slot: tuple[Any, str, int]
    """(placement, its worker name, bundle index): reserved for this engine while it lives."""
    own_placement: bool
    """Whether ``slot``'s placement was made for this engine alone (removed with it)."""
    node: str = ""
    """The Ray node it runs on (known while the node watch runs: it looks up the first engines' when it
    starts, an add the new engine's)."""


@dataclass
class ElasticEngines:
    """Every engine actor of a pipeline, by name; grows and shrinks while the run goes on."""

    pipeline: Pipeline
    engine_cfgs: dict[str, Any]
    """Engine group → its validated engine config."""
    engines: dict[str, _Engine] = field(default_factory=dict)
    free_slots: dict[str, list[tuple[Any, str, int]]] = field(default_factory=dict)
    """Engine group → bundles reserved for it that no engine uses (left by removed engines)."""
    next_index: dict[str, int] = field(default_factory=dict)
    changes: list[dict[str, Any]] = field(default_factory=list)
    """Every add and remove, in order: what, why, how long, the outcome."""
    cluster: Callable[[], Any] | None = None
    """The cluster as it is now (a :class:`~rollart_core.resources.ClusterView`); None: from Ray."""
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _watch: asyncio.Task[None] | None = None

    def started(self, name: str, group: str, actor: Any, slot: tuple[Any, str, int]) -> None:
        """Record an engine the pipeline started with the run."""
        self.engines[name] = _Engine(name, group, actor, slot, own_placement=False)

    def count(self, group: str) -> int:
        return sum(e.group == group for e in self.engines.values())

    def _group(self, name: str) -> EngineGroupConfig:
        groups = {g.name: g for g in self.pipeline.config.engines}
        if name not in groups:
            raise ElasticError(f"no engine group {name!r} (groups: {', '.join(sorted(groups))})", 404)
        return groups[name]

    def _proxy(self) -> SupportsElasticWorkers:
        proxy = self.pipeline.proxy
        if not isinstance(proxy, SupportsElasticWorkers):
            raise ElasticError(
                f"the proxy ({type(proxy).__name__}) cannot add or remove engines while it serves "
                "(the prefill/decode router cannot)"
            )
        return proxy

    # add / remove ------------------------------------------------------------------------------

    async def add(
        self,
        group: str,
        *,
        place_timeout_s: float = 120.0,
        start_timeout_s: float = 600.0,
        why: str = "asked",
    ) -> dict[str, Any]:
        """Start one more engine of ``group`` and route to it once it serves the served version; each
        stage (placement, the engine's start, the proxy's bring-up) is bounded."""
        g = self._group(group)
        proxy = self._proxy()
        async with self._lock:
            t0 = time.perf_counter()
            index = self.next_index.get(group, g.count)
            self.next_index[group] = index + 1
            name = f"{group}-{index}"
            slot, own = await self._slot(g, name, place_timeout_s)
            actor = None
            try:
                placement, decl, bundle = slot
                actor = engine_actor(
                    self._engine_class(g),
                    g,
                    self.engine_cfgs[group],
                    name,
                    placement.actor_options(decl, bundle),
                    self.pipeline,
                )
                try:
                    await asyncio.wait_for(actor.start.remote(), start_timeout_s)
                except TimeoutError:
                    raise ElasticError(
                        f"engine {name} of group {group!r} did not start within {start_timeout_s:g}s", 503
                    ) from None
                version = await proxy.add_actor_worker(name, actor, group)
            except BaseException as exc:
                if actor is not None:
                    await _stop(actor, name)
                self._release(group, slot, own)
                self.changes.append(
                    {"op": "add", "group": group, "name": name, "why": why, "error": repr(exc)}
                )
                if isinstance(exc, Exception) and not isinstance(exc, RollartError):
                    raise ElasticError(f"adding an engine to group {group!r}: {exc!r}") from exc
                raise
            node = await _node_of(actor, name) if self._watch is not None else ""
            self.engines[name] = _Engine(name, group, actor, slot, own, node)
            self.pipeline.actors.append(actor)
            seconds = time.perf_counter() - t0
            out = {
                "op": "add",
                "group": group,
                "name": name,
                "version": version,
                "seconds": seconds,
                "why": why,
            }
            self.changes.append(out)
            log.warning(
                "engine %s added to group %r (%s): version %s in %.1fs", name, group, why, version, seconds
            )
            return out

    async def remove(
        self, name: str, *, drain_timeout_s: float = 60.0, why: str = "asked", stop_timeout_s: float = 30.0
    ) -> dict[str, Any]:
        """Drain engine ``name`` (its requests finish, or continue on another engine after
        ``drain_timeout_s``), then stop its actor. A bundle of the run's first placement stays reserved
        for the group (the next add reuses it); an added engine's own placement is released."""
        proxy = self._proxy()
        async with self._lock:
            e = self.engines.get(name)
            if e is None:
                raise ElasticError(f"no engine {name!r} (engines: {', '.join(sorted(self.engines))})", 404)
            t0 = time.perf_counter()
            try:
                counts = await proxy.remove_worker(name, drain_timeout_s)
            except RollartError as exc:
                raise ElasticError(str(exc)) from exc
            del self.engines[name]
            if e.actor in self.pipeline.actors:
                self.pipeline.actors.remove(e.actor)
            await _stop(e.actor, name, stop_timeout_s)
            self._release(e.group, e.slot, e.own_placement)
            seconds = time.perf_counter() - t0
            out = {"op": "remove", "group": e.group, "name": name, **counts, "seconds": seconds, "why": why}
            self.changes.append(out)
            log.warning("engine %s removed from group %r (%s): %s", name, e.group, why, counts)
            return out

    def _engine_class(self, g: EngineGroupConfig) -> type:
        from rollart_core.registry import resolve

        cls: type = resolve("engine", g.impl)
        return cls

    async def _slot(
        self, g: EngineGroupConfig, name: str, timeout_s: float
    ) -> tuple[tuple[Any, str, int], bool]:
        """A bundle for one more engine of ``g``: a free one of the group, else a new placement."""
        if self.free_slots.get(g.name):
            return self.free_slots[g.name].pop(), False
        from rollart_core.resources import ClusterView, WorkerDecl, get_affinity, place

        spec = get_affinity(self._engine_class(g), pool=g.pool, num_cpus=g.num_cpus, count=1)
        decl = WorkerDecl(name, spec, "engine")
        try:
            cluster = await asyncio.to_thread(self.cluster or ClusterView.from_ray)  # joined nodes count
            placement = await asyncio.to_thread(
                place, [decl], cluster, timeout_s=timeout_s, name_prefix=f"rollart-{self.pipeline.tag}"
            )
        except ConfigError as exc:  # the pool or a resource the group needs is missing
            raise ElasticError(f"engine group {g.name!r}: {exc}", 409) from exc
        except RollartError as exc:  # no room for it within the timeout
            raise ElasticError(f"engine group {g.name!r}: {exc}", 503) from exc
        return (placement, name, 0), True

    def _release(self, group: str, slot: tuple[Any, str, int], own: bool) -> None:
        if own:
            try:
                slot[0].remove()
            except Exception as exc:  # the cluster may be going away
                log.warning("placement of a removed engine of %s not released: %r", group, exc)
        else:
            self.free_slots.setdefault(group, []).append(slot)

    def describe(self, proxy_metrics: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
        """One row per engine: its group, health, load, and whether it is being removed."""
        rows = []
        for name, e in sorted(self.engines.items()):
            m = proxy_metrics.get(name, {})
            rows.append(
                {
                    "name": name,
                    "group": e.group,
                    "healthy": m.get("healthy"),
                    "draining": m.get("draining"),
                    "inflight": m.get("inflight"),
                    "requests": m.get("requests"),
                }
            )
        return rows

    # the node watch -----------------------------------------------------------------------------

    def start_watch(self) -> None:
        """Follow the cluster's nodes for the engine groups that have an ``elastic`` section."""
        groups = [g for g in self.pipeline.config.engines if g.elastic is not None]
        if groups and self._watch is None:
            self._watch = asyncio.create_task(self._follow_nodes(groups), name="rollart-elastic-watch")

    async def _follow_nodes(self, groups: list[EngineGroupConfig]) -> None:
        period = min(g.elastic.check_period_s for g in groups if g.elastic is not None)
        seen = await asyncio.to_thread(_alive_nodes)
        for name, e in self.engines.items():
            e.node = await _node_of(e.actor, name)
        while True:
            await asyncio.sleep(period)  # the period between looks at the cluster, not a wait for a condition
            try:
                now = await asyncio.to_thread(_alive_nodes)
                joined, left = now - seen, seen - now
                seen = now
                if left:
                    await self._nodes_left(left, groups)
                if joined or left:
                    for g in groups:
                        await self._grow(g, up_to=g.elastic.max_count if joined else g.elastic.min_count)  # type: ignore[union-attr]
            except Exception:  # the watch must outlive any one look
                log.exception("elastic engine watch: a round failed")

    async def _nodes_left(self, nodes: set[str], groups: list[EngineGroupConfig]) -> None:
        elastic = {g.name: g for g in groups}
        for name, e in list(self.engines.items()):
            if e.node in nodes and e.group in elastic:
                drain = elastic[e.group].elastic.drain_timeout_s  # type: ignore[union-attr]
                try:
                    await self.remove(
                        name, drain_timeout_s=drain, why=f"node {e.node[:12]} left", stop_timeout_s=2.0
                    )
                except RollartError as exc:  # e.g. the group's last engine: it waits for Ray's restart
                    log.warning("engine %s on a node that left stays: %s", name, exc)

    async def _grow(self, g: EngineGroupConfig, up_to: int) -> None:
        assert g.elastic is not None  # only elastic groups are watched
        while self.count(g.name) < up_to:
            try:
                await self.add(g.name, place_timeout_s=g.elastic.place_timeout_s, why="node joined")
            except ElasticError as exc:  # the pool is full (or gone): until the next change
                log.info("engine group %s not grown: %s", g.name, exc)
                return

    async def stop_watch(self) -> None:
        task, self._watch = self._watch, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def release_all(self) -> None:
        """Release the placements made for added engines (after the pipeline stopped every actor)."""
        for e in self.engines.values():
            if e.own_placement:
                self._release(e.group, e.slot, True)
        self.engines.clear()
        self.free_slots.clear()


async def _stop(actor: Any, name: str, timeout_s: float = 30.0) -> None:
    import ray

    try:
        await asyncio.wait_for(actor.shutdown.remote(), timeout=timeout_s)
    except Exception as exc:  # dead already, or stuck: it is killed regardless
        log.warning("engine %s shutdown failed: %r", name, exc)
    ray.kill(actor)


def _alive_nodes() -> set[str]:
    import ray

    return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}


async def _node_of(actor: Any, name: str) -> str:
    try:
        node: str = await asyncio.wait_for(
            actor.__ray_call__.remote(lambda self: __import__("ray").get_runtime_context().get_node_id()), 30
        )
    except Exception as exc:  # dead or stuck: it is not on any node the watch follows
        log.warning("engine %s: its node is unknown: %r", name, exc)
        return ""
    return node
