"""Build a run's components from a :class:`RunConfig`, and tear them down again.

Core imports no member package: implementations are resolved by name through the registry, and
Ray actors are created here, when the pipeline is built (R1: placement from each class's recorded
affinity, overridable per engine group in the config). The engine plan is validated against the
cluster's pools and reserved with placement groups (:mod:`rollart_core.resources`) before any
engine starts, so a missing pool fails fast with the engine group and the resource it lacks.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import shutil
import time
from collections.abc import Awaitable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any, Generic, TypeVar, overload

from rollart_core.config import RunConfig, TaskConfig, file_sha256
from rollart_core.control.admin import AdminServer
from rollart_core.control.elastic import ElasticEngines, engine_actor
from rollart_core.errors import ConfigError, RegistryError, RollartError
from rollart_core.protocols import (
    ChatFormat,
    Proxy,
    RewardExecutor,
    SupportsAclose,
    SupportsClose,
    SupportsHealthLoop,
    Trainer,
    WeightStore,
)
from rollart_core.registry import build, check, resolve, validate_options
from rollart_core.resources import RayCluster, get_affinity

__all__ = ["Pipeline", "check_lora", "check_tasks", "trainer_group_config"]


def _pd_roles(cfg: RunConfig) -> dict[str, set[str]]:
    """Engine group → KV roles it plays for the tasks with prefill/decode disaggregation on."""
    roles: dict[str, set[str]] = {}
    for t in cfg.tasks:
        if t.pd != "off" and t.engine_group is not None and t.prefill_engine_group is not None:
            roles.setdefault(t.prefill_engine_group, set()).add("kv_producer")
            roles.setdefault(t.engine_group, set()).add("kv_consumer")
    return roles


def check_tasks(cfg: RunConfig) -> None:
    """Every task's components, before anything starts: each implementation's options, and each
    environment's own check of what they point to (``SupportsConfigCheck``: a dataset's file, rows and
    keys; an agent's code), so a user's mistake is one error naming it, at start.

    An environment whose options have a ``model`` field (the agent env: its endpoint's tokenizer and
    chat template) and that leaves it out gets the run's ``model.path`` there first: a preset's or a
    GGUF's converted directory is named by a content hash no one should copy into a config."""
    for i, task in enumerate(cfg.tasks):
        for component in (task.env, task.eval_env):
            if component is not None and "model" not in component.options:
                fields = getattr(getattr(resolve("env", component.impl), "Config", None), "model_fields", {})
                if "model" in fields:
                    component.options["model"] = str(cfg.model.path)
        check("env", task.env.impl, task.env.options, f"tasks.{i}.env.options")
        if task.eval_env is not None:
            check("env", task.eval_env.impl, task.eval_env.options, f"tasks.{i}.eval_env.options")
        validate_options(
            resolve("reward", task.reward.impl), task.reward.options, f"tasks.{i}.reward.options"
        )
        validate_options(
            resolve("reward_executor", task.reward_executor.impl),
            task.reward_executor.options,
            f"tasks.{i}.reward_executor.options",
        )


