"""Step phases and op profiles for ``real_model.py``'s trainer part: where a training step's time goes."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any


class PhaseTimer:
    """Splits train steps into phases with public torch hooks only: model forward (pre/post forward
    hooks), loss (forward end → the gradient of the logits arrives), backward through the model (→ the
    last parameter gradient accumulated), optimiser step (step pre/post hooks)."""

    def __init__(self, model: Any) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        self.on = False
        self.t: dict[str, float] = {}
        self.sums = dict.fromkeys(("forward", "loss", "backward", "optimizer"), 0.0)
        self._last_grad = 0.0
        self._handles = [
            model.register_forward_pre_hook(self._fwd_pre),
            model.register_forward_hook(self._fwd_post),
            register_optimizer_step_pre_hook(lambda *a: self._mark("opt0")),
            register_optimizer_step_post_hook(self._opt_post),
        ]
        for p in model.parameters():
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._grad_done))

    def _mark(self, key: str) -> None:
        if self.on:
            self.t[key] = time.perf_counter()

    def _fwd_pre(self, *args: Any) -> None:
        self._close_backward()
        self._mark("fwd0")

    def _fwd_post(self, module: Any, args: Any, out: Any) -> None:
        if not self.on:
            return
        now = time.perf_counter()
        self.sums["forward"] += now - self.t["fwd0"]
        self.t["fwd1"] = now
        logits = getattr(out, "logits", None)
        if logits is not None and logits.requires_grad:
            logits.register_hook(self._logits_grad)

    def _logits_grad(self, grad: Any) -> None:
        now = time.perf_counter()
        self.sums["loss"] += now - self.t["fwd1"]
        self.t["bwd0"] = now

    def _grad_done(self, p: Any) -> None:
        if self.on:
            self._last_grad = time.perf_counter()

    def _close_backward(self) -> None:
        if "bwd0" in self.t and self._last_grad > self.t["bwd0"]:
            self.sums["backward"] += self._last_grad - self.t.pop("bwd0")

    def _opt_post(self, *args: Any) -> None:
        if self.on and "opt0" in self.t:
            self._close_backward()
            self.sums["optimizer"] += time.perf_counter() - self.t.pop("opt0")

    @contextlib.contextmanager
    def step(self) -> Iterator[dict[str, float]]:
        self.sums = dict.fromkeys(self.sums, 0.0)
        self.t, self._last_grad, self.on = {}, 0.0, True
        out: dict[str, float] = {}
        t0 = time.perf_counter()
        try:
            yield out
        finally:
            self.on = False
            wall = time.perf_counter() - t0
            out.update(self.sums)
            out["other"] = max(wall - sum(self.sums.values()), 0.0)
            out["wall"] = wall

    def close(self) -> None:
        for h in self._handles:
            h.remove()


OP_GROUPS = (
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul", "mkldnn")),
    ("attention", ("scaled_dot_product", "attention", "flash")),
    ("softmax/loss", ("softmax", "logsumexp", "gather", "nll", "entropy")),
    ("dtype casts/copies", ("aten::copy_", "aten::_to_copy", "aten::to", "clone", "contiguous")),
    ("optimizer", ("_foreach", "adam", "Optimizer")),
)


def op_profile(run_step: Callable[[], Any], top: int = 10) -> tuple[dict[str, Any], Any]:
    """One step under torch.profiler: the ops with the most self CPU time, time by op group, and the
    step's own return value."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        value = run_step()
        wall = time.perf_counter() - t0
    rows = [(e.key, e.self_cpu_time_total / 1e6, e.count) for e in prof.key_averages()]
    rows.sort(key=lambda r: -r[1])
    total = sum(r[1] for r in rows) or 1.0
    groups = dict.fromkeys([g for g, _ in OP_GROUPS] + ["elementwise/other"], 0.0)
    for key, s, _ in rows:
        if key.startswith(("autograd::engine", "Optimizer.step", "Optimizer.zero_grad")):
            continue  # wrappers; their ops are counted themselves
        g = next(
            (g for g, pats in OP_GROUPS if any(p.lower() in key.lower() for p in pats)), "elementwise/other"
        )
        groups[g] += s
    return {
        "wall_s": wall,
        "self_cpu_s": total,
        "top_ops": [{"op": k, "self_s": s, "share": s / total, "calls": c} for k, s, c in rows[:top]],
        "groups": {g: {"self_s": s, "share": s / total} for g, s in groups.items()},
    }, value
