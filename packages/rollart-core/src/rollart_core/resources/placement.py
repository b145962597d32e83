"""The resource plane (R1): named pools over a heterogeneous Ray cluster, plan validation, placement.

A **pool** is a named set of nodes (or an elastic serverless endpoint) that workers ask for by name
through their :class:`~rollart_core.resources.AffinitySpec` ``pool``. Pools come from the cluster
itself, in this order:

1. a Ray **custom resource** on the node (``ray start --resources='{"H800": 8}'``): pool ``H800``;
   each worker of the pool takes one unit of it (so the unit count is the pool's worker capacity);
2. the **GPU model** of a GPU node (Ray's ``accelerator_type:<model>`` resource or the
   ``ray.io/accelerator-type`` label): pool ``<model>`` sized by the node's GPUs;
3. a **node label** ``rollart.io/pool=<name>`` (CPU pools such as ``env``): sized by CPUs;
4. **serverless** endpoints declared in config (:class:`ServerlessPoolConfig`): elastic, no placement.

Every node is also in the pool ``cpu`` (any node), which unpooled workers use.

:func:`validate_plan` checks a whole plan before anything starts — every pool exists, the pool's
totals cover the summed demand, and a first-fit-decreasing packing finds a node for every replica —
and raises :class:`~rollart_core.errors.ConfigError` naming the worker and the missing resource.
:func:`place` reserves the plan with one Ray placement group per worker (colocated workers share
one ``STRICT_PACK`` group) and hands out ``.options(...)`` for each actor replica.

Ray is imported only inside the functions that talk to a cluster.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from rollart_core.config import _Model  # forbids extra keys, refuses renamed ones
from rollart_core.errors import ConfigError, RollartError
from rollart_core.resources.affinity import AffinitySpec

__all__ = [
    "ACCELERATOR_LABEL",
    "POOL_LABEL",
    "ClusterView",
    "NodeInfo",
    "PlacementError",
    "Placement",
    "Pool",
    "ResourceManager",
    "ResourcePlanConfig",
    "ServerlessPoolConfig",
    "TaskAffinity",
    "WorkerDecl",
    "place",
    "validate_plan",
]

log = logging.getLogger(__name__)

POOL_LABEL = "rollart.io/pool"
ACCELERATOR_LABEL = "ray.io/accelerator-type"
_STANDARD = {"CPU", "GPU", "memory", "object_store_memory"}
_ACCEL_PREFIX = "accelerator_type:"
_TINY = 0.001  # a token amount of accelerator_type:<model> pins a GPU worker to that model
PoolKind = Literal["resource", "gpu", "label", "any", "serverless"]


class PlacementError(RollartError):
    """The cluster could not reserve a validated plan in time (busy, or nodes left meanwhile)."""


# config models (new sections for RunConfig; see the module docstring of each) -------------------------


class TaskAffinity(_Model):
    """Where one task's generation runs: one engine group, or a prefill and a decode group (PD)."""

    engine_group: str | None = None
    """Engine group serving the whole request (prefill and decode)."""
    prefill_engine_group: str | None = None
    """PD disaggregation: engine group that prefills the prompt (compute-bound: H800-class)."""
    decode_engine_group: str | None = None
    """PD disaggregation: engine group that decodes (bandwidth-bound: H20-class)."""

    _renamed: ClassVar[dict[str, str]] = {
        "generation_pool": "engine_group",
        "prefill_pool": "prefill_engine_group",
        "decode_pool": "decode_engine_group",
    }

    @model_validator(mode="after")
    def _check(self) -> TaskAffinity:
        pd = (self.prefill_engine_group is not None, self.decode_engine_group is not None)
        if any(pd) and not all(pd):
            raise ValueError(
                "prefill_engine_group and decode_engine_group go together (PD disaggregation needs both)"
            )
        if all(pd) and self.engine_group is not None:
            raise ValueError(
                "give either engine_group or prefill_engine_group + decode_engine_group, not both"
            )
        return self

    @property
    def disaggregated(self) -> bool:
        return self.prefill_engine_group is not None

    def engine_groups(self) -> list[str]:
        named = (self.engine_group, self.prefill_engine_group, self.decode_engine_group)
        return [g for g in named if g is not None]


