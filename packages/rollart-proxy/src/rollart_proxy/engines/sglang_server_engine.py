"""SglangServerEngine: an already running SGLang server, over HTTP, token-in/token-out.

NOT YET RUN AGAINST A LIVE SGLANG SERVER: SGLang does not run on the CPU machines this project is
developed on. Written against SGLang's HTTP API (``sglang/srt/entrypoints/http_server.py`` and
``managers/io_struct.py``), parallel to :class:`~rollart_proxy.engines.vllm_server_engine.VllmServerEngine`:

- ``POST /generate`` ``{"rid", "input_ids", "sampling_params", "return_logprob": true, "stream": true}``;
  each SSE chunk carries ``meta_info`` with ``output_token_logprobs`` (``[logprob, token_id, text]``),
  ``finish_reason`` (``{"type": "stop"|"length"|"abort", ...}``) and ``weight_version``;
- ``POST /abort_request`` ``{"rid"}``;
- ``POST /pause_generation`` ``{"mode": "retract"}`` (running requests go back to the waiting
  queue; their KV is recomputed after ``/continue_generation``) and ``POST /continue_generation``;
- ``POST /update_weights_from_disk`` ``{"model_path", "weight_version", "abort_all_requests": false}``,
  plus thin pass-throughs for ``/update_weights_from_tensor`` and ``/update_weights_from_distributed``.

``allowed_token_ids`` has no SGLang sampling parameter: it is mapped to a ``logit_bias`` of +100 on
the allowed ids (other tokens keep probability ~e^-100 at temperature 1).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import httpx

from rollart_core.errors import EngineError
from rollart_core.protocols import PauseMode
from rollart_core.types import GenerateOutput, GenerateRequest
from rollart_proxy.engines._common import check_stop_strings, count_update
from rollart_proxy.engines._http_engine import HttpEngineBase, HttpEngineConfig
from rollart_proxy.errors import WorkerUnavailableError

__all__ = ["SglangServerEngine", "SglangServerEngineConfig"]

log = logging.getLogger(__name__)
_PAUSE_MODES = {"keep": "retract", "wait": "in_place", "abort": "abort"}
_ALLOWED_BIAS = 100.0


class SglangServerEngineConfig(HttpEngineConfig):
    pass


class SglangServerEngine(HttpEngineBase):
    """One running SGLang server as an :class:`~rollart_core.protocols.InferenceEngine`."""

    Config = SglangServerEngineConfig

    def __init__(self, config: SglangServerEngineConfig | None = None, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self._lock = asyncio.Lock()

    async def start(self) -> str:
        info = await self._get("/get_model_info")
        if self.config.model is None and isinstance(info, dict):
            self.config = self.config.model_copy(update={"model": info.get("model_path")})
        await self._post("/update_weight_version", json_body={"new_version": str(self._version)})
        return self.name

    def _sampling(self, request: GenerateRequest) -> dict[str, Any]:
        s = request.sampling
        check_stop_strings(s.stop)
        sp: dict[str, Any] = {
            "max_new_tokens": s.max_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "top_k": s.top_k,
        }
        if s.stop:
            sp["stop"] = list(s.stop)
        if s.stop_token_ids:
            sp["stop_token_ids"] = list(s.stop_token_ids)
        if s.allowed_token_ids:
            sp["logit_bias"] = {str(t): _ALLOWED_BIAS for t in s.allowed_token_ids}
        if s.seed is not None:
            sp["sampling_seed"] = s.seed
        return sp

    async def generate(self, request: GenerateRequest, extra: dict[str, Any] | None = None) -> GenerateOutput:
        """``extra``: more top-level ``/generate`` fields (e.g. the PD bootstrap fields, see
        :mod:`rollart_proxy.sglang_pd`)."""
        if not request.prompt_ids:
            raise EngineError("empty prompt")
        body = {
            "rid": request.request_id,
            "input_ids": list(request.prompt_ids),
            "sampling_params": self._sampling(request),
            "return_logprob": True,
            "stream": True,
            **(extra or {}),
        }
        ids: list[int] = []
        lps: list[float] = []
        vers: list[int] = []
        finish = "abort"
        cached = 0
        self._inflight.add(request.request_id)
        try:
            async with self.client().stream(
                "POST", "/generate", json=body, timeout=self.config.request_timeout_s
            ) as r:
                if r.status_code >= 400:
                    await r.aread()
                    self._check(r, "POST /generate")
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        raise EngineError(f"{self.name}: {chunk['error'].get('message', chunk['error'])}")
                    meta = chunk.get("meta_info") or {}
                    new = self._new_tokens(meta, len(ids))
                    version = _int_or(meta.get("weight_version"), self._version)
                    ids += [int(t) for _, t, *_ in new]
                    lps += [float(lp) for lp, *_ in new]
                    vers += [version] * len(new)
                    cached = int(meta.get("cached_tokens") or cached)
                    fr = meta.get("finish_reason")
                    if fr:
                        finish = fr.get("type", "stop") if isinstance(fr, dict) else str(fr)
        except httpx.HTTPError as exc:
            raise WorkerUnavailableError(f"{self.name}: /generate failed: {exc!r}") from None
        finally:
            self._inflight.discard(request.request_id)
        self._account(len(request.prompt_ids), cached, len(ids), finish)
        return GenerateOutput(request.request_id, ids, lps, vers, finish, self.name, None)

    @staticmethod
    def _new_tokens(meta: dict[str, Any], have: int) -> list[list[Any]]:
        """Tokens of this chunk not yet seen: chunks are cumulative unless the server streams
        incrementally (``--incremental-streaming-output``); ``completion_tokens`` tells which."""
        got = meta.get("output_token_logprobs") or []
        total = int(meta.get("completion_tokens", have + len(got)))
        return got[have:] if len(got) == total else got

    async def bootstrap_port(self) -> int:
        """A prefill server's KV bootstrap port (``--disaggregation-bootstrap-port``), from
        ``/get_server_info``."""
        info = await self._get("/get_server_info")
        port = (info or {}).get("disaggregation_bootstrap_port") if isinstance(info, dict) else None
        if port is None:
            raise EngineError(
                f"{self.name}: /get_server_info has no disaggregation_bootstrap_port "
                "(is it started with --disaggregation-mode prefill?)"
            )
        return int(port)

    async def abort(self, request_id: str) -> None:
        await self._post("/abort_request", json_body={"rid": request_id})

    async def pause(self, mode: PauseMode = "keep") -> None:
        await self._post("/pause_generation", json_body={"mode": _PAUSE_MODES[mode]})
        self._paused = True
        self._metrics.suspend()

    async def resume(self) -> None:
        await self._post("/continue_generation", json_body={})
        self._paused = False
        self._metrics.unsuspend()

    async def update_weights(self, version: int) -> float:
        """Retract in-flight requests, load ``version`` from disk, continue (KV recomputed)."""
        async with self._lock:
            if version <= self._version:
                return 0.0
            path = await asyncio.to_thread(self.weights_path, version)
            return await self._with_retract(
                version, "/update_weights_from_disk", {"model_path": path, "abort_all_requests": False}
            )

    async def update_weights_from_tensor(self, version: int, body: dict[str, Any]) -> float:
        """Pass-through to ``/update_weights_from_tensor`` (``serialized_named_tensors`` etc.)."""
        async with self._lock:
            return await self._with_retract(version, "/update_weights_from_tensor", body)

    async def update_weights_from_distributed(self, version: int, body: dict[str, Any]) -> float:
        """Pass-through to ``/update_weights_from_distributed`` (``names``, ``dtypes``, ``shapes``,
        ``group_name``; the NCCL group set up with ``/init_weights_update_group``)."""
        async with self._lock:
            return await self._with_retract(version, "/update_weights_from_distributed", body)

    async def _with_retract(self, version: int, path: str, body: dict[str, Any]) -> float:
        t0 = time.perf_counter()
        own_pause = not self._paused
        if own_pause:
            await self._post("/pause_generation", json_body={"mode": "retract"})
        try:
            out = await self._post(path, json_body={**body, "weight_version": str(version)})
            if isinstance(out, dict) and out.get("success") is False:
                raise EngineError(f"{self.name}: {path} failed: {out.get('message')}")
            self._version = version
        finally:
            if own_pause:
                await self._post("/continue_generation", json_body={})
        return count_update(self.stats, self._metrics, t0, own_pause)


def _int_or(v: Any, default: int) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return default
