"""What :class:`~rollart_train.megatron_trainer.MegatronTrainer` uses with ``device: cpu``.

megatron-core 0.16.1's ``GPTModel`` and its tensor-parallel layers run on CPU over gloo once
``torch.cuda.current_device()`` answers ``"cpu"`` (RoPE frequencies and scratch buffers are placed
there) and the RNG tracker is made without CUDA. Three parts need CUDA and have a stand-in here, so the
rest of the trainer (model, weight loading, tensor-parallel collectives, losses, weight gathering,
checkpoints) runs unchanged on a CPU machine:

- ``get_forward_backward_func``'s schedule (a CUDA token counter) → :func:`forward_backward_cpu`, the
  same per-micro-batch loop for one model chunk (``pipeline_parallel: 1``);
- Megatron DDP (CUDA grad buffers) → plain ``.grad`` tensors, averaged over the data-parallel group in
  :meth:`CpuOptimizer.step`;
- Megatron's optimizer (CUDA scalars in its grad clipping) → :class:`CpuOptimizer`: torch AdamW with
  Megatron's defaults and its tensor-parallel-aware global gradient-norm clip.

For tests and debugging of the parallel layout, in float32; nothing here is meant to be fast.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["CpuOptimizer", "cuda_current_device_is_cpu", "forward_backward_cpu", "init_cpu_rng"]


@contextlib.contextmanager
def cuda_current_device_is_cpu() -> Iterator[None]:
    """megatron-core allocates on ``torch.cuda.current_device()``: answer ``"cpu"`` meanwhile. Safe in a
    rank process, which runs one call at a time."""
    real = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    try:
        yield
    finally:
        torch.cuda.current_device = real


def init_cpu_rng(seed: int) -> None:
    """Megatron's model-parallel RNG tracker without CUDA (no dropout is used: the seed is for init)."""
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def forward_backward_cpu(
    *,
    forward_step_func: Callable[[Iterator[Any], Any], tuple[torch.Tensor, Any]],
    data_iterator: Iterator[Any],
    model: list[Any],
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    forward_only: bool,
) -> None:
    """Megatron's ``forward_backward_no_pipelining`` for one chunk: per micro-batch, forward, the loss
    function on the output, ``loss / num_microbatches`` backward (gradients accumulate). Same keyword
    arguments, so the trainer calls either; ``seq_length`` and ``micro_batch_size`` only matter to the
    pipeline's point-to-point shapes."""
    del seq_length, micro_batch_size
    (chunk,) = model
    with cuda_current_device_is_cpu():
        for _ in range(num_microbatches):
            output, loss_func = forward_step_func(data_iterator, chunk)
            loss, _ = loss_func(output)
            if not forward_only:
                (loss / num_microbatches).backward()


class CpuOptimizer:
    """torch AdamW over one rank's parameters with Megatron's step semantics: ``step()`` averages the
    gradients over the data-parallel group (what DDP does), clips by the global norm over the
    model-parallel group counting tensor-parallel duplicates (norms, row-parallel biases) once, skips a
    non-finite step, and returns ``(update_successful, grad_norm, num_zeros_in_grad)``. Biases and
    1-D parameters get no weight decay, as in Megatron's default parameter groups."""

    def __init__(self, model: torch.nn.Module, *, lr: float, weight_decay: float, max_grad_norm: float):
        decay: list[torch.nn.Parameter] = []
        no_decay: list[torch.nn.Parameter] = []
        for name, p in model.named_parameters():
            if p.requires_grad:
                (no_decay if p.ndim == 1 or name.endswith(".bias") else decay).append(p)
        groups = [
            {"params": ps, "weight_decay": wd} for ps, wd in ((decay, weight_decay), (no_decay, 0.0)) if ps
        ]
        # Megatron's OptimizerConfig defaults: adam_beta1 0.9, adam_beta2 0.999, adam_eps 1e-8
        self.inner = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8)
        self.max_grad_norm = max_grad_norm

    def _grads(self) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        return [(p, p.grad) for g in self.inner.param_groups for p in g["params"] if p.grad is not None]

    def zero_grad(self) -> None:
        self.inner.zero_grad(set_to_none=True)

    def step(self) -> tuple[bool, float, None]:
        import torch.distributed as dist
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        grads = self._grads()
        dp = parallel_state.get_data_parallel_world_size()
        if dp > 1:
            group = parallel_state.get_data_parallel_group()
            for _, grad in grads:
                dist.all_reduce(grad, group=group)
                grad.div_(dp)
        sq = torch.zeros((), dtype=torch.float64)
        for p, grad in grads:
            if param_is_not_tensor_parallel_duplicate(p):
                sq += grad.double().pow(2).sum()
        dist.all_reduce(sq, group=parallel_state.get_model_parallel_group())
        norm = float(sq.sqrt())
        if not math.isfinite(norm):
            self.zero_grad()
            return False, norm, None
        coef = self.max_grad_norm / (norm + 1e-6)  # Megatron's clip_grad_by_total_norm_fp32
        if coef < 1.0:
            for _, grad in grads:
                grad.mul_(coef)
        self.inner.step()
        return True, norm, None

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)
