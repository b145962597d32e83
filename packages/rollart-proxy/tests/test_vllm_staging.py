"""The swap at the heart of staged weight updates, on plain torch modules (no engine needed)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from rollart_proxy.engines.vllm_staging import _clone_tree, commit  # noqa: E402


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(8, 4)
        self.norm = torch.nn.LayerNorm(4)
        self.head = torch.nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight  # tied, as in many LMs
        self.register_buffer("scale", torch.ones(4))
        self.head.cpu_linear = lambda x: ("old-kernel", x)  # what vLLM derives from the weights on CPU


def test_clone_copies_storage_keeps_ties_and_shares_other_attributes() -> None:
    live = Tied()
    shadow = _clone_tree(live, {})
    assert shadow.head.weight is shadow.embed.weight and shadow.embed.weight is not live.embed.weight
    assert torch.equal(shadow.embed.weight, live.embed.weight)
    assert shadow.embed.weight.data_ptr() != live.embed.weight.data_ptr()
    assert shadow.head.cpu_linear is live.head.cpu_linear  # shared until the shadow is re-processed
    assert len(list(shadow.modules())) == len(list(live.modules()))


def test_commit_swaps_weights_and_kernels_in_place() -> None:
    live = Tied()
    shadow = _clone_tree(live, {})
    with torch.no_grad():
        for p in shadow.parameters():
            p.add_(1.0)
        shadow.scale.mul_(3.0)
    shadow.head.cpu_linear = lambda x: ("new-kernel", x)
    old_embed, new_embed = live.embed.weight.detach().clone(), shadow.embed.weight.detach().clone()
    live_param = live.embed.weight
    swapped = commit(live, shadow)
    assert live.embed.weight is live_param  # the same Parameter object: references elsewhere stay valid
    assert torch.equal(live.embed.weight, new_embed) and torch.equal(shadow.embed.weight, old_embed)
    assert live.head.weight is live.embed.weight  # still tied (swapped once, not twice)
    assert torch.equal(live.scale, torch.full((4,), 3.0))
    assert live.head.cpu_linear(0)[0] == "new-kernel" and shadow.head.cpu_linear(0)[0] == "old-kernel"
    assert swapped == 4  # embed (tied with head), norm weight and bias, the buffer


def test_commit_refuses_a_shape_change() -> None:
    live = Tied()
    shadow = _clone_tree(live, {})
    with torch.no_grad():
        shadow.embed.weight.add_(1.0)
    shadow.norm.weight = torch.nn.Parameter(torch.ones(5))
    before = live.embed.weight.detach().clone()
    with pytest.raises(RuntimeError, match=r"staged LayerNorm\.weight is \(5,\)"):
        commit(live, shadow)
    assert torch.equal(live.embed.weight, before)  # checked before anything was swapped: not torn


def test_a_failed_pull_is_retried_not_kept(tmp_path) -> None:
    """A pull that failed (the store was unreachable) is started again by the next prefetch instead
    of handing every later update the same error. The engine is not started: only its puller runs."""
    from rollart_proxy.engines.vllm_engine import VllmEngine

    class FlakyStore:  # stands in for a store whose first read fails
        def __init__(self) -> None:
            self.calls = 0

        def pull(self, version: int) -> dict:
            self.calls += 1
            if self.calls == 1:
                raise OSError("store unreachable")
            return {"w": version}

    store = FlakyStore()
    engine = VllmEngine(model_path=str(tmp_path), weight_store=store)  # type: ignore[arg-type]
    engine.prefetch(3)
    first = engine._prefetch[3]
    assert isinstance(first.exception(timeout=10), OSError)
    engine.prefetch(3)
    second = engine._prefetch[3]
    assert second is not first and second.result(timeout=10) == {"w": 3} and store.calls == 2
    engine.prefetch(3)  # pulled: nothing new
    assert engine._prefetch[3] is second and store.calls == 2
