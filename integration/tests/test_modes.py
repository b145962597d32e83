"""The three training modes on the real pipeline: invariants that must hold in every mode."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollart_core.loop import train

from .conftest import slice_config

pytestmark = [pytest.mark.vllm, pytest.mark.ray]


class _Collect:
    def __init__(self) -> None:
        self.rows: list[tuple[int, dict]] = []

    def log(self, step: int, metrics: dict) -> None:
        self.rows.append((step, metrics))

    def close(self) -> None:
        pass


@pytest.mark.parametrize(("mode", "alpha"), [("one_off", 1), ("async", 1)])
async def test_mode_invariants(mode: str, alpha: int, tmp_path: Path, tiny_model: Path) -> None:
    cfg = slice_config(tmp_path, model_path=tiny_model, steps=3)
    cfg.train.mode, cfg.train.alpha = mode, alpha  # type: ignore[assignment]
    sink = _Collect()
    summary = await train(cfg, sink=sink)
    hist = summary["history"]
    assert summary["final_version"] == 3 and [h["version"] for h in hist] == [1, 2, 3]
    # every launched trajectory is accounted for by exactly one fate
    assert sum(summary["fates"].values()) == summary["launched"] > 0
    # no trajectory is trained with a policy lag above alpha, and training saw off-policy data
    assert all(h["lag_max"] <= alpha for h in hist)
    assert max(h["lag_max"] for h in hist) >= 1
    # rollout overlapped training: trajectories were in flight while the trainer ran
    assert any(h["inflight_at_train"] > 0 for h in hist)
    assert all(h["batch_size"] > 0 for h in hist)