def check_lora(cfg: RunConfig, engine_cfgs: list[Any]) -> None:
    """A trainer that trains LoRA served as adapters (``trainer.options.lora``, ``serve: adapter``)
    pushes adapters, not weights: every engine must serve them (its ``lora`` option, ``max_lora_rank``
    >= the trainer's ``lora.rank``), and an engine that serves adapters needs such a trainer (LoRA
    served ``merged`` pushes full weights, as full fine-tuning does). ConfigError naming both fields
    otherwise."""
    served = [getattr(e, "lora", None) for e in engine_cfgs]
    if "lora" not in cfg.trainer.options and not any(served):
        return  # neither side uses LoRA: the trainer's class (and torch) is not imported here
    trainer = validate_options(resolve("trainer", cfg.trainer.impl), cfg.trainer.options, "trainer.options")
    lora = getattr(trainer, "lora", None)
    adapters = lora is not None and getattr(lora, "serve", "adapter") == "adapter"
    rank = getattr(lora, "rank", 0)
    for i, (group, engine_lora) in enumerate(zip(cfg.engines, served, strict=True)):
        if adapters and engine_lora is None:
            raise ConfigError(
                f"trainer.options.lora is set (the trainer pushes LoRA adapters) but "
                f"engines.{i}.options.lora is not (engine group {group.name!r}, impl {group.impl!r}, "
                "loads full weights): set it, e.g. lora: {max_lora_rank: " + f"{rank}}}"
                ", or serve the adapters merged (trainer.options.lora.serve: merged)"
            )
        if not adapters and engine_lora is not None:
            why = (
                "has serve: merged (the trainer pushes LoRA merged into"
                if lora is not None
                else "is not set (the trainer pushes"
            )
            raise ConfigError(
                f"engines.{i}.options.lora is set (engine group {group.name!r} serves LoRA adapters) "
                f"but trainer.options.lora {why} full weights): drop the engine's lora option"
            )
        if adapters and engine_lora is not None and rank > engine_lora.max_lora_rank:
            raise ConfigError(
                f"trainer.options.lora.rank ({rank}) exceeds engines.{i}.options.lora.max_lora_rank "
                f"({engine_lora.max_lora_rank}) of engine group {group.name!r}"
            )


def _with_engine_args(options: dict[str, Any], extra: dict[str, Any] | None) -> dict[str, Any]:
    if not extra:
        return options
    return {**options, "engine_args": {**extra, **options.get("engine_args", {})}}


def overlap_warning(cfg: RunConfig) -> str | None:
    """What to tell a user whose torch trainer trains in the control plane's process while rollout
    runs beside it (one_off / async): the step and the asyncio loop then share one GIL."""
    opts = cfg.trainer.options
    if (
        cfg.loop.mode == "sync"
        or cfg.trainer.impl != "torch"
        or cfg.trainer.group
        or opts.get("spawn")
        or opts.get("world_size", 1) > 1
    ):
        return None
    return (
        f"loop.mode {cfg.loop.mode!r} overlaps training with rollout, but the torch trainer runs in this "
        "process: its step and the rollout's event loop share one GIL and slow each other down (measured on "
        "2 CPU cores: generation 24 ms per turn alone, 280 ms beside a step). Set trainer.options.spawn: true "
        "(and num_threads to the trainer's share of the cores)."
    )


log = logging.getLogger(__name__)
_T = TypeVar("_T")
TRAINER_GROUP = "rollart_train.ray_group:RayTrainerGroup"


def trainer_group_config(cfg: RunConfig) -> Any:
    """The validated config of the trainer's worker group (``trainer.ranks`` / ``trainer.pool`` set):
    ``trainer.impl`` names the rank kind (``torch``, ``megatron``), ``trainer.options`` are each rank's
    trainer settings (``tensor_parallel`` / ``pipeline_parallel`` for megatron). ConfigError on bad
    options, such as TP x PP not dividing ``ranks`` or ``device: cuda`` without ``num_gpus``."""
    t = cfg.trainer
    options = {
        "worker": t.impl,
        "ranks": t.ranks or 1,
        "pool": t.pool,
        "num_cpus_per_rank": t.num_cpus,
        "num_gpus_per_rank": t.num_gpus,
        "options": t.options,
        "max_restarts": cfg.loop.max_trainer_restarts or 0,
        "checkpoint_dir": str(cfg.output_dir),
    }
    return validate_options(resolve("trainer", TRAINER_GROUP), options, "trainer")


def weight_store_options(cfg: RunConfig) -> dict[str, Any]:
    """The weight store's options; a filesystem store defaults to ``OUTPUT_DIR/weights``. A new run
    (no ``resume_from``) starts at version 1, so versions an earlier run left in that directory are
    removed (retention would otherwise keep the old newest versions and drop the new ones); a root
    the config names that holds committed versions is refused rather than emptied."""
    opts = dict(cfg.weight_store.options)
    if cfg.weight_store.impl != "filesystem":
        return opts
    if "root" in opts:
        root = Path(opts["root"])
        if not cfg.loop.resume_from and any(root.glob("v*/COMMITTED")):
            raise ConfigError(
                f"weight_store.options.root {root} holds weights of an earlier run; a new run starts "
                "at version 1: empty the directory, choose another, or set loop.resume_from"
            )
        return opts
    root = cfg.output_dir / "weights"
    if not cfg.loop.resume_from and root.exists():
        log.info("a new run: removing the earlier run's weight versions in %s", root)
        shutil.rmtree(root)
    opts["root"] = str(root)
    return opts


