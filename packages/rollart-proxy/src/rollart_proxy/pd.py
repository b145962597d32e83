"""Prefill/decode disaggregation: a request's prefill on one pool, its decode on another.

A generation pool (the *decode pool*, the one a task is routed to) can be paired with a *prefill
pool* (``PDConfig.pools``: decode pool → prefill pool), possibly of another hardware class and
size. For a request taking the ``pd`` path, :class:`PDRouter`:

1. sends it with ``max_tokens=1`` to a prefill worker (least outstanding, sticky per session):
   the engine's KV connector (vLLM ``kv_transfer_config``, role ``kv_producer``) writes the
   prompt's KV cache, and the worker returns the first token;
2. sends ``prompt + first token`` with ``max_tokens - 1`` to a decode worker (sticky per session,
   role ``kv_consumer``), whose connector loads the prompt's KV instead of computing it;
3. joins the two: the output's first token, logprob and version come from the prefill worker.

The connector is configuration: :func:`shared_storage_kv_args` gives a shared-directory connector
(vLLM's ``ExampleConnector``, keyed by the prompt's tokens; runs on CPU); content-addressed
connectors (LMCache, Mooncake store) fit the same routing. P2P connectors (NIXL, MooncakeConnector)
also need the producer's ``kv_transfer_params`` handed to the consumer request: not wired yet.

Which path a turn takes (``PDOutput.pd_path``, counted in :meth:`PDRouter.metrics`):

- ``pd``: as above;
- ``decode_only``: the decode worker alone, when the task's policy is ``off``, the pool has no
  prefill pool, or the turn is not worth moving: its *uncached suffix* (prompt tokens beyond
  the history the session's decode worker already holds in its prefix cache) is shorter than
  ``min_pd_suffix_tokens`` (multi-turn reuse: a short new observation after a long history is
  cheaper to prefill where the history is cached than to ship the whole KV);
- ``local_fallback``: PD was chosen but no prefill worker could serve (crashed, all unhealthy):
  the decode worker prefills locally.

Per-task policy (``TaskConfig.pd``): ``on``, ``off``, or ``auto``. ``auto`` with a task profile
(:class:`~rollart_core.plan.workload.TaskProfile`) is ``on`` when the task prefills at least
``auto_min_ratio`` tokens per generated token (prompt vs output length); without a profile each
turn is judged by its own uncached suffix vs its ``max_tokens``.

Weight updates (:meth:`PDRouter.update_weights`) suspend both pools, update every worker to the
same version, check that each reports it, clear the shared KV store (KV written under the old
weights must not be loaded under the new ones), and only then resume. A request whose prefill ran
under another version than its decode says so: ``PDOutput.prefill_version`` and the per-token
``versions`` (``mixed_versions`` is True; counted in the metrics).
"""

from __future__ import annotations

import logging
import shutil
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rollart_core.errors import ConfigError, EngineError, WeightSyncError
from rollart_core.protocols import PauseMode
from rollart_core.types import GenerateOutput, GenerateRequest
from rollart_proxy.errors import WorkerUnavailableError
from rollart_proxy.proxy import LLMProxy

if TYPE_CHECKING:
    from rollart_core.config import TaskConfig
    from rollart_core.plan.workload import TaskProfile

__all__ = ["PDConfig", "PDOutput", "PDPath", "PDPolicy", "PDRouter", "choose_path", "shared_storage_kv_args"]

log = logging.getLogger(__name__)

PDPolicy = Literal["auto", "on", "off"]
PDPath = Literal["pd", "decode_only", "local_fallback"]
PATHS: tuple[PDPath, ...] = ("pd", "decode_only", "local_fallback")
_PREFILL_SESSION = "#prefill"


class PDConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    pools: dict[str, str] = Field(default_factory=dict)
    """Decode pool → its prefill pool (worker pool names of the proxy)."""
    task_policy: dict[str, PDPolicy] = Field(default_factory=dict)
    """Per task: ``auto``, ``on`` or ``off``; tasks not listed get ``default_policy``."""
    default_policy: PDPolicy = "off"
    default_pool: str | None = None
    """Decode pool of requests whose task has no pool; None: the only decode pool of ``pools``."""
    min_pd_suffix_tokens: int = Field(256, ge=1)
    """A turn goes through a prefill worker only if at least this many of its prompt tokens are not
    already in the decode worker's prefix cache; shorter suffixes are prefilled on the decode worker."""
    auto_min_ratio: float = Field(1.0, gt=0)
    """``auto``: PD when prefill tokens ≥ this × generated tokens (task profile, else the turn)."""
    kv_store_dir: Path | None = None
    """Directory of a shared-storage KV connector: cleared on every weight update."""

    @model_validator(mode="after")
    def _check(self) -> PDConfig:
        for d, p in self.pools.items():
            if d == p:
                raise ValueError(f"pool {d!r} cannot be its own prefill pool")
            if p in self.pools:
                raise ValueError(f"prefill pool {p!r} is also a decode pool")
        return self

    @classmethod
    def from_tasks(cls, tasks: Iterable[TaskConfig], **kw: Any) -> PDConfig:
        """Pairs and policies from run-config tasks (``engine_group`` + ``prefill_engine_group`` +
        ``pd``); the proxy calls an engine group a pool."""
        pools: dict[str, str] = {}
        policy: dict[str, PDPolicy] = {}
        for t in tasks:
            policy[t.name] = t.pd
            decode, prefill = t.engine_group, t.prefill_engine_group
            if prefill is None or decode is None:
                continue
            if pools.setdefault(decode, prefill) != prefill:
                raise ConfigError(
                    f"task {t.name!r}: engine_group {decode!r} is paired with prefill engine group "
                    f"{pools[decode]!r} by another task, not {prefill!r}"
                )
        return cls(pools=pools, task_policy=policy, **kw)


def shared_storage_kv_args(
    role: Literal["kv_producer", "kv_consumer", "kv_both"], storage_dir: str | Path
) -> dict[str, Any]:
    """``VllmEngineConfig.engine_args`` for KV through a shared directory (vLLM's ``ExampleConnector``
    made safe for every prompt length, :mod:`rollart_proxy.engines.vllm_kv_connector`; runs on CPU).
    Prefill workers take ``kv_producer``, decode workers ``kv_consumer``.

    Chunked prefill is off: the connector saves a request's KV in the step that schedules it
    first, so a prompt split over several steps would be saved incomplete.
    """
    return {
        "kv_transfer_config": {
            "kv_connector": "SharedStorageConnector",
            "kv_connector_module_path": "rollart_proxy.engines.vllm_kv_connector",
            "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": str(storage_dir)},
        },
        "enable_chunked_prefill": False,
    }


@dataclass(slots=True)
class PDOutput(GenerateOutput):
    """A :class:`GenerateOutput` that says how it was produced."""

    pd_path: PDPath = "decode_only"
    prefill_worker: str | None = None
    """The worker that computed the prompt's KV and the first token (``pd`` path)."""
    prefill_version: int | None = None
    """Weight version the prompt's KV and first token were computed with (``pd`` path)."""

    @property
    def mixed_versions(self) -> bool:
        """True when the decode ran under other weights than the prefill (a weight update fell
        between them; the decode worker then recomputed the KV, but the first token is older)."""
        return self.prefill_version is not None and any(v != self.prefill_version for v in self.versions[1:])


def choose_path(
    policy: PDPolicy, *, uncached_tokens: int, max_tokens: int, min_suffix: int, auto_min_ratio: float
) -> Literal["pd", "decode_only"]:
    """The per-turn cost rule. PD costs a KV transfer of the prompt and a second hop; it pays when
    the decode worker would otherwise have to prefill a long suffix (stalling its decode batch)."""
    if policy == "off" or max_tokens < 2 or uncached_tokens < min_suffix:
        return "decode_only"
    if policy == "auto" and uncached_tokens < auto_min_ratio * max_tokens:
        return "decode_only"
    return "pd"