class ServerlessPoolConfig(_Model):
    """An elastic function endpoint (e.g. the serverless reward runtime): a pool without placement."""

    url: str | None = None
    """Endpoint base URL (informational here; the reward executor owns the calls)."""
    max_concurrency: int = Field(1000, ge=1)
    """Concurrent invocations the platform allows (the planner's capacity bound)."""
    price_per_call: float = Field(0.0, ge=0)


class ResourcePlanConfig(_Model):
    """The resource-plane section of a run: per-task affinity, serverless pools, placement limits."""

    tasks: dict[str, TaskAffinity] = Field(default_factory=dict)
    """Task name → where its generation runs (overrides ``TaskConfig.engine_group``)."""
    serverless: dict[str, ServerlessPoolConfig] = Field(default_factory=dict)
    placement_timeout_s: float = Field(120.0, gt=0)
    """How long :func:`place` waits for the cluster to reserve every placement group."""


# the cluster as data -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    address: str
    resources: Mapping[str, float]
    labels: Mapping[str, str] = field(default_factory=dict)

    @property
    def gpu_model(self) -> str | None:
        if self.resources.get("GPU", 0) <= 0:
            return None
        if self.labels.get(ACCELERATOR_LABEL):
            return self.labels[ACCELERATOR_LABEL]
        models = [k[len(_ACCEL_PREFIX) :] for k in self.resources if k.startswith(_ACCEL_PREFIX)]
        return models[0] if models else None

    def custom_resources(self) -> list[str]:
        return [
            k for k in self.resources if k not in _STANDARD and not k.startswith(("node:", _ACCEL_PREFIX))
        ]


@dataclass
class Pool:
    name: str
    kind: PoolKind
    nodes: list[NodeInfo] = field(default_factory=list)
    serverless: ServerlessPoolConfig | None = None

    def total(self, resource: str) -> float:
        return sum(n.resources.get(resource, 0.0) for n in self.nodes)

    def demand(self, spec: AffinitySpec) -> dict[str, float]:
        """Ray resources one replica of ``spec`` takes in this pool (also its placement bundle)."""
        d: dict[str, float] = {"CPU": spec.num_cpus}
        if spec.num_gpus:
            d["GPU"] = spec.num_gpus
        if spec.memory_bytes:
            d["memory"] = float(spec.memory_bytes)
        if self.kind == "resource":
            d[self.name] = 1.0
        elif self.kind == "gpu":
            model = self.nodes[0].gpu_model if self.nodes else self.name
            if f"{_ACCEL_PREFIX}{model}" in self.nodes[0].resources:
                d[f"{_ACCEL_PREFIX}{model}"] = _TINY
        return {k: v for k, v in d.items() if v}

    def label_selector(self, spec: AffinitySpec) -> dict[str, str]:
        sel = dict(spec.labels)
        if self.kind == "label":
            sel[POOL_LABEL] = self.name
        elif self.kind == "gpu" and self.nodes and self.nodes[0].labels.get(ACCELERATOR_LABEL):
            sel[ACCELERATOR_LABEL] = self.nodes[0].labels[ACCELERATOR_LABEL]
        return sel

    def describe(self) -> str:
        if self.kind == "serverless":
            return f"{self.name} (serverless, elastic)"
        keys = ["CPU", "GPU"] + ([self.name] if self.kind == "resource" else [])
        tot = ", ".join(f"{k}: {_num(self.total(k))}" for k in keys if self.total(k))
        return f"{self.name} ({self.kind}, {len(self.nodes)} node{'s' * (len(self.nodes) != 1)}; {tot})"