class _Part(Generic[_T]):
    """A pipeline component, kept in ``_<name>`` (None until built); reading it unbuilt raises
    :class:`RollartError` naming it."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.slot = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = f"_{name}"

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> _Part[_T]: ...
    @overload
    def __get__(self, obj: object, owner: type | None = None) -> _T: ...
    def __get__(self, obj: object | None, owner: type | None = None) -> _T | _Part[_T]:
        if obj is None:
            return self
        value: _T | None = getattr(obj, self.slot)
        if value is None:
            raise RollartError(
                f"pipeline: no {self.label} (the pipeline is not built: use `async with Pipeline(cfg)`)"
            )
        return value

    def __set__(self, obj: object, value: _T) -> None:
        setattr(obj, self.slot, value)


class Pipeline:
    """``async with Pipeline(cfg) as p:`` gives ``p.trainer``, ``p.store``, ``p.proxy``, ``p.chat``,
    per-task ``p.rewards`` and ``p.make_env(task)``.

    Every attribute is declared here, empty until ``__aenter__`` builds it; ``__aexit__`` stops
    whatever was built (a build that failed half-way included). Reading a component that was not
    built raises :class:`RollartError` naming it."""

    trainer = _Part[Trainer]("trainer")
    store = _Part[WeightStore]("weight store")
    proxy = _Part[Proxy]("proxy")
    chat = _Part[ChatFormat]("chat format")

    def __init__(self, config: RunConfig) -> None:
        self.config = config
        self.tag = secrets.token_hex(3)
        """In the names of its Ray actors and placement groups: two pipelines may share a Ray job."""
        self._stack = AsyncExitStack()
        self.actors: list[Any] = []  # engine actors, in start order
        self.timings: dict[str, float] = {}  # start-up phases (the run summary)
        self.rewards: dict[str, RewardExecutor] = {}
        self.env_manager: Any | None = None  # environment workers (config ``env_manager``)
        self.resources: Any | None = None  # the cluster's ResourceManager
        self.placement: Any | None = None  # the engines' placement groups
        self.elastic: ElasticEngines | None = None  # engines added and removed while the run goes on
        self.admin: AdminServer | None = None  # the run's admin endpoint (admin.json in output_dir)
        self._pd_kv_dir: Path | None = None
        self._trainer: Trainer | None = None
        self._store: WeightStore | None = None
        self._proxy: Proxy | None = None
        self._chat: ChatFormat | None = None

    async def __aenter__(self) -> Pipeline:
        cfg = self.config
        try:
            await self._build(cfg)
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    async def _build(self, cfg: RunConfig) -> None:
        t0 = time.perf_counter()
        check_tasks(cfg)  # every task's components, before creating or starting anything
        self._pd_kv_dir = cfg.output_dir / "kv" if _pd_roles(cfg) else None
        pd_args = self._pd_engine_args(cfg)
        engine_cfgs = [
            validate_options(
                resolve("engine", g.impl),
                _with_engine_args(g.options, pd_args.get(g.name)),
                f"engines.{i}.options",
            )
            for i, g in enumerate(cfg.engines)
        ]
        check_lora(cfg, engine_cfgs)
        self._check_model()  # a model path that is no model fails before Ray starts
        group_cfg = self._trainer_group_config(cfg) if cfg.trainer.group else None
        # Ray starts while the model is created in code (a first run's tiny model) and an in-process
        # trainer is built (its imports and the model's load): seconds of CPU in a thread here, while
        # Ray's start is mostly its own processes, so the start-up phases overlap
        model_ready = asyncio.ensure_future(
            asyncio.to_thread(self._prepare_local, local_trainer=group_cfg is None)
        )
        try:
            self.timings["ray_start_s"] = self._stack.enter_context(RayCluster(cfg.ray)).start_s
        except BaseException:
            await asyncio.gather(model_ready, return_exceptions=True)
            raise
        await model_ready
        store_opts = weight_store_options(cfg)
        self.store = build(
            "weight_store", cfg.weight_store.impl, store_opts, "weight_store.options", protocol=WeightStore
        )
        if (warning := overlap_warning(cfg)) is not None:
            log.warning(warning)
        self.chat = resolve("chat", cfg.model.chat_format)(cfg.model.path)
        self.rewards = {
            t.name: build(
                "reward_executor",
                t.reward_executor.impl,
                t.reward_executor.options,
                f"tasks.{i}.reward_executor.options",
                protocol=RewardExecutor,
                fn=build("reward", t.reward.impl, t.reward.options, f"tasks.{i}.reward.options"),
            )
            for i, t in enumerate(cfg.tasks)
        }
        self._check_store_reach(cfg)
        if group_cfg is not None:  # placed on its pool, validated with the engines before either starts
            self._validate_plan(group_cfg)
        self.timings["build_local_s"] = time.perf_counter() - t0
        # The trainer group, the engines and the environment workers start side by side: each is
        # mostly process start-up and imports, which overlap (on a busy host too). All are waited
        # for before a failure is raised, so that __aexit__ finds and stops whatever did start.
        starts = [
            self._timed("engines_start_s", self._start_engines(engine_cfgs)),
            self._timed("env_manager_start_s", self._start_env_manager(cfg)),
        ]
        if group_cfg is not None:
            starts.append(self._timed("trainer_start_s", self._start_trainer_group(group_cfg)))
        failures = [r for r in await asyncio.gather(*starts, return_exceptions=True) if r is not None]
        if failures:
            raise failures[0]

    async def _timed(self, key: str, start: Awaitable[None]) -> None:
        t0 = time.perf_counter()
        await start
        self.timings[key] = time.perf_counter() - t0

    async def _start_trainer_group(self, group_cfg: Any) -> None:
        """The trainer's rank actors on their pool (placed beside the engines: validated together)."""
        self.trainer = await asyncio.to_thread(
            resolve("trainer", TRAINER_GROUP),
            group_cfg,
            model_path=self.config.model.path,
            weight_store=self.store,
        )

    def _check_store_reach(self, cfg: RunConfig) -> None:
        """Every node must reach the weight store: a local directory does not span nodes."""
        import ray

        nodes = [n for n in ray.nodes() if n.get("Alive")]
        store: Any = self.store
        while hasattr(store, "inner"):  # a wrapper (node_cache, faulty): what it wraps decides
            store = store.inner
        store_cfg = getattr(store, "config", None)
        if (
            type(store).__name__ == "FilesystemWeightStore"
            and len(nodes) > 1
            and not getattr(store_cfg, "shared", False)
        ):
            raise ConfigError(
                f"weight_store filesystem ({getattr(store, 'root', '?')}) is a local directory, but "
                f"the cluster has {len(nodes)} nodes: engines on other nodes would never see the "
                "weights. Use a store every node reaches (weight_store.impl: mooncake or ray), or set "
                "weight_store.options.shared: true if the directory is on a shared file system"
            )

    def _trainer_group_config(self, cfg: RunConfig) -> Any:
        return trainer_group_config(cfg)

    def _engine_decls(self) -> list[Any]:
        from rollart_core.resources import WorkerDecl

        return [
            WorkerDecl(
                g.name,
                get_affinity(resolve("engine", g.impl), pool=g.pool, num_cpus=g.num_cpus, count=g.count),
                "engine group",
            )
            for g in self.config.engines
        ]

    def _validate_plan(self, group_cfg: Any) -> None:
        """Engines and trainer ranks together fit the cluster's pools (ConfigError naming the worker,
        the pool and what exists otherwise), before anything is started."""
        from rollart_core.resources import ResourceManager

        decl = resolve("trainer", TRAINER_GROUP).worker_decl(group_cfg)
        ResourceManager.from_ray().validate([*self._engine_decls(), decl])

    def _check_model(self) -> bool:
        """True when the model directory has to be made (``create_tiny``, or a GGUF not converted
        yet); ConfigError when it is not a model directory and cannot be made, or its GGUF is one the
        converter does not handle."""
        m = self.config.model
        if m.gguf is not None:
            resolve("model", "rollart_train.gguf:inspect_gguf")(m.gguf)
            return not resolve("model", "rollart_train.gguf:converted_ok")(m.path, file_sha256(m.gguf))
        if resolve("model", "rollart_train.tiny:is_model_dir")(m.path):
            return False
        if not m.create_tiny:
            raise ConfigError(
                f"model.path {m.path} is not a Hugging Face model directory (set create_tiny: true "
                "to create the tiny random model there)"
            )
        return True

    def _prepare_local(self, *, local_trainer: bool) -> None:
        """The model directory, then (no worker group) the trainer in this process."""
        self._ensure_model()
        if local_trainer:
            t0 = time.perf_counter()
            cfg = self.config
            self.trainer = build(
                "trainer",
                cfg.trainer.impl,
                cfg.trainer.options,
                "trainer.options",
                protocol=Trainer,
                model_path=cfg.model.path,
            )
            self.timings["trainer_start_s"] = time.perf_counter() - t0

    def _ensure_model(self) -> None:
        t0 = time.perf_counter()
        m = self.config.model
        if m.gguf is not None:
            if self._check_model():
                log.info("converting %s to a Hugging Face model at %s", m.gguf, m.path)
            resolve("model", "rollart_train.gguf:convert_gguf")(m.gguf, m.path, dtype=m.dtype)
        elif self._check_model():
            log.info("creating the tiny model at %s", m.path)
            resolve("model", "rollart_train.tiny:create_tiny_model")(m.path, dtype=m.dtype)
        resolve("model", "rollart_train.model_check:check_model_dir")(m.path)
        self.timings["model_s"] = time.perf_counter() - t0  # start-up phases (the run summary)

    async def _start_engines(self, engine_cfgs: list[Any]) -> None:
        from rollart_core.resources import ResourceManager

        proxy_cls = resolve("proxy", "default")
        classes = [resolve("engine", g.impl) for g in self.config.engines]
        self.resources = resources = ResourceManager.from_ray()
        self.placement = placement = await asyncio.to_thread(
            resources.place, self._engine_decls(), name_prefix=f"rollart-{self.tag}"
        )
        members: list[tuple[str, Any, str]] = []
        self.elastic = elastic = ElasticEngines(
            self, {g.name: c for g, c in zip(self.config.engines, engine_cfgs, strict=True)}
        )
        for group, ecfg, cls in zip(self.config.engines, engine_cfgs, classes, strict=True):
            for r in range(group.count):
                name = f"{group.name}-{r}"
                actor = engine_actor(cls, group, ecfg, name, placement.actor_options(group.name, r), self)
                self.actors.append(actor)
                elastic.started(name, group.name, actor, (placement, group.name, r))
                members.append((name, actor, group.name))
        await asyncio.gather(*(a.start.remote() for a in self.actors))
        task_pools = {t.name: t.engine_group for t in self.config.tasks if t.engine_group is not None}
        proxy = proxy_cls.from_ray_actors(members, task_pools=task_pools)
        if self._pd_kv_dir is not None:  # prefill/decode disaggregation: the PD router fronts the proxy
            pd_cls = resolve("proxy", "pd")
            proxy = pd_cls(proxy, pd_cls.Config.from_tasks(self.config.tasks, kv_store_dir=self._pd_kv_dir))
        if not isinstance(proxy, Proxy):
            raise RegistryError(
                f"proxy {type(proxy).__name__} does not implement rollart_core.protocols.Proxy"
            )
        self._proxy = proxy
        if isinstance(proxy, SupportsHealthLoop):  # restarted engines come back on the served weights
            proxy.start_health_loop()
        if self.config.admin.enabled:  # `rollart engines RUN_DIR ...` adds and removes engines
            self.admin = AdminServer(self)
            await self.admin.start(self.config.admin.port)
        elastic.start_watch()

    def _pd_engine_args(self, cfg: RunConfig) -> dict[str, dict[str, Any]]:
        """KV-connector engine args per engine group for tasks with ``pd`` on/auto: prefill groups
        produce KV, decode groups consume it (a group that does both gets ``kv_both``)."""
        roles = _pd_roles(cfg)
        if not roles:
            return {}
        for g in cfg.engines:
            if g.name in roles and g.impl != "vllm":
                raise ConfigError(
                    f"engine group {g.name!r}: prefill/decode disaggregation needs impl 'vllm' "
                    f"(its KV connector), not {g.impl!r}"
                )
        pd_cls = resolve("proxy", "pd")
        return {
            g: pd_cls.engine_args(r.pop() if len(r) == 1 else "kv_both", self._pd_kv_dir)
            for g, r in roles.items()
        }

    async def _start_env_manager(self, cfg: RunConfig) -> None:
        import ray

        em = cfg.env_manager
        if em is None:
            return
        cls = resolve("env_manager", em.impl)
        options = {
            **em.options,
            "groups": {
                t.name: {"impl": t.env.impl, "options": t.env.options, "num_envs": em.num_envs}
                for t in cfg.tasks
            },
        }
        mcfg = validate_options(cls, options, "env_manager.options")
        pool = getattr(mcfg, "pool", None)
        if pool is not None and pool not in ray.cluster_resources():
            raise ConfigError(
                f"env_manager: environment workers need the Ray resource {pool!r} (their pool), "
                f"which no node has (cluster: {sorted(ray.cluster_resources())}); declare it in "
                "ray.resources or set env_manager.options.pool: null"
            )
        self.env_manager = manager = cls(mcfg)
        await manager.start()

    def make_env(self, task: TaskConfig, index: int, *, held_out: bool = False) -> Any:
        """A new environment of the task (``held_out``: its ``eval_env`` when it has one)."""
        if held_out and task.eval_env is not None:
            return build("env", task.eval_env.impl, task.eval_env.options, f"tasks.{index}.eval_env.options")
        return build("env", task.env.impl, task.env.options, f"tasks.{index}.env.options")

    async def acquire_env(self, task: TaskConfig, index: int) -> Any:
        """An environment for one trajectory: leased from the EnvManager, or built in-process."""
        if self.env_manager is not None:
            return await self.env_manager.acquire(task.name)
        return self.make_env(task, index)

    async def __aexit__(self, *exc: object) -> None:
        if (manager := self.env_manager) is not None:
            self.env_manager = None
            try:
                await manager.shutdown()
            except Exception as e:
                log.warning("env manager shutdown failed: %r", e)
        if (admin := self.admin) is not None:
            self.admin = None
            await admin.close()
        elastic = self.elastic
        if elastic is not None:
            await elastic.stop_watch()
        proxy = self._proxy
        if isinstance(proxy, SupportsHealthLoop):
            await proxy.stop_health_loop()
        if self.actors:
            import ray
        for a in self.actors:
            try:
                await asyncio.wait_for(a.shutdown.remote(), timeout=30)
            except Exception as e:  # the actor may already be dead; kill it regardless
                log.warning("engine shutdown failed: %r", e)
            ray.kill(a)
        self.actors.clear()
        if elastic is not None:
            elastic.release_all()
        if (placement := self.placement) is not None:
            self.placement = None
            placement.remove()
        trainer = self._trainer
        if isinstance(trainer, SupportsClose):  # e.g. spawned trainer ranks, a worker group
            try:
                await asyncio.to_thread(trainer.close)
            except Exception as e:
                log.warning("trainer close failed: %r", e)
        for name, executor in self.rewards.items():  # e.g. a reward runtime it started
            if isinstance(executor, SupportsAclose):
                try:
                    await executor.aclose()
                except Exception as e:
                    log.warning("reward executor of task %s failed to close: %r", name, e)
        store = self._store
        if isinstance(store, SupportsClose):
            store.close()
        await self._stack.aclose()
