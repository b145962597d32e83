"""LLM-as-judge reward through any generator with ``generate(GenerateRequest)`` (rollart-proxy's LLMProxy,
a single engine, or your own client).

The judge sees the question, the response and (optionally) the reference, and must answer with one
token: the verdict tokens are enforced with ``allowed_token_ids``, so even a tiny random model returns
a well-formed verdict.
"""

from __future__ import annotations

import itertools
import uuid
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field

from rollart_core.errors import RewardError
from rollart_core.protocols import ChatFormat
from rollart_core.types import GenerateOutput, GenerateRequest, RewardResult, SamplingParams, Trajectory
from rollart_reward.rewards import response_text

__all__ = ["LLMJudgeReward"]


class _Generator(Protocol):
    async def generate(self, request: GenerateRequest) -> GenerateOutput: ...


class LLMJudgeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    system: str = "You are a strict grader. Reply with Y if the response is correct, otherwise N."
    template: str = (
        "Question:\n{question}\n\nReference answer:\n{reference}\n\nResponse:\n{response}\n\nCorrect?"
    )
    """Fields: ``question`` (``info['question']``), ``reference`` (``info[answer_key]``), ``response``."""
    answer_key: str = "answer"
    yes: str = "Y"
    no: str = "N"
    task: str | None = None
    """Task name the generator routes the judge's requests by (its own pool)."""
    seed: int | None = 0
    correct: float = 1.0
    wrong: float = 0.0
    max_prompt_tokens: int = Field(1536, ge=16)
    """Longer prompts keep their tail (the response and the question to the judge)."""


class LLMJudgeReward:
    """``correct`` if the judge answers ``yes``. Not stateless: it holds a generator."""

    Config = LLMJudgeConfig
    stateless = False

    def __init__(
        self, config: LLMJudgeConfig | None = None, *, generator: _Generator, chat: ChatFormat
    ) -> None:
        self.config = config or LLMJudgeConfig()
        self.generator = generator
        self.chat = chat
        self._yes, self._no = chat.action_token_ids([self.config.yes, self.config.no])
        self._ids = itertools.count()

    async def score(self, trajectory: Trajectory) -> RewardResult:
        c = self.config
        prompt = c.template.format(
            question=trajectory.info.get("question", ""),
            reference=trajectory.info.get(c.answer_key, ""),
            response=response_text(trajectory),
        )
        ids = self.chat.first_turn(c.system, prompt)[-c.max_prompt_tokens :]
        req = GenerateRequest(
            request_id=f"judge-{trajectory.traj_id}-{next(self._ids)}-{uuid.uuid4().hex[:6]}",
            prompt_ids=ids,
            sampling=SamplingParams(
                max_tokens=1, temperature=0.0, allowed_token_ids=(self._yes, self._no), seed=c.seed
            ),
            task=c.task,
        )
        out = await self.generator.generate(req)
        if not out.token_ids or out.token_ids[0] not in (self._yes, self._no):
            raise RewardError(f"judge returned {out.token_ids!r}, expected one of the verdict tokens")
        yes = out.token_ids[0] == self._yes
        return RewardResult(
            c.correct if yes else c.wrong,
            {
                "verdict": c.yes if yes else c.no,
                "logprob": out.logprobs[0] if out.logprobs else None,
            },
        )
