"""VllmServerEngine: an already running vLLM OpenAI server, over HTTP, token-in/token-out.

Start the server with the endpoints this engine uses::

    VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model <dir> \\
        --host 127.0.0.1 --port 8000 --enable-scale-out

Endpoints (vLLM 0.32):

- ``POST /inference/v1/generate`` (``--enable-scale-out``): token ids in; token ids, logprobs and
  the weight-version spans of the output out;
- ``POST /inference/v1/abort_requests``: cancel requests by id;
- ``POST /pause?mode=keep`` / ``POST /resume`` (``VLLM_SERVER_DEV_MODE=1``): suspend with
  in-flight requests kept, and continue;
- ``POST /collective_rpc`` with ``reload_weights(weights_path=...)``: reload the weights in place
  from a directory of safetensors; ``POST /reset_prefix_cache?reset_running_requests=true``:
  recompute the KV of in-flight requests under the new weights; ``POST /update_weight_version``:
  label the tokens generated from now on (all dev mode).

A weight update is pause(keep) → reload → reset prefix cache (running requests re-prefill) →
version label → resume: no request is aborted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx

from rollart_core.errors import EngineError
from rollart_core.protocols import PauseMode
from rollart_core.types import GenerateOutput, GenerateRequest
from rollart_proxy.engines._common import check_stop_strings, count_update
from rollart_proxy.engines._http_engine import HttpEngineBase, HttpEngineConfig
from rollart_proxy.errors import WorkerUnavailableError

__all__ = ["VllmServerEngine", "VllmServerEngineConfig"]

log = logging.getLogger(__name__)


class VllmServerEngineConfig(HttpEngineConfig):
    pass


class VllmServerEngine(HttpEngineBase):
    """One running vLLM server as an :class:`~rollart_core.protocols.InferenceEngine`."""

    Config = VllmServerEngineConfig

    def __init__(self, config: VllmServerEngineConfig | None = None, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self._lock = asyncio.Lock()
        self.max_model_len: int | None = None
        self._frozen = False
        """The server's scheduler is paused (by :meth:`pause` or inside an update): aborts are deferred."""
        self._deferred_aborts: set[str] = set()

    async def start(self) -> str:
        models = await self._get("/v1/models")
        data = (models or {}).get("data") or []
        if not data:
            raise EngineError(f"{self.name}: server lists no model")
        if self.config.model is None:
            self.config = self.config.model_copy(update={"model": data[0]["id"]})
        self.max_model_len = data[0].get("max_model_len")
        await self._post("/update_weight_version", json_body={"new_version": str(self._version)})
        return self.name

    # generation ------------------------------------------------------------------------------

    def _sampling(self, request: GenerateRequest) -> dict[str, Any]:
        s = request.sampling
        check_stop_strings(s.stop)
        sp: dict[str, Any] = {
            "max_tokens": s.max_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "top_k": s.top_k,
            "logprobs": 0,
            "detokenize": bool(s.stop),
        }
        if s.stop:
            sp["stop"] = list(s.stop)
        if s.stop_token_ids:
            sp["stop_token_ids"] = list(s.stop_token_ids)
        if s.allowed_token_ids:
            sp["allowed_token_ids"] = list(s.allowed_token_ids)
        if s.seed is not None:
            sp["seed"] = s.seed
        if request.prompt_logprobs:
            sp["prompt_logprobs"] = 0
        return sp

    def _body(self, request: GenerateRequest, stream: bool) -> dict[str, Any]:
        if not request.prompt_ids:
            raise EngineError("empty prompt")
        if self.max_model_len is not None and len(request.prompt_ids) + 1 > self.max_model_len:
            raise EngineError(
                f"prompt of {len(request.prompt_ids)} tokens exceeds max_model_len {self.max_model_len}"
            )
        body = {
            "request_id": request.request_id,
            "token_ids": list(request.prompt_ids),
            "sampling_params": self._sampling(request),
            "model": self.config.model,
            "stream": stream,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    async def generate_stream(self, request: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        """Server-sent token deltas of ``/inference/v1/generate`` (``stream: true``), then the
        complete output (see ``SupportsStream``). Closing early aborts the request on the server."""
        body = self._body(request, stream=True)
        rid = request.request_id
        ids: list[int] = []
        lps: list[float] = []
        spans: list[dict[str, Any]] = []
        finish: str | None = None
        usage: dict[str, Any] = {}
        self._inflight.add(rid)
        try:
            try:
                async with self.client().stream("POST", "/inference/v1/generate", json=body) as r:
                    if r.status_code >= 400:
                        await r.aread()
                        self._check(r, "POST /inference/v1/generate")
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            raise EngineError(f"{self.name}: request {rid} failed: {chunk['error']}")
                        usage = chunk.get("usage") or usage
                        for c in chunk.get("choices") or []:
                            new = list(c.get("token_ids") or [])
                            new_lps = [
                                float(x["logprob"]) for x in ((c.get("logprobs") or {}).get("content") or [])
                            ]
                            if len(new_lps) != len(new):
                                raise EngineError(
                                    f"{self.name}: chunk of {len(new)} tokens with {len(new_lps)} logprobs"
                                )
                            ids += new
                            lps += new_lps
                            # vLLM sends the spans once, on the finishing chunk, over the whole output
                            spans = c.get("weight_versions") or spans
                            finish = c.get("finish_reason") or finish
                            if new and not finish:
                                yield GenerateOutput(
                                    rid, new, new_lps, [self._version] * len(new), "", self.name
                                )
            except httpx.HTTPError as exc:
                raise WorkerUnavailableError(f"{self.name}: stream of {rid} failed: {exc!r}") from None
        except BaseException:
            if finish is None:  # abandoned or broken mid-stream: free the server's slot
                try:
                    await asyncio.shield(self.abort(rid))
                except Exception as exc:  # the server may be gone: nothing left to free
                    log.debug("%s: abort of %s failed: %r", self.name, rid, exc)
            raise
        finally:
            self._inflight.discard(rid)
        if finish is None:
            raise WorkerUnavailableError(f"{self.name}: stream of {rid} ended without a finish reason")
        vers = _versions_from_spans(spans, len(ids)) or [self._version] * len(ids)
        cached = int(((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0)
        self._account(len(request.prompt_ids), cached, len(ids), finish)
        yield GenerateOutput(rid, ids, lps, vers, finish, self.name)

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        body = self._body(request, stream=False)
        self._inflight.add(request.request_id)
        try:
            resp = await self._post("/inference/v1/generate", json_body=body, control=False)
        finally:
            self._inflight.discard(request.request_id)
        choice = resp["choices"][0]
        ids = list(choice.get("token_ids") or [])
        content = ((choice.get("logprobs") or {}).get("content")) or []
        lps = [float(c["logprob"]) for c in content]
        if len(lps) != len(ids):
            raise EngineError(f"{self.name}: server returned {len(ids)} tokens but {len(lps)} logprobs")
        vers = _versions_from_spans(choice.get("weight_versions"), len(ids)) or [self._version] * len(ids)
        prompt_lps = None
        if request.prompt_logprobs and resp.get("prompt_logprobs") is not None:
            prompt_lps = [
                None if d is None else float(d[str(t)]["logprob"])
                for d, t in zip(resp["prompt_logprobs"], request.prompt_ids, strict=True)
            ]
        finish = choice.get("finish_reason") or "stop"
        usage = resp.get("usage") or {}
        cached = int(((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0)
        self._account(len(request.prompt_ids), cached, len(ids), finish)
        return GenerateOutput(request.request_id, ids, lps, vers, finish, self.name, prompt_lps)

    async def abort(self, request_id: str) -> None:
        if self._frozen:
            # vLLM 0.32 loses an abort that arrives while the scheduler is paused with mode "keep"
            # (it forgets the request id, and the frozen request later runs to completion): hold
            # it until the resume, which sends it first thing.
            self._deferred_aborts.add(request_id)
            return
        await self._abort([request_id])

    async def _abort(self, request_ids: list[str]) -> None:
        # The server prefixes the ids of token-in requests (``generate-tokens-<id>``).
        await self._post(
            "/inference/v1/abort_requests",
            json_body={"request_ids": [x for r in request_ids for x in (f"generate-tokens-{r}", r)]},
        )

    async def _unfreeze(self) -> None:
        """Resume the server's scheduler, then deliver the aborts that arrived while it was paused."""
        await self._post("/resume")
        self._frozen = False
        rids, self._deferred_aborts = sorted(self._deferred_aborts), set()
        if rids:
            await self._abort(rids)

    # suspend / update / resume ---------------------------------------------------------------

    async def pause(self, mode: PauseMode = "keep") -> None:
        self._frozen = True
        await self._post("/pause", params={"mode": mode, "clear_cache": "false"})
        self._paused = True
        self._metrics.suspend()

    async def resume(self) -> None:
        await self._unfreeze()
        self._paused = False
        self._metrics.unsuspend()

    async def update_weights(self, version: int) -> float:
        """Load ``version`` from its directory (see ``weights_path_template``) or the weight store."""
        async with self._lock:
            if version <= self._version:
                return 0.0
            path = await asyncio.to_thread(self.weights_path, version)
            return await self._load(version, path)

    async def update_weights_from_path(self, version: int, path: str) -> float:
        """Load a directory of safetensors (Hugging Face names) as ``version``."""
        async with self._lock:
            return await self._load(version, path)

    async def _load(self, version: int, path: str) -> float:
        t0 = time.perf_counter()
        own_pause = not self._paused
        if own_pause:
            self._frozen = True
            await self._post("/pause", params={"mode": "keep", "clear_cache": "false"})
        try:
            await self._post(
                "/collective_rpc", json_body={"method": "reload_weights", "kwargs": {"weights_path": path}}
            )
            await self._post("/reset_prefix_cache", params={"reset_running_requests": "true"})
            await self._post("/update_weight_version", json_body={"new_version": str(version)})
            self._version = version
        finally:
            if own_pause:
                await self._unfreeze()
        return count_update(self.stats, self._metrics, t0, own_pause)


def _versions_from_spans(spans: list[dict[str, Any]] | None, n: int) -> list[int] | None:
    if not spans or n == 0:
        return None
    out: list[int] = []
    for sp in spans:
        try:
            v = int(sp["version"])
        except (KeyError, ValueError, TypeError):
            return None
        out += [v] * (int(sp["end"]) - int(sp["start"]))
    return out if len(out) == n else None