def resolve_policy(policy: PDPolicy, profile: TaskProfile | None, auto_min_ratio: float) -> PDPolicy:
    """``auto`` with a profile becomes ``on`` or ``off`` (prompt vs output tokens); else unchanged."""
    if policy != "auto" or profile is None:
        return policy
    return "on" if profile.prefill_tokens() >= auto_min_ratio * max(profile.decode_tokens(), 1.0) else "off"


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class PDRouter:
    """Routes requests over an :class:`LLMProxy` whose workers form prefill and decode pools.

    Use it where an ``LLMProxy`` is used (``generate``, ``abort``, ``end_session``, ``suspend``,
    ``resume``, ``update_weights``, ``weight_versions``, ``metrics``). Within each pool the proxy's
    own routing applies (stickiness, least outstanding, back-pressure, retries); the worker handles
    are shared, so in-flight limits and health are the proxy's.
    """

    Config = PDConfig
    engine_args = staticmethod(shared_storage_kv_args)
    """KV-connector engine args for a role (what ``rollart_core.control.pipeline`` gives each engine group)."""

    def __init__(
        self,
        proxy: LLMProxy,
        config: PDConfig | None = None,
        *,
        profiles: Mapping[str, TaskProfile] | None = None,
    ) -> None:
        self.proxy = proxy
        self.config = cfg = config or PDConfig()
        by_pool: dict[str, list[Any]] = {}
        for w in proxy.workers.values():
            by_pool.setdefault(w.pool, []).append(w)
        missing = sorted({*cfg.pools, *cfg.pools.values()} - set(by_pool))
        if missing:
            raise ConfigError(f"PD pools without workers: {missing} (pools: {sorted(by_pool)})")
        if "pd" in proxy.workers:
            raise ConfigError("a worker may not be named 'pd' (the PD router's metrics key)")
        if cfg.default_pool is not None and cfg.default_pool not in by_pool:
            raise ConfigError(f"default_pool {cfg.default_pool!r} has no workers (pools: {sorted(by_pool)})")
        prefill_pools = set(cfg.pools.values())
        for task, pool in proxy.task_pools.items():
            if pool in prefill_pools:
                raise ConfigError(
                    f"task {task!r} is routed to {pool!r}, a prefill pool: route it to its decode pool"
                )
        # One routing view per pool over the proxy's own worker handles: separate session maps
        # keep a trajectory's prefill stickiness apart from its decode stickiness. A prefill pool
        # with no healthy worker must not hold requests while it recovers: the decode worker
        # prefills locally instead (``local_fallback``), so its view never waits.
        self._views = {
            p: LLMProxy(
                ws,
                max_retries=proxy.max_retries,
                max_sessions=proxy.max_sessions,
                recover_wait_s=0.0 if p in prefill_pools else proxy.recover_wait_s,
                recover_poll_s=proxy.recover_poll_s,
            )
            for p, ws in by_pool.items()
        }
        for view in self._views.values():
            view.fleet.owner = proxy.fleet  # recovery needs the served version, which the proxy holds
        self._policy = {
            t: resolve_policy(p, (profiles or {}).get(t), cfg.auto_min_ratio)
            for t, p in cfg.task_policy.items()
        }
        self._held: OrderedDict[str, list[int]] = OrderedDict()
        """Session → tokens its decode worker has seen (last prompt + output): its prefix cache
        (LRU, at most the proxy's ``max_sessions``)."""
        self._active: dict[str, str | None] = {}
        self._aborted: set[str] = set()
        self.version: int | None = None
        self.paths = dict.fromkeys(PATHS, 0)
        self.mixed_version_requests = 0
        self.kv_store_clears = 0

    # routing ---------------------------------------------------------------------------------

    def policy_of(self, task: str | None) -> PDPolicy:
        """The task's policy (``auto`` already resolved where a profile was given)."""
        return self._policy.get(task, self.config.default_policy) if task else self.config.default_policy

    def decode_pool_of(self, task: str | None) -> str:
        pool = self.proxy.pool_of(task) or self.config.default_pool
        if pool is None:
            if len(self.config.pools) == 1:
                return next(iter(self.config.pools))
            if len(self._views) == 1:
                return next(iter(self._views))
            raise EngineError(f"task {task!r} has no pool and PDConfig.default_pool is not set")
        return pool

    def _uncached(self, request: GenerateRequest, view: LLMProxy) -> int:
        sid = request.session_id
        name = view.session_worker(sid) if sid else None
        if name is None or not view.workers[name].healthy:
            return len(request.prompt_ids)
        return len(request.prompt_ids) - _common_prefix(self._held.get(sid or "", []), request.prompt_ids)

    def route(self, request: GenerateRequest) -> tuple[Literal["pd", "decode_only"], str, str | None]:
        """``(path, decode pool, prefill pool)`` this request would take now."""
        pool = self.decode_pool_of(request.task)
        prefill = self.config.pools.get(pool)
        if prefill is None:
            return "decode_only", pool, None
        c = self.config
        path = choose_path(
            self.policy_of(request.task),
            uncached_tokens=self._uncached(request, self._views[pool]),
            max_tokens=request.sampling.max_tokens,
            min_suffix=c.min_pd_suffix_tokens,
            auto_min_ratio=c.auto_min_ratio,
        )
        return path, pool, prefill

    # generation ------------------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> PDOutput:
        out: GenerateOutput | None = None
        async for out in self._run(request, stream=False):  # noqa: B007 - the last one is the output
            pass
        if not isinstance(out, PDOutput):  # _run ends with one or raises
            raise WorkerUnavailableError(f"request {request.request_id} ended without a complete output")
        return out

    async def generate_stream(self, request: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        """Token deltas (``finish_reason == ""``; on the ``pd`` path the first one is the prefill
        worker's token), then the complete :class:`PDOutput` (see ``SupportsStream``)."""
        async for out in self._run(request, stream=True):
            yield out

    async def _run(self, request: GenerateRequest, stream: bool) -> AsyncIterator[GenerateOutput]:
        rid, sid, s = request.request_id, request.session_id, request.sampling
        self._active[rid] = sid
        out: PDOutput | None = None
        path: PDPath  # route() picks pd/decode_only; a failed prefill turns it into local_fallback
        try:
            path, pool, prefill = self.route(request)
            if path == "pd" and prefill is not None:
                first = GenerateRequest(
                    rid,
                    request.prompt_ids,
                    s.model_copy(update={"max_tokens": 1}),
                    session_id=f"{sid}{_PREFILL_SESSION}" if sid else None,
                    task=request.task,
                    prompt_logprobs=request.prompt_logprobs,
                )
                try:
                    pre = await self._views[prefill].generate(first)
                except WorkerUnavailableError as exc:  # every prefill worker failed: prefill where we decode
                    log.warning(
                        "request %s: prefill pool %r unavailable (%s); local prefill on %r",
                        rid,
                        prefill,
                        exc,
                        pool,
                    )
                    path = "local_fallback"
                else:
                    pre_version = pre.versions[0] if pre.versions else None
                    if rid in self._aborted:  # aborted between prefill and decode
                        pre.finish_reason = "abort"
                    if pre.finish_reason != "length":  # ended at its first token (stop/EOS), or aborted
                        out = _as_pd(pre, "pd", pre.worker, pre_version)
                    else:
                        if stream:
                            yield GenerateOutput(
                                rid, pre.token_ids, pre.logprobs, pre.versions, "", pre.worker
                            )
                        rest = GenerateRequest(
                            rid,
                            [*request.prompt_ids, *pre.token_ids],
                            s.model_copy(update={"max_tokens": s.max_tokens - 1}),
                            session_id=sid,
                            task=request.task,
                        )
                        async for dec in self._sub(pool, rest, stream):
                            if not dec.finish_reason:
                                yield dec
                                continue
                            out = PDOutput(
                                rid,
                                pre.token_ids + dec.token_ids,
                                pre.logprobs + dec.logprobs,
                                pre.versions + dec.versions,
                                dec.finish_reason,
                                dec.worker,
                                pre.prompt_logprobs,
                                "pd",
                                pre.worker,
                                pre_version,
                            )
            if out is None:
                async for o in self._sub(pool, request, stream):
                    if not o.finish_reason:
                        yield o
                        continue
                    out = _as_pd(o, "local_fallback" if path == "local_fallback" else "decode_only")
        finally:
            self._active.pop(rid, None)
            self._aborted.discard(rid)
        if out is None:
            raise WorkerUnavailableError(f"request {rid} ended without a complete output")
        self.paths[out.pd_path] += 1
        if out.mixed_versions:
            self.mixed_version_requests += 1
            log.info(
                "request %s: prefill at version %s, decode at %s", rid, out.prefill_version, out.versions[1:2]
            )
        if sid:
            self._held[sid] = [*request.prompt_ids, *out.token_ids]
            self._held.move_to_end(sid)
            while len(self._held) > self.proxy.max_sessions:
                self._held.popitem(last=False)
        yield out

    async def _sub(self, pool: str, request: GenerateRequest, stream: bool) -> AsyncIterator[GenerateOutput]:
        view = self._views[pool]
        if stream:
            async for o in view.generate_stream(request):
                yield o
        else:
            yield await view.generate(request)

    async def abort(self, request_id: str) -> int:
        """Abort a request (by id) or a trajectory's in-flight requests (by session id), in
        whichever phase they are; a request aborted after its prefill is not decoded."""
        ids = [r for r, s in self._active.items() if request_id in (r, s)]
        self._aborted.update(ids)
        n = 0
        for view in self._views.values():
            n += await view.abort(request_id)
            n += await view.abort(f"{request_id}{_PREFILL_SESSION}")
        return max(n, len(ids))

    def end_session(self, session_id: str) -> None:
        self._held.pop(session_id, None)
        for view in self._views.values():
            view.end_session(session_id)
            view.end_session(f"{session_id}{_PREFILL_SESSION}")

    def session_worker(self, session_id: str) -> str | None:
        """The decode worker holding the trajectory's history."""
        for view in self._views.values():
            if (name := view.session_worker(session_id)) is not None:
                return name
        return None

    # suspend / update / resume across both pools ---------------------------------------------

    @property
    def suspended(self) -> bool:
        return self.proxy.suspended

    async def pause(self, mode: PauseMode = "keep") -> None:
        await self.proxy.pause(mode)

    async def suspend(self) -> None:
        await self.proxy.suspend()

    async def resume(self) -> None:
        await self.proxy.resume()

    async def prefetch_weights(self, version: int) -> None:
        """Both pools prepare ``version`` while generating (see :meth:`LLMProxy.prefetch_weights`)."""
        await self.proxy.prefetch_weights(version)

    async def update_weights(self, version: int) -> dict[str, float]:
        """Suspend both pools → every worker loads ``version`` → check each reports it → clear the
        shared KV store → resume (unless the caller had suspended). Returns each worker's pause.

        Raises :class:`WeightSyncError` (workers stay suspended) if a worker reports another version.
        """
        own = not self.proxy.suspended
        if own:
            await self.proxy.prefetch_weights(version)  # pull and stage while both pools generate
            await self.proxy.suspend()
        pauses = await self.proxy.update_weights(version)
        versions = await self.proxy.weight_versions()
        off = {n: v for n, v in versions.items() if v != version}
        if off:
            raise WeightSyncError(
                f"after the update to version {version} these workers report other versions: "
                f"{off}; generation stays suspended"
            )
        self.version = version
        self.clear_kv_store()
        self._held.clear()  # the update reset every prefix cache
        if own:
            await self.proxy.resume()
        return pauses

    def clear_kv_store(self) -> None:
        """Delete the KV a shared-storage connector wrote (call only while suspended)."""
        d = self.config.kv_store_dir
        if d is None or not d.exists():
            return
        for entry in d.iterdir():
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=False)
            else:
                entry.unlink()
        self.kv_store_clears += 1

    async def weight_versions(self) -> dict[str, int]:
        return await self.proxy.weight_versions()

    async def check_health(self, timeout: float = 10.0) -> int:
        """Probe unhealthy prefill and decode workers; one that comes back (a restarted actor is
        started first) is updated to the served version before it serves (:meth:`LLMProxy.check_health`)."""
        return await self.proxy.check_health(timeout)

    def start_health_loop(self, period_s: float | None = None) -> None:
        """The proxy's health loop, over both pools (:meth:`LLMProxy.start_health_loop`)."""
        self.proxy.start_health_loop(period_s)

    async def stop_health_loop(self) -> None:
        await self.proxy.stop_health_loop()

    def session_counts(self) -> dict[str, int]:
        """Sizes of the per-session tables of the proxy, of each pool's routing view, and of the router."""
        out = {
            "held_sessions": len(self._held),
            "active_requests": len(self._active),
            **self.proxy.session_counts(),
        }
        for pool, view in self._views.items():
            out.update({f"{pool}.{k}": v for k, v in view.session_counts().items()})
        return out

    async def metrics(self, engine_stats: bool = True, timeout: float = 5.0) -> dict[str, dict[str, Any]]:
        """The proxy's per-worker metrics (with each worker's PD role) plus ``pd``: turns per path."""
        out = await self.proxy.metrics(engine_stats, timeout)
        prefill = set(self.config.pools.values())
        for m in out.values():
            m["pd_role"] = "prefill" if m["pool"] in prefill else "decode"
        out["pd"] = {
            "paths": dict(self.paths),
            "mixed_version_requests": self.mixed_version_requests,
            "kv_store_clears": self.kv_store_clears,
            "version": self.version,
            "policies": {t: self.policy_of(t) for t in self._policy},
        }
        return out


def _as_pd(
    out: GenerateOutput, path: PDPath, prefill_worker: str | None = None, prefill_version: int | None = None
) -> PDOutput:
    return PDOutput(
        out.request_id,
        out.token_ids,
        out.logprobs,
        out.versions,
        out.finish_reason,
        out.worker,
        out.prompt_logprobs,
        path,
        prefill_worker,
        prefill_version,
    )
