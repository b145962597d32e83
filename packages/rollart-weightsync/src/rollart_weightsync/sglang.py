"""SglangWeightReceiver: pull a version from a weight store and load it into a running SGLang server.

Written against SGLang's HTTP API (``/pause_generation``, ``/update_weights_from_tensor``,
``/continue_generation``) and its ``MultiprocessingSerializer``; NOT yet run against a live server
(SGLang's engine does not run on the CPU machines this package is tested on).

The pull happens in the background (:meth:`prefetch`) while the server keeps generating; the
critical section only moves tensors to the GPU, hands SGLang CUDA IPC handles (the receiver must
run on the server's node, one request per chunk), and resumes. ``pause_generation`` with mode
``retract`` keeps in-flight requests and recomputes their KV under the new weights.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rollart_core.errors import WeightSyncError
from rollart_core.extras import require

if TYPE_CHECKING:
    import torch

    from rollart_core.protocols import WeightStore

__all__ = ["SglangWeightReceiver", "SglangWeightReceiverConfig"]


class SglangWeightReceiverConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    base_url: str = "http://127.0.0.1:30000"
    """The SGLang server (``python -m sglang.launch_server``)."""
    api_key: str | None = None
    """Sent as a bearer token when the server was started with ``--api-key``."""
    tp_size: int = Field(1, ge=1)
    """Tensor-parallel ranks of the server: one serialized payload per rank."""
    device: str = "cuda"
    """Where tensors are placed before their IPC handles are sent (the server's GPUs)."""
    chunk_bytes: int = Field(512 << 20, ge=1 << 20)
    """Bytes of weights per ``update_weights_from_tensor`` request."""
    pause_mode: Literal["retract", "in_place", "abort"] = "retract"
    """``retract`` keeps in-flight requests and re-prefills them under the new weights."""
    timeout_s: float = Field(600.0, gt=0)


class SglangWeightReceiver:
    Config = SglangWeightReceiverConfig

    def __init__(
        self, config: SglangWeightReceiverConfig | None = None, *, weight_store: WeightStore
    ) -> None:
        self.config = config or SglangWeightReceiverConfig()
        self._store = weight_store
        self._prefetch: dict[int, Future[dict[str, Any]]] = {}
        self.version = 0

    def prefetch(self, version: int) -> None:
        if version in self._prefetch:
            return
        fut: Future[dict[str, Any]] = Future()

        def pull() -> None:
            try:
                fut.set_result(self._store.pull(version))
            except BaseException as exc:
                fut.set_exception(exc)

        threading.Thread(target=pull, name=f"sglang-prefetch-v{version}", daemon=True).start()
        self._prefetch[version] = fut

    def _chunks(self, tensors: Mapping[str, torch.Tensor]) -> list[list[tuple[str, torch.Tensor]]]:
        chunks: list[list[tuple[str, torch.Tensor]]] = [[]]
        size = 0
        for name, t in tensors.items():
            n = t.numel() * t.element_size()
            if chunks[-1] and size + n > self.config.chunk_bytes:
                chunks.append([])
                size = 0
            chunks[-1].append((name, t))
            size += n
        return chunks

    async def update_weights(self, version: int) -> float:
        """Load ``version`` (prefetched if :meth:`prefetch` was called); returns seconds paused."""
        httpx = require("httpx", "pip install httpx")
        utils = require("sglang.srt.utils", "pip install 'rollart-proxy[sglang]'")
        if version <= self.version:
            return 0.0
        self.prefetch(version)
        tensors = await asyncio.wrap_future(self._prefetch.pop(version))
        for v in [v for v in self._prefetch if v < version]:
            self._prefetch.pop(v)
        c = self.config
        headers = {"Authorization": f"Bearer {c.api_key}"} if c.api_key else {}
        chunks = self._chunks(tensors)
        async with httpx.AsyncClient(base_url=c.base_url, timeout=c.timeout_s, headers=headers) as client:
            t0 = time.perf_counter()
            await self._post(client, "/pause_generation", {"mode": c.pause_mode})
            try:
                for i, chunk in enumerate(chunks):
                    on_device = [(n, t.to(c.device, non_blocking=True)) for n, t in chunk]
                    payload = utils.MultiprocessingSerializer.serialize(on_device, output_str=True)
                    await self._post(
                        client,
                        "/update_weights_from_tensor",
                        {
                            "serialized_named_tensors": [payload] * c.tp_size,
                            "load_format": None,
                            "flush_cache": i == len(chunks) - 1,
                            "weight_version": str(version),
                        },
                    )
                    del on_device  # the server has copied them into its parameters
            finally:
                await self._post(client, "/continue_generation", {})
            paused = time.perf_counter() - t0
        self.version = version
        return paused

    @staticmethod
    async def _post(client: Any, path: str, body: dict[str, Any]) -> None:
        r = await client.post(path, json=body)
        if r.status_code != 200:
            raise WeightSyncError(f"SGLang {path} failed ({r.status_code}): {r.text[:500]}")
        data = r.json() if r.content else {}
        if isinstance(data, dict) and data.get("success") is False:
            raise WeightSyncError(f"SGLang {path} failed: {data.get('message')}")
