"""Sender side: a trainer's parameters as full tensors with Hugging Face names.

``full_state(model)`` gathers FSDP2/TP-sharded parameters (``DTensor.full_tensor()``, a collective:
call it on every rank) and strips wrapper prefixes. A Megatron (or any other) trainer passes a
``name_mapper`` that turns its names and layouts into Hugging Face ones, e.g. splitting a fused
``linear_qkv`` into ``q_proj``/``k_proj``/``v_proj``::

    def megatron_to_hf(name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        ...  # yield (hf_name, hf_tensor) pairs; yield nothing to drop a tensor

    store.push(version, full_state(model, name_mapper=megatron_to_hf))
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from rollart_core.errors import WeightSyncError
from rollart_weightsync._common import full_tensor

if TYPE_CHECKING:
    import torch

    from rollart_core.protocols import WeightStore

__all__ = ["NameMapper", "full_state", "iter_full_tensors", "push_model", "rename"]

NameMapper = Callable[[str, "torch.Tensor"], Iterable[tuple[str, "torch.Tensor"]]]
"""(trainer name, full tensor) -> zero or more (Hugging Face name, tensor)."""

# Prefixes that wrappers add to parameter names (torch.compile, DDP/FSDP1, activation checkpointing).
_WRAPPER_PREFIXES = ("_orig_mod.", "module.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


def rename(fn: Callable[[str], str | None]) -> NameMapper:
    """A :data:`NameMapper` from a name-only function (None drops the tensor)."""

    def mapper(name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        new = fn(name)
        return [] if new is None else [(new, tensor)]

    return mapper


def _clean(name: str) -> str:
    changed = True
    while changed:
        changed = False
        for p in _WRAPPER_PREFIXES:
            if p in name:
                name = name.replace(p, "")
                changed = True
    return name


def iter_full_tensors(
    source: Any, name_mapper: NameMapper | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, full tensor) from a module (its ``state_dict()``) or (name, tensor) pairs.

    Sharded DTensors are gathered one at a time, so peak extra memory is one full tensor.
    """
    items = (
        source.state_dict().items()
        if hasattr(source, "state_dict")
        else (source.items() if hasattr(source, "items") else source)
    )
    seen: set[str] = set()
    for name, t in items:
        full = full_tensor(t).detach()
        pairs = name_mapper(_clean(name), full) if name_mapper else [(_clean(name), full)]
        for out_name, out in pairs:
            if out_name in seen:
                raise WeightSyncError(f"two tensors map to the name {out_name!r}")
            seen.add(out_name)
            yield out_name, out


def full_state(source: Any, name_mapper: NameMapper | None = None) -> dict[str, torch.Tensor]:
    """:func:`iter_full_tensors` as a dict (what ``WeightStore.push`` takes)."""
    return dict(iter_full_tensors(source, name_mapper))


def push_model(
    store: WeightStore,
    version: int,
    source: Any,
    *,
    name_mapper: NameMapper | None = None,
    rank: int | None = None,
) -> Future[None] | None:
    """Gather on every rank; push from rank 0 only (``rank`` defaults to torch.distributed's)."""
    state = full_state(source, name_mapper)
    if rank is None:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return store.push(version, state) if rank == 0 else None
