"""rollart-weightsync: versioned weight stores (trainer pushes asynchronously, workers pull).

Public API:
- :class:`FilesystemWeightStore` — safetensors per version, atomic commit, checksums
- :class:`MemoryWeightStore` — in-process
"""

from rollart_weightsync.filesystem import FilesystemWeightStore, FilesystemWeightStoreConfig
from rollart_weightsync.memory import MemoryWeightStore, MemoryWeightStoreConfig

__all__ = ["FilesystemWeightStore", "FilesystemWeightStoreConfig", "MemoryWeightStore", "MemoryWeightStoreConfig"]
