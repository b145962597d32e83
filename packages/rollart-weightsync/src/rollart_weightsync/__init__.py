"""rollart-weightsync: versioned weight stores (trainer pushes asynchronously, workers pull).

Public API:

Stores (all implement ``rollart_core.protocols.WeightStore``):
- :class:`MooncakeWeightStore` — Mooncake distributed store: bucketed, checksummed, atomic commit
- :class:`RayWeightStore` — Ray object store indexed by a named actor
- :class:`FilesystemWeightStore` — safetensors per version, atomic rename, checksums
- :class:`MemoryWeightStore` — in-process
- :class:`NodeCacheWeightStore` — wraps any of them: one pull per node, shared by its engines
Serving: :class:`MooncakeStoreServer` (``rollart-weightsync serve``)
Sender: :func:`full_state`, :func:`push_model` (FSDP2/DTensor gather, Megatron name mapping)
Receivers: vLLM's lives in ``rollart_proxy.VllmEngine``; :class:`SglangWeightReceiver`

Heavy back-ends (torch, mooncake, ray) are imported only when used.
"""

from __future__ import annotations

from rollart_weightsync.filesystem import FilesystemWeightStore, FilesystemWeightStoreConfig
from rollart_weightsync.memory import MemoryWeightStore, MemoryWeightStoreConfig
from rollart_weightsync.mooncake import MooncakeWeightStore, MooncakeWeightStoreConfig
from rollart_weightsync.mooncake_server import MooncakeServerConfig, MooncakeStoreServer
from rollart_weightsync.node_cache import NodeCacheWeightStore, NodeCacheWeightStoreConfig
from rollart_weightsync.ray_store import RayWeightStore, RayWeightStoreConfig
from rollart_weightsync.sender import full_state, iter_full_tensors, push_model, rename
from rollart_weightsync.sglang import SglangWeightReceiver, SglangWeightReceiverConfig

__all__ = [
    # stores
    "FilesystemWeightStore",
    "FilesystemWeightStoreConfig",
    "MemoryWeightStore",
    "MemoryWeightStoreConfig",
    # serving
    "MooncakeServerConfig",
    "MooncakeStoreServer",
    "MooncakeWeightStore",
    "MooncakeWeightStoreConfig",
    "NodeCacheWeightStore",
    "NodeCacheWeightStoreConfig",
    "RayWeightStore",
    "RayWeightStoreConfig",
    # sender / receivers
    "SglangWeightReceiver",
    "SglangWeightReceiverConfig",
    "full_state",
    "iter_full_tensors",
    "push_model",
    "rename",
]
