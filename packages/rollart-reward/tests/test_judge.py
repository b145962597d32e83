"""LLM-as-judge through a real in-process vLLM (CPU) engine on the tiny model; verdict tokens are
enforced with ``allowed_token_ids``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rollart_core.types import Trajectory, Turn

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]


async def test_llm_judge_with_vllm_engine(tmp_path: Path) -> None:
    from rollart_proxy.chat import ChatMLFormat
    from rollart_proxy.engines.vllm_engine import VllmEngine, VllmEngineConfig
    from rollart_reward.judge import LLMJudgeReward
    from rollart_train.tiny import create_tiny_model

    model = create_tiny_model(tmp_path / "tiny", dtype="float32")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    engine = VllmEngine(
        VllmEngineConfig(max_model_len=512, dtype="float32", max_num_seqs=8), model_path=str(model)
    )
    try:
        await engine.start()
        judge = LLMJudgeReward(generator=engine, chat=ChatMLFormat(model))
        results = []
        for i in range(3):
            t = Trajectory(
                traj_id=f"j{i}",
                task="qa",
                env_id="e",
                group_id="g",
                seed=0,
                start_version=0,
                turns=[Turn(context_ids=[1], action_text=f"It is {i}.")],
                info={"question": "What is 1+1?", "answer": "2"},
            )
            results.append(await judge.score(t))
    finally:
        await engine.shutdown()
    assert all(r.details["verdict"] in ("Y", "N") for r in results)
    assert all(r.score == (1.0 if r.details["verdict"] == "Y" else 0.0) for r in results)
    assert all(isinstance(r.details["logprob"], float) for r in results)