class ClusterView:
    """Alive nodes and the named pools over them. Build it from Ray or from a node table."""

    def __init__(
        self, nodes: Iterable[NodeInfo], serverless: Mapping[str, ServerlessPoolConfig] | None = None
    ):
        self.nodes = list(nodes)
        self.pools: dict[str, Pool] = {}
        for n in self.nodes:
            for r in n.custom_resources():
                self._add(r, "resource", n)
        for n in self.nodes:
            model = n.gpu_model
            if model and model not in self.pools:
                self._add(model, "gpu", n)
            elif model and self.pools[model].kind == "gpu":
                self._add(model, "gpu", n)
            label = n.labels.get(POOL_LABEL)
            if label and self.pools.get(label, Pool(label, "label")).kind == "label":
                self._add(label, "label", n)
        self.pools["cpu"] = Pool("cpu", "any", list(self.nodes))
        for name, sv in (serverless or {}).items():
            if name in self.pools:
                raise ConfigError(f"serverless pool {name!r} clashes with a cluster pool of that name")
            self.pools[name] = Pool(name, "serverless", serverless=sv)

    def _add(self, name: str, kind: PoolKind, node: NodeInfo) -> None:
        pool = self.pools.setdefault(name, Pool(name, kind))
        if pool.kind == kind and node not in pool.nodes:
            pool.nodes.append(node)

    @classmethod
    def from_node_table(cls, rows: Iterable[Mapping[str, Any]], **kw: Any) -> ClusterView:
        """From ``ray.nodes()`` rows (``NodeID``, ``Alive``, ``Resources``, ``Labels``)."""
        nodes = [
            NodeInfo(
                r["NodeID"],
                r.get("NodeManagerAddress", ""),
                dict(r.get("Resources", {})),
                dict(r.get("Labels", {}) or {}),
            )
            for r in rows
            if r.get("Alive", True)
        ]
        return cls(nodes, **kw)

    @classmethod
    def from_ray(cls, serverless: Mapping[str, ServerlessPoolConfig] | None = None) -> ClusterView:
        import ray

        if not ray.is_initialized():
            raise ConfigError(
                "the resource plane reads a running Ray cluster: call ray.init (RayCluster) first"
            )
        return cls.from_node_table(ray.nodes(), serverless=serverless)

    def pool(self, name: str | None) -> Pool:
        if name is None:
            return self.pools["cpu"]
        return self.pools[name]

    def describe(self) -> str:
        return "; ".join(p.describe() for p in self.pools.values())


# validation ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerDecl:
    """One worker kind of a plan: ``spec.count`` replicas of ``spec`` named ``name``."""

    name: str
    spec: AffinitySpec
    role: str = "worker"
    """How error messages name it: ``engine group``, ``env workers``, ``trainer``…"""

    @property
    def label(self) -> str:
        return f"{self.role} {self.name!r}"


def _decls(workers: Sequence[WorkerDecl | tuple[str, AffinitySpec]]) -> list[WorkerDecl]:
    out = [w if isinstance(w, WorkerDecl) else WorkerDecl(w[0], w[1]) for w in workers]
    names = [w.name for w in out]
    if len(set(names)) != len(names):
        raise ConfigError(f"worker names in a plan must be unique, got {names}")
    return out


def _num(x: float) -> str:
    return f"{x:g}" if x < 1e6 else f"{x / 2**30:.1f}GiB"


