"""Weight updates of :class:`~rollart_proxy.engines.vllm_engine.VllmEngine` (:class:`VllmWeightUpdates`):
prefetch and staging while generating, the paused swap or in-place load, LoRA adapter switches, and
suspend/resume around them."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from rollart_core.errors import WeightSyncError
from rollart_core.protocols import PauseMode, WeightStore
from rollart_proxy.engines._common import count_update
from rollart_proxy.engines.vllm_config import VllmEngineConfig
from rollart_proxy.engines.vllm_lora import AdapterVersions, is_adapter
from rollart_proxy.metrics import WorkerMetrics

__all__ = ["VllmWeightUpdates"]

# the logger these records had before they moved out of vllm_engine: configuration by name holds
log = logging.getLogger("rollart_proxy.engines.vllm_engine")


class VllmWeightUpdates:
    """How :class:`~rollart_proxy.engines.vllm_engine.VllmEngine` suspends and loads new weights; it
    inherits this and sets these attributes."""

    name: str
    config: VllmEngineConfig
    stats: dict[str, float]
    _store: WeightStore | None
    _version: int
    _prefetch: dict[int, Future[dict[str, Any]]]
    _staging: tuple[int, asyncio.Task[tuple[list[Any], bool]]] | None
    _lock: asyncio.Lock
    _paused: bool
    _frozen: bool
    _deferred_aborts: set[str]
    _adapters: AdapterVersions | None
    _metrics: WorkerMetrics

    if TYPE_CHECKING:

        def _require_started(self) -> Any: ...

    async def _unfreeze(self) -> None:
        """Resume vLLM's scheduler, then deliver the aborts that arrived while it was paused."""
        engine = self._require_started()
        await engine.resume_generation()
        self._frozen = False
        rids, self._deferred_aborts = sorted(self._deferred_aborts), set()
        if rids:
            await engine.abort(rids)

    # suspend / update / resume ---------------------------------------------------------------

    async def pause(self, mode: PauseMode = "keep") -> None:
        self._frozen = True
        await self._require_started().pause_generation(mode=mode, clear_cache=False)
        self._paused = True
        self._metrics.suspend()

    async def resume(self) -> None:
        await self._unfreeze()
        self._paused = False
        self._metrics.unsuspend()

    def prefetch(self, version: int) -> None:
        """Start pulling ``version`` from the weight store in the background (no pause)."""
        if self._store is None:
            raise WeightSyncError(f"{self.name}: no weight store configured")
        pulled = self._prefetch.get(version)
        if pulled is not None and not (pulled.done() and pulled.exception() is not None):
            return  # pulling or pulled; a failed pull is retried, not kept
        fut: Future[dict[str, Any]] = Future()
        store = self._store

        def pull() -> None:
            try:
                fut.set_result(store.pull(version))
            except BaseException as exc:  # delivered to the waiter, not lost
                fut.set_exception(exc)

        threading.Thread(target=pull, name=f"prefetch-v{version}", daemon=True).start()
        self._prefetch[version] = fut

    @property
    def _limit(self) -> str:
        return f"update_stage_timeout_s={self.config.update_stage_timeout_s:g}"

    async def _within(self, step: Any, what: str, version: int) -> Any:
        """``step`` (an awaitable), or :class:`WeightSyncError` naming the engine and the stage."""
        try:
            return await asyncio.wait_for(step, self.config.update_stage_timeout_s)
        except TimeoutError:
            raise WeightSyncError(f"{self.name}: {what} version {version} took over {self._limit}") from None

    async def prefetch_weights(self, version: int) -> None:
        """Prepare ``version`` while generation goes on; returns when it is ready to swap in: pull it
        from the weight store and, with ``weight_update='staged'``, load it into the shadow model.
        :meth:`update_weights` then only swaps it in. Run it as a background task."""
        self._require_started()
        if version <= self._version:
            return
        staging = self._stage(version)
        if staging[0] == version:
            await asyncio.shield(staging[1])

    def _stage(self, version: int) -> tuple[int, asyncio.Task[tuple[list[Any], bool]]]:
        """The preparation in flight, started for ``version`` unless a newer one already is."""
        failed = (
            self._staging is not None
            and self._staging[1].done()
            and (self._staging[1].cancelled() or self._staging[1].exception() is not None)
        )
        if self._staging is None or self._staging[0] < version or failed:  # a failed preparation is redone
            self._staging = (
                version,
                asyncio.create_task(self._prepare(version), name=f"{self.name}-stage-v{version}"),
            )
        return self._staging

    async def _prepare(self, version: int, stage: bool = True) -> tuple[list[Any], bool]:
        """Pull and pack ``version``; stage it in the worker(s). Returns the packed tensors and whether
        they are staged (False: not asked to, in-place mode, or staging failed and was logged)."""
        from rollart_proxy.engines.vllm_worker import pack_tensors

        self.prefetch(version)
        pulled = asyncio.wrap_future(self._prefetch[version])
        try:
            tensors = await self._within(asyncio.shield(pulled), "pulling", version)
        except WeightSyncError:
            # a stuck pull is not waited for again: the next one starts anew
            self._prefetch.pop(version, None)
            pulled.add_done_callback(_dropped)
            raise
        if self.config.lora is not None or is_adapter(tensors):
            return [await self._prepare_adapter(version, tensors)], True
        named = await asyncio.to_thread(pack_tensors, tensors.items())
        if not stage or self.config.weight_update != "staged":
            return named, False
        engine = self._require_started()
        try:
            # The worker loads in a thread of its own; each RPC here returns at once, so the engine
            # loop keeps stepping between the polls.
            await self._within(
                engine.collective_rpc("rollart_stage_weights", args=(named, version)), "staging", version
            )
            deadline = time.monotonic() + self.config.update_stage_timeout_s
            while not all(await engine.collective_rpc("rollart_staged_ready", args=(version,))):
                if time.monotonic() > deadline:
                    raise WeightSyncError(f"{self.name}: staging version {version} took over {self._limit}")
                await asyncio.sleep(0.005)
        except Exception as exc:
            log.warning("%s: staging v%d failed, it will load in place: %r", self.name, version, exc)
            self.stats["staging_fallbacks"] += 1
            return named, False
        return named, True

    async def _prepare_adapter(self, version: int, tensors: dict[str, Any]) -> Any:
        """Write ``version``'s adapter directory and load it into vLLM's adapter cache while
        generation goes on; returns its ``LoRARequest``."""
        if self._adapters is None:
            raise WeightSyncError(
                f"{self.name}: version {version} is a LoRA adapter but the engine serves full "
                "weights: set the engine's lora option (and lora.max_lora_rank >= the trainer's rank)"
            )
        if not is_adapter(tensors):
            raise WeightSyncError(
                f"{self.name}: version {version} holds full weights but the engine serves LoRA "
                "adapters (its lora option is set): train with the trainer's lora, or drop the engine's"
            )
        lora_request = await asyncio.to_thread(self._adapters.write, version, tensors)
        await self._require_started().add_lora(lora_request)
        return lora_request

    async def _serve_adapter(self, version: int) -> None:
        """New requests carry ``version``'s adapter from now on; drop the older adapters no running
        request uses any more (their cache slots and directories)."""
        assert self._adapters is not None
        self._adapters.serve(version)
        engine = self._require_started()
        for old in self._adapters.unused():
            try:
                await engine.remove_lora(old)
            except Exception as exc:  # evicted already: only its directory is left
                log.debug("%s: remove_lora(%d): %r", self.name, old, exc)
            self._adapters.drop(old)

    async def update_weights(self, version: int) -> float:
        """Load ``version``: prepare it (usually already done by :meth:`prefetch_weights`), then
        pause-keep → swap in (or load in place) → re-prefill running requests → resume.

        Returns the seconds generation was paused.
        """
        engine = self._require_started()
        async with self._lock:
            if version <= self._version:
                return 0.0
            staged_version, task = self._stage(version)
            if staged_version != version:  # a newer version is being staged: load this one in place
                task = asyncio.create_task(self._prepare(version, stage=False))
            named, staged = await task
            if self._staging is not None and self._staging[0] == version:
                self._staging = None
            for v in [v for v in self._prefetch if v <= version]:
                self._prefetch.pop(v)
            t0 = time.perf_counter()
            if self._adapters is not None:
                # switching the adapter of new requests needs no pause: running ones keep theirs
                await self._serve_adapter(version)
                await engine.update_weight_version(str(version))
                self._version = version
                return count_update(self.stats, self._metrics, t0, own_pause=False)
            # Already suspended by the caller (suspend → update → resume): stay suspended.
            own_pause = not self._paused
            if own_pause:
                self._frozen = True
                await engine.pause_generation(mode="keep", clear_cache=False)
            try:
                if staged:
                    try:
                        stage_s = await self._within(
                            engine.collective_rpc("rollart_commit_staged", args=(version,)),
                            "swapping in",
                            version,
                        )
                        self.stats["staged_updates"] += 1
                        self.stats["stage_s"] += max(stage_s)
                    except WeightSyncError:
                        raise  # stuck: the engine's state is unknown (the proxy takes it out)
                    except Exception as exc:  # e.g. superseded by a newer staging: load this one in place
                        log.warning(
                            "%s: swapping in staged v%d failed, loading in place: %r", self.name, version, exc
                        )
                        self.stats["staging_fallbacks"] += 1
                        staged = False
                if not staged:
                    await self._within(
                        engine.collective_rpc("rollart_load_weights", args=(named,)), "loading", version
                    )
                # KV of running requests was computed by the old weights: recompute it.
                await engine.reset_prefix_cache(reset_running_requests=True)
                await engine.update_weight_version(str(version))
                self._version = version
            finally:
                if own_pause:
                    await self._unfreeze()
            return count_update(self.stats, self._metrics, t0, own_pause)


def _dropped(pulled: asyncio.Future[Any]) -> None:
    """The outcome of a pull given up on (it ended after its stage's bound): read, so that asyncio
    does not report it as never retrieved; the update it was for failed already."""
    if not pulled.cancelled() and pulled.exception() is not None:
        log.debug("a pull given up on ended with %r", pulled.exception())
