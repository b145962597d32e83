"""Worker-side extension mixed into vLLM's GPU/CPU worker (``worker_extension_cls``).

These methods run inside the engine's worker process and are called through
``AsyncLLM.collective_rpc("<name>", args=...)`` with plain, serialisable arguments.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable, Iterator
from typing import Any

import torch

__all__ = ["RollartWorkerExtension", "pack_tensors", "unpack_tensors"]


def pack_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, list[int], str, bytes]]:
    out = []
    for name, t in named:
        t = t.detach().to("cpu").contiguous()
        out.append(
            (
                name,
                list(t.shape),
                str(t.dtype).removeprefix("torch."),
                t.reshape(-1).view(torch.uint8).numpy().tobytes(),
            )
        )
    return out


def unpack_tensors(packed: Iterable[tuple[str, list[int], str, bytes]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, shape, dtype, raw in packed:
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(getattr(torch, dtype))
        yield name, flat.reshape(shape)


class RollartWorkerExtension:
    """Mixed into ``vllm.v1.worker.*.Worker``: ``self.model_runner`` is the worker's runner."""

    model_runner: Any

    def rollart_load_weights(self, packed: list[tuple[str, list[int], str, bytes]]) -> int:
        """Load checkpoint-format (Hugging Face named) tensors in place; returns how many.

        Tensors arrive as raw bytes (see :func:`pack_tensors`): vLLM's utility-call encoding
        does not carry tensors.
        """
        self.model_runner.reload_weights(weights_iterator=unpack_tensors(packed), is_checkpoint_format=True)
        return len(packed)

    def rollart_stage_weights(self, packed: list[tuple[str, list[int], str, bytes]], tag: int) -> None:
        """Start loading ``packed`` into the shadow model in a background thread; returns at once.

        Generation goes on meanwhile; :meth:`rollart_commit_staged` swaps the result in.
        """
        from rollart_proxy.engines.vllm_staging import WeightStager

        stager = self.__dict__.setdefault("_rollart_stager", WeightStager())
        runner = self.model_runner
        stager.start(runner.vllm_config, runner.get_model(), list(unpack_tensors(packed)), tag)

    def rollart_staged_ready(self, tag: int) -> bool:
        """Non-blocking: whether ``tag`` is staged (raises if staging failed)."""
        stager = self.__dict__.get("_rollart_stager")
        return stager is not None and stager.ready(tag)

    def rollart_commit_staged(self, tag: int) -> float:
        """Swap the staged weights in (call while generation is paused); returns the staging seconds."""
        stager = self.__dict__.get("_rollart_stager")
        if stager is None:
            raise RuntimeError("rollart_commit_staged before rollart_stage_weights")
        stager.commit(self.model_runner.get_model(), tag)
        runner = self.model_runner
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):  # as reload_weights does
            if hasattr(runner, reset):
                getattr(runner, reset)()
        return float(stager.stage_s)

    def rollart_read_parameter(self, name: str) -> tuple[list[int], str, str]:
        """Exact bytes (base64) of one parameter (vLLM naming), for checks against the trainer.

        Base64 because large ``bytes`` return values do not survive vLLM's utility-call path.
        """
        params = dict(self.model_runner.get_model().named_parameters())
        if name not in params:
            raise KeyError(f"no parameter {name!r}; have e.g. {sorted(params)[:8]}")
        _, shape, dtype, raw = pack_tensors([(name, params[name])])[0]
        return shape, dtype, base64.b64encode(raw).decode("ascii")
