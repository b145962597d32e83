"""Double-buffered weight updates inside a vLLM worker: build the next weights off the critical path.

vLLM's in-place ``reload_weights`` loads checkpoint tensors and then re-runs every layer's
``process_weights_after_loading`` (on CPU: the oneDNN / sgl-kernel repack of each linear layer). All of
it happens while generation is paused. Here the same vLLM reload runs on a *shadow* copy of the model in
a background thread while the engine keeps generating; the pause then only swaps storage:

- :func:`make_shadow` clones the module tree once (parameters and buffers copied, other attributes
  shared: attention layers keep pointing at the live KV cache, which the shadow never touches) and
  hands the shadow the live model's reload metadata, so vLLM's layerwise reload can run on it.
- :func:`stage` runs ``reload_weights`` on the shadow (checkpoint format, HF names).
- :func:`commit` swaps, layer by layer, the storage of every parameter and buffer and the kernels
  derived from the weights (``cpu_linear``: a closure over the packed weights) between live and shadow.
  The live modules and ``Parameter`` objects stay the same objects (attention layers stay registered
  in vLLM's forward context; tied weights stay tied); the shadow now holds the previous weights and is
  the buffer for the next update.

Costs one extra copy of the weights. Runs where the model executes eagerly (``enforce_eager``): a
captured graph would keep the old kernels.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["DERIVED_ATTRS", "WeightStager", "commit", "make_shadow", "stage"]

DERIVED_ATTRS = ("cpu_linear", "_cpu_unpacked_conv_weight")
"""Module attributes vLLM derives from the weights in ``process_weights_after_loading`` (CPU)."""


def _clone_tree(module: torch.nn.Module, memo: dict[int, Any]) -> torch.nn.Module:
    if id(module) in memo:  # a module reached twice (e.g. a tied lm_head) stays one module
        return memo[id(module)]
    new = copy.copy(module)  # shallow: a new __dict__, every other attribute shared
    memo[id(module)] = new
    new._parameters = {}
    for name, p in module._parameters.items():
        if p is None:
            new._parameters[name] = None
        elif id(p) in memo:  # tied weights stay tied in the shadow
            new._parameters[name] = memo[id(p)]
        else:
            q = torch.nn.Parameter(p.data.clone(), requires_grad=p.requires_grad)
            q.__dict__.update(p.__dict__)  # weight_loader, output_dim, … (rebound by vLLM on reload)
            memo[id(p)] = q
            new._parameters[name] = q
    new._buffers = {
        name: (None if b is None else memo.setdefault(id(b), b.clone()))
        for name, b in module._buffers.items()
    }
    new._non_persistent_buffers_set = set(module._non_persistent_buffers_set)
    new._modules = {
        name: (None if m is None else _clone_tree(m, memo)) for name, m in module._modules.items()
    }
    return new


def make_shadow(model: torch.nn.Module) -> torch.nn.Module:
    """A structural copy of ``model`` that vLLM's layerwise reload can load into."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    shadow = _clone_tree(model, {})
    for live, sh in zip(model.modules(), shadow.modules(), strict=True):
        src = get_layerwise_info(live)
        dst = get_layerwise_info(sh)
        dst.restore_metadata, dst.restore_device = src.restore_metadata, src.restore_device
    return shadow


def stage(vllm_config: Any, shadow: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Load checkpoint-format ``weights`` into ``shadow`` and run vLLM's post-load processing on it."""
    from vllm.model_executor.model_loader.reload.inplace import reload_weights

    with torch.no_grad():
        reload_weights(
            vllm_config, shadow, weights_iterator=weights, weights_path=None, is_checkpoint_format=True
        )


def commit(model: torch.nn.Module, shadow: torch.nn.Module) -> int:
    """Swap weights and derived kernels of ``model`` and ``shadow``; returns the tensors swapped.

    Every pair is checked before anything is swapped: a mismatch leaves the live model untouched.
    """
    seen: set[int] = set()
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    kernels: list[tuple[torch.nn.Module, torch.nn.Module, str]] = []
    for live, sh in zip(model.modules(), shadow.modules(), strict=True):
        for table in ("_parameters", "_buffers"):
            mine, theirs = getattr(live, table), getattr(sh, table)
            for name, t in mine.items():
                u = theirs.get(name)
                if t is None or u is None or id(t) in seen:
                    continue
                seen.add(id(t))
                if t.shape != u.shape or t.dtype != u.dtype:
                    raise RuntimeError(
                        f"staged {type(live).__name__}.{name} is {tuple(u.shape)} {u.dtype}, "
                        f"live is {tuple(t.shape)} {t.dtype}"
                    )
                pairs.append((t, u))
        kernels += [(live, sh, a) for a in DERIVED_ATTRS if a in live.__dict__ and a in sh.__dict__]
    with torch.no_grad():
        for t, u in pairs:
            t.data, u.data = u.data, t.data
    for live, sh, a in kernels:
        live.__dict__[a], sh.__dict__[a] = sh.__dict__[a], live.__dict__[a]
    return len(pairs)


class WeightStager:
    """Per-worker state: one shadow model, at most one staging in flight, the staged tag."""

    def __init__(self) -> None:
        self._shadow: torch.nn.Module | None = None
        self._thread: threading.Thread | None = None
        self._tag: Any = None
        self._requested: Any = None
        self._error: BaseException | None = None
        self.stage_s = 0.0

    def start(
        self, vllm_config: Any, model: torch.nn.Module, weights: list[tuple[str, torch.Tensor]], tag: Any
    ) -> None:
        """Begin staging ``weights`` under ``tag`` in a background thread; returns at once."""
        if self._thread is not None and self._thread.is_alive():
            self._thread.join()  # a newer version supersedes: the older one finishes first (shadow is single)
        if self._shadow is None:
            self._shadow = make_shadow(model)
        shadow = self._shadow
        self._tag, self._requested, self._error = None, tag, None

        def run() -> None:
            t0 = time.perf_counter()
            try:
                stage(vllm_config, shadow, weights)
                self._tag = tag
            except BaseException as exc:  # reported by ready()/commit(), never lost
                self._error = exc
            self.stage_s = time.perf_counter() - t0

        self._thread = threading.Thread(target=run, name=f"rollart-stage-{tag}", daemon=True)
        self._thread.start()

    def ready(self, tag: Any) -> bool:
        """True once ``tag`` is staged; raises the staging error if it failed."""
        if tag != self._requested:
            raise RuntimeError(f"staging weights {tag!r} was superseded by {self._requested!r}")
        if self._error is not None:
            raise RuntimeError(f"staging weights {tag!r} failed: {self._error!r}") from self._error
        return self._tag == tag and not (self._thread is not None and self._thread.is_alive())

    def commit(self, model: torch.nn.Module, tag: Any) -> int:
        """Swap the staged ``tag`` in (call with generation paused)."""
        if self._thread is not None:
            self._thread.join()
        if not self.ready(tag):
            raise RuntimeError(f"weights {tag!r} are not staged (staged: {self._tag!r})")
        if self._shadow is None:
            raise RuntimeError("no shadow model: nothing was staged")
        n = commit(model, self._shadow)
        self._tag = None  # the shadow now holds the previous weights
        return n