def _fmt(d: Mapping[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {_num(v)}" for k, v in d.items()) + "}"


def validate_plan(
    workers: Sequence[WorkerDecl | tuple[str, AffinitySpec]], cluster: ClusterView
) -> dict[str, list[str]]:
    """Check that the cluster can host every worker; raise :class:`ConfigError` naming the first
    worker that cannot be placed and the resource it lacks. Returns the packing it found
    (worker name → node id per replica; empty for serverless workers)."""
    decls = _decls(workers)
    by_name = {w.name: w for w in decls}
    for w in decls:
        pool_name = w.spec.pool
        if pool_name is not None and pool_name not in cluster.pools:
            raise ConfigError(
                f"{w.label} needs pool {pool_name!r}, which the cluster does not have "
                f"(pools: {', '.join(sorted(cluster.pools))})"
            )
        pool = cluster.pool(pool_name)
        if w.spec.serverless != (pool.kind == "serverless") and pool_name is not None:
            want = "a serverless" if w.spec.serverless else "a placed"
            raise ConfigError(f"{w.label} is {want} worker but pool {pool_name!r} is {pool.describe()}")
        if w.spec.colocate_with is not None:
            other = by_name.get(w.spec.colocate_with)
            if other is None:
                raise ConfigError(
                    f"{w.label} is colocated with {w.spec.colocate_with!r}, which is not in the plan"
                )
            if other.spec.colocate_with is not None:
                raise ConfigError(
                    f"{w.label}: colocation chains are not supported "
                    f"({w.name} → {other.name} → {other.spec.colocate_with})"
                )
    placed = [w for w in decls if not w.spec.serverless]
    # 1. pool totals cover the summed demand (the clearest message when a pool is simply too small)
    need: dict[tuple[str, str], float] = defaultdict(float)
    users: dict[tuple[str, str], list[WorkerDecl]] = defaultdict(list)
    for w in placed:
        pool = cluster.pool(w.spec.pool)
        for r, v in pool.demand(w.spec).items():
            need[pool.name, r] += v * w.spec.count
            users[pool.name, r].append(w)
    order = {"GPU": 1, "CPU": 2, "memory": 3}  # the pool's own unit first: the most telling shortage
    for (pname, r), v in sorted(need.items(), key=lambda kv: (order.get(kv[0][1], 0), kv[0])):
        pool = cluster.pools[pname]
        have = pool.total(r)
        if v > have + 1e-9:
            ws = users[pname, r]
            who = " and ".join(f"{w.label} ({w.spec.count} × {_fmt(pool.demand(w.spec))})" for w in ws)
            verb = "needs" if len(ws) == 1 else "together need"
            where = "the cluster has" if pool.kind in ("resource", "any") else f"pool {pname!r} has"
            raise ConfigError(f"{who} {verb} {_num(v)} {r} but {where} {_num(have)} ({pool.describe()})")
    # 2. every replica fits on one node (first-fit decreasing; colocated workers share a node)
    free = {n.node_id: dict(n.resources) for n in cluster.nodes}
    items: list[tuple[list[WorkerDecl], int]] = []
    roots = [w for w in placed if w.spec.colocate_with is None]
    for root in roots:
        group = [root] + [w for w in placed if w.spec.colocate_with == root.name]
        items += [(group, i) for i in range(max(g.spec.count for g in group))]
    items.sort(key=lambda it: -sum(sum(cluster.pool(w.spec.pool).demand(w.spec).values()) for w in it[0]))
    packing: dict[str, list[str]] = {w.name: [] for w in decls}
    for group, i in items:
        members = [w for w in group if i < w.spec.count]
        total: dict[str, float] = defaultdict(float)
        for w in members:
            for r, v in cluster.pool(w.spec.pool).demand(w.spec).items():
                total[r] += v
        candidates = _nodes_for(members, cluster)
        node = next(
            (n for n in candidates if all(free[n.node_id].get(r, 0) + 1e-9 >= v for r, v in total.items())),
            None,
        )
        if node is None:
            who = " + ".join(w.label for w in members)
            sizes = (
                "; ".join(
                    f"{n.node_id[:8]}: {_fmt({r: free[n.node_id].get(r, 0) for r in total})}"
                    for n in candidates
                )
                or "no node matches its pool and labels"
            )
            raise ConfigError(
                f"{who}: replica {i} needs {_fmt(total)} on one node, but no node of pool "
                f"{group[0].spec.pool or 'cpu'!r} has that free (free: {sizes})"
            )
        for r, v in total.items():
            free[node.node_id][r] = free[node.node_id].get(r, 0) - v
        for w in members:
            packing[w.name].append(node.node_id)
    return packing


def _nodes_for(members: list[WorkerDecl], cluster: ClusterView) -> list[NodeInfo]:
    nodes = None
    for w in members:
        pool = cluster.pool(w.spec.pool)
        sel = pool.label_selector(w.spec)
        ok = [n for n in pool.nodes if all(n.labels.get(k) == v for k, v in sel.items())]
        nodes = ok if nodes is None else [n for n in nodes if n in ok]
    return nodes or []


# placement on Ray -------------------------------------------------------------------------------------


@dataclass
class Placement:
    """Reserved placement groups; :meth:`actor_options` gives ``.options(...)`` per replica."""

    decls: dict[str, WorkerDecl]
    cluster: ClusterView
    groups: dict[str, tuple[Any, int]] = field(default_factory=dict)
    """worker name → (placement group, index of its first bundle)."""

    def actor_options(self, name: str, index: int = 0) -> dict[str, Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        w = self.decls.get(name)
        if w is None:
            raise ConfigError(f"no worker {name!r} in this placement ({sorted(self.decls)})")
        if w.spec.serverless:
            raise ConfigError(f"{w.label} is serverless: it has no actor placement")
        if not 0 <= index < w.spec.count:
            raise ConfigError(f"{w.label} has {w.spec.count} replicas, no index {index}")
        pool = self.cluster.pool(w.spec.pool)
        d = pool.demand(w.spec)
        pg, first = self.groups[name]
        opts: dict[str, Any] = {
            "num_cpus": d.get("CPU", 0),
            "num_gpus": d.get("GPU", 0),
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=first + index
            ),
        }
        if "memory" in d:
            opts["memory"] = d["memory"]
        custom = {k: v for k, v in d.items() if k not in _STANDARD}
        if custom:
            opts["resources"] = custom
        return opts

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for pg in {id(pg): pg for pg, _ in self.groups.values()}.values():
            try:
                remove_placement_group(pg)
            except Exception as exc:  # the cluster may be going away already
                log.warning("removing placement group failed: %r", exc)
        self.groups.clear()

    def __enter__(self) -> Placement:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def place(
    workers: Sequence[WorkerDecl | tuple[str, AffinitySpec]],
    cluster: ClusterView | None = None,
    *,
    timeout_s: float = 120.0,
    strategy: str = "PACK",
    name_prefix: str = "rollart",
) -> Placement:
    """Validate the plan, then reserve one placement group per worker (``strategy`` for its
    replicas; colocated workers join their root's group under ``STRICT_PACK``; named
    ``<name_prefix>-<worker>``, unique within the Ray job), waiting until all are ready. Serverless workers get no group. Call :meth:`Placement.remove` when done."""
    import ray
    from ray.util.placement_group import placement_group

    cluster = cluster or ClusterView.from_ray()
    decls = _decls(workers)
    validate_plan(decls, cluster)
    placement = Placement({w.name: w for w in decls}, cluster)
    try:
        for root in (w for w in decls if not w.spec.serverless and w.spec.colocate_with is None):
            group = [root] + [w for w in decls if w.spec.colocate_with == root.name]
            bundles: list[dict[str, float]] = []
            selectors: list[dict[str, str]] = []
            starts = {}
            for w in group:
                pool = cluster.pool(w.spec.pool)
                starts[w.name] = len(bundles)
                bundles += [pool.demand(w.spec)] * w.spec.count
                selectors += [pool.label_selector(w.spec)] * w.spec.count
            kwargs: dict[str, Any] = {
                "strategy": "STRICT_PACK" if len(group) > 1 else strategy,
                "name": f"{name_prefix}-{root.name}",
            }
            if any(selectors):
                kwargs["bundle_label_selector"] = selectors
            pg = placement_group(bundles, **kwargs)
            for w in group:
                placement.groups[w.name] = (pg, starts[w.name])
        pending = {id(pg): (name, pg) for name, (pg, _) in placement.groups.items()}
        refs = {pg.ready(): name for name, pg in pending.values()}
        ready, not_ready = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
        if not_ready:
            names = ", ".join(placement.decls[refs[r]].label for r in not_ready)
            raise PlacementError(
                f"placement groups not ready after {timeout_s:g}s for {names} (cluster: {cluster.describe()})"
            )
        ray.get(ready)
    except BaseException:
        placement.remove()
        raise
    return placement


class ResourceManager:
    """The cluster's pools plus the plan operations, for the pipeline: ``ResourceManager.from_ray()``."""

    def __init__(self, cluster: ClusterView) -> None:
        self.cluster = cluster

    @classmethod
    def from_ray(cls, config: ResourcePlanConfig | None = None) -> ResourceManager:
        return cls(ClusterView.from_ray(serverless=(config.serverless if config else None)))

    @property
    def pools(self) -> dict[str, Pool]:
        return self.cluster.pools

    def validate(self, workers: Sequence[WorkerDecl | tuple[str, AffinitySpec]]) -> dict[str, list[str]]:
        return validate_plan(workers, self.cluster)

    def place(self, workers: Sequence[WorkerDecl | tuple[str, AffinitySpec]], **kw: Any) -> Placement:
        return place(workers, self.cluster, **kw)

    def task_routes(self, tasks: Mapping[str, TaskAffinity], engine_groups: Iterable[str]) -> dict[str, str]:
        """Task → engine group for the proxy (the decode group under PD: it returns the tokens);
        every named group must exist."""
        groups = set(engine_groups)
        out = {}
        for task, aff in tasks.items():
            for g in aff.engine_groups():
                if g not in groups:
                    raise ConfigError(f"task {task!r}: {g!r} is not an engine group ({sorted(groups)})")
            target = aff.decode_engine_group or aff.engine_group
            if target is not None:
                out[task] = target
        return out
