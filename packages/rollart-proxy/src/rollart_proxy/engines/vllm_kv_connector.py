"""A shared-storage KV connector for vLLM (loaded by vLLM through ``kv_connector_module_path``).

vLLM's ``ExampleConnector`` moves a prompt's KV through a directory, keyed by the prompt's tokens
aligned down to whole KV blocks. In vLLM 0.32 it looks a request of ``n`` prompt tokens up by
``n - 1`` tokens but loads it by ``n``: when ``n - 1`` is a multiple of the block size the two keys
differ, the load finds no file and the engine dies (``FileNotFoundError`` in the worker). For a
decode worker continuing ``prompt + first token`` that is every prompt whose length is a multiple
of the block size. This subclass reports a miss in that case: the request is prefilled locally
(correct output, no transfer for that request). Everything else is ``ExampleConnector``'s.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector

__all__ = ["SharedStorageConnector"]


class SharedStorageConnector(ExampleConnector):
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        n = len(request.prompt_token_ids or ())
        if n < 2 or (n - 1) % self._block_size == 0:  # lookup and load keys would differ: prefill locally
            return 0, False
        return super().get_num_new_matched_tokens(request, num_computed_tokens)
