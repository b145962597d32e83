"""The trajectory runner: drives one trajectory env ↔ proxy ↔ reward, on its own (R2).

No batch barrier: each trajectory awaits only its own generation, environment and reward calls.
Every trajectory ends with exactly one fate; failures are recorded, never raised to the caller,
except a user's mistake that every trajectory would hit (a :class:`ConfigError` or a missing extra
from the environment): the fate is recorded, then it is raised, so the run stops naming it instead
of failing episode after episode.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from rollart_core.control.state import decide
from rollart_core.errors import (
    ConfigError,
    EnvError,
    EnvTimeoutError,
    InvalidActionError,
    MissingExtraError,
)
from rollart_core.protocols import (
    AgentCall,
    AgentSession,
    ChatFormat,
    Environment,
    SupportsAgentEpisode,
    SupportsEndSession,
)
from rollart_core.timeline import record
from rollart_core.types import (
    Fate,
    GenerateOutput,
    GenerateRequest,
    RewardResult,
    SamplingParams,
    StepResult,
    Trajectory,
    Turn,
)

__all__ = ["Generator", "Scorer", "assemble_agent_turns", "run_agent_trajectory", "run_trajectory"]

log = logging.getLogger(__name__)
T = TypeVar("T")
FATAL = (ConfigError, MissingExtraError)
"""Errors that are the run's, not the trajectory's: recorded as its fate, then raised."""


class Generator(Protocol):
    async def generate(self, request: GenerateRequest) -> GenerateOutput: ...

    async def abort(self, request_id: str) -> object: ...


class Scorer(Protocol):
    async def score(self, trajectory: Trajectory) -> RewardResult: ...


async def run_trajectory(
    traj: Trajectory,
    *,
    env: Environment,
    generator: Generator,
    chat: ChatFormat,
    scorer: Scorer,
    sampling: SamplingParams,
    max_turns: int,
    on_done: Callable[[Trajectory], Any] | None = None,
    context: str = "full",
    env_timeout_s: float | None = None,
    before_first_turn: Callable[[], Awaitable[Any]] | None = None,
) -> Trajectory:
    """Run ``traj`` (task, ids, seed and start version already set) to completion and score it.

    ``context``: ``full`` prompts every turn with the whole history; ``last_turn`` with the system
    prompt and the current observation only (each such turn is marked ``new_sequence``).
    ``env_timeout_s``: a ``reset`` or ``step`` that takes longer ends the trajectory with fate
    ``timed_out`` (None: wait as long as the environment takes).
    A ``step`` that raises :class:`~rollart_core.errors.InvalidActionError` (the model's action, not
    the environment, is at fault) ends the episode with that error's reward and is scored as usual
    (fate ``finished``); any other exception from the environment is its own fault: ``env_failed``.
    ``before_first_turn``: awaited after the reset, before the first generation, and not counted as
    generation time (a trajectory admitted ahead of a weight update waits there for the new weights).

    An environment that implements :class:`~rollart_core.protocols.SupportsAgentEpisode` runs its
    episode itself: see :func:`run_agent_trajectory` (``context`` and ``max_turns`` do not apply)."""
    if isinstance(env, SupportsAgentEpisode):
        return await run_agent_trajectory(
            traj,
            env=env,
            generator=generator,
            chat=chat,
            scorer=scorer,
            sampling=sampling,
            on_done=on_done,
            env_timeout_s=env_timeout_s,
            before_first_turn=before_first_turn,
        )
    if context not in ("full", "last_turn"):
        raise ValueError(f"context must be 'full' or 'last_turn', got {context!r}")
    if env_timeout_s is not None and env_timeout_s <= 0:
        raise ValueError(f"env_timeout_s must be > 0, got {env_timeout_s}")
    t_start = time.perf_counter()
    if env.action_vocabulary:
        sampling = sampling.model_copy(
            update={"allowed_token_ids": tuple(chat.action_token_ids(env.action_vocabulary))}
        )
    if not sampling.stop_token_ids:
        sampling = sampling.model_copy(update={"stop_token_ids": tuple(chat.stop_token_ids())})
    fatal: Exception | None = None
    try:
        await _play(
            traj, env, generator, chat, sampling, max_turns, context, env_timeout_s, before_first_turn
        )
        t0 = time.perf_counter()
        result = await scorer.score(traj)
        _timed(traj, "reward", t0)
        traj.reward = result.score
        traj.info["reward_details"] = result.details
        decide(traj, Fate.FINISHED)
    except asyncio.CancelledError:
        decide(traj, traj.fate or Fate.CANCELLED_REDUNDANT)
        raise
    except Exception as exc:  # a stage failed: the trajectory gets the fate naming it, the run goes on
        fatal = _fail(traj, exc, "environment")
    finally:
        traj.add_timing("total", time.perf_counter() - t_start)
        _end_session(generator, traj)
        try:
            await env.close()
        except Exception as exc:
            log.warning("trajectory %s: env.close failed: %r", traj.traj_id, exc)
    return await _finish(traj, on_done, fatal)


async def _play(
    traj: Trajectory,
    env: Environment,
    generator: Generator,
    chat: ChatFormat,
    sampling: SamplingParams,
    max_turns: int,
    context: str,
    env_timeout_s: float | None,
    before_first_turn: Callable[[], Awaitable[Any]] | None,
) -> None:
    """The episode of :func:`run_trajectory`: reset, then generate and step turn by turn until the
    environment ends it or ``max_turns`` is reached (truncated)."""
    t0 = time.perf_counter()
    obs, info = await _within(env.reset(traj.seed), env_timeout_s, "reset")
    _timed(traj, "env", t0)
    traj.info.update(info)
    prompt = chat.first_turn(env.system_prompt, obs)
    if before_first_turn is not None:
        await before_first_turn()
    history: list[int] = []
    for k in range(max_turns):
        new_sequence = k > 0 and context == "last_turn"
        history = list(prompt) if new_sequence else history + prompt
        turn = Turn(
            context_ids=prompt,
            allowed_token_ids=sampling.allowed_token_ids,
            temperature=sampling.temperature,
            new_sequence=new_sequence,
        )
        traj.turns.append(turn)
        out = await _generate(traj, f"{traj.traj_id}-t{k}", history, sampling, generator)
        turn.output_ids, turn.output_logprobs, turn.output_versions = (
            out.token_ids,
            out.logprobs,
            out.versions,
        )
        turn.finish_reason = out.finish_reason
        history += out.token_ids
        turn.action_text = chat.decode(out.token_ids)
        t0 = time.perf_counter()
        try:
            step = await _within(env.step(turn.action_text), env_timeout_s, f"step {k}")
        except InvalidActionError as exc:  # the model's fault: the episode ends with a failure, scored
            step = StepResult(str(exc), exc.reward, True, False, {"invalid_action": str(exc)})
        _timed(traj, "env", t0)
        turn.env_reward = step.reward
        traj.env_return += step.reward
        traj.info.update(step.info)
        if step.terminated or step.truncated:
            traj.terminated, traj.truncated = step.terminated, step.truncated
            return
        if context == "last_turn":
            prompt = chat.first_turn(env.system_prompt, step.observation)
        else:
            prompt = chat.next_turn(step.observation, out.token_ids)
    traj.truncated = True


async def _generate(
    traj: Trajectory, request_id: str, history: list[int], sampling: SamplingParams, generator: Generator
) -> GenerateOutput:
    t0 = time.perf_counter()
    try:
        out = await generator.generate(
            GenerateRequest(request_id, list(history), sampling, traj.traj_id, traj.task)
        )
    except asyncio.CancelledError:
        # cancelled (redundant or too stale): free the engine's slot, not just our await
        await asyncio.shield(_abort_quietly(generator, request_id))
        raise
    _timed(traj, "generate", t0)
    return out


async def run_agent_trajectory(
    traj: Trajectory,
    *,
    env: SupportsAgentEpisode,
    generator: Generator,
    chat: ChatFormat,
    scorer: Scorer,
    sampling: SamplingParams,
    on_done: Callable[[Trajectory], Any] | None = None,
    env_timeout_s: float | None = None,
    before_first_turn: Callable[[], Awaitable[Any]] | None = None,
) -> Trajectory:
    """Run an agent episode (``env.run_episode``), turn its model calls into ``traj``'s turns
    (:func:`assemble_agent_turns`) and score it: the agent's own reward, else ``scorer``.

    Fates, never raised: the agent failed or made no model call → ``env_failed``; it ran past its
    episode timeout (or ``env_timeout_s``) → ``timed_out``; generation / reward errors as usual
    (a FATAL error is recorded, then raised, as in :func:`run_trajectory`)."""
    t_start = time.perf_counter()
    fatal: Exception | None = None
    try:
        if before_first_turn is not None:
            await before_first_turn()
        t0 = time.perf_counter()
        session = AgentSession(traj.traj_id, traj.task, traj.seed, generator, sampling)
        episode = await _within(env.run_episode(session), env_timeout_s, "agent episode")
        _timed(traj, "agent", t0)
        if not episode.calls:
            raise EnvError("the agent made no model call")
        assemble_agent_turns(traj, episode.calls, chat)
        traj.info.update(episode.info)
        traj.info["agent_calls"] = len(episode.calls)
        if episode.answer is not None:
            traj.info["answer"] = episode.answer
        traj.terminated = True
        t0 = time.perf_counter()
        if episode.reward is not None:
            traj.reward = float(episode.reward)
            traj.info["reward_details"] = {"source": "agent"}
        else:
            result = await scorer.score(traj)
            traj.reward = result.score
            traj.info["reward_details"] = result.details
        _timed(traj, "reward", t0)
        decide(traj, Fate.FINISHED)
    except asyncio.CancelledError:
        decide(traj, traj.fate or Fate.CANCELLED_REDUNDANT)
        raise
    except Exception as exc:  # a stage failed: the trajectory gets the fate naming it, the run goes on
        fatal = _fail(traj, exc, "agent")
    finally:
        traj.add_timing("total", time.perf_counter() - t_start)
        _end_session(generator, traj)
        try:
            await env.close()
        except Exception as exc:
            log.warning("trajectory %s: env.close failed: %r", traj.traj_id, exc)
    return await _finish(traj, on_done, fatal)


async def _finish(
    traj: Trajectory,
    on_done: Callable[[Trajectory], Any] | None,
    fatal: Exception | None,
) -> Trajectory:
    if on_done is not None:
        await on_done(traj)
    if fatal is not None:
        raise fatal
    return traj


def assemble_agent_turns(traj: Trajectory, calls: list[AgentCall], chat: ChatFormat) -> None:
    """One turn per call: the prompt tokens not already in the sequence are context (not trained),
    the output tokens are trained with their logprobs and versions. A call whose prompt does not
    extend the previous call's prompt + output (the agent rewrote its history) starts a new
    sequence (``Turn.new_sequence``); ``traj.info["segments"]`` counts the sequences."""
    sequence: list[int] = []
    segments = 0
    for k, call in enumerate(calls):
        extends = k > 0 and call.prompt_ids[: len(sequence)] == sequence
        if extends:
            context = call.prompt_ids[len(sequence) :]
        else:
            context, sequence, segments = list(call.prompt_ids), [], segments + 1
        traj.turns.append(
            Turn(
                context_ids=context,
                output_ids=list(call.output_ids),
                output_logprobs=list(call.logprobs),
                output_versions=list(call.versions),
                finish_reason=call.finish_reason,
                action_text=chat.decode(call.output_ids),
                temperature=call.temperature,
                allowed_token_ids=call.allowed_token_ids,
                new_sequence=k > 0 and not extends,
            )
        )
        sequence += context + list(call.output_ids)
    traj.info["segments"] = segments


def _fail(traj: Trajectory, exc: Exception, who: str) -> Exception | None:
    """The fate of a trajectory whose ``exc`` escaped (:func:`~rollart_core.control.state.fate_of`).
    Returns ``exc`` if the run must stop on it (FATAL)."""
    decide(traj, exc)
    if traj.fate is Fate.ENV_FAILED:
        log.warning("trajectory %s: %s failed: %r", traj.traj_id, who, exc)
    return exc if isinstance(exc, FATAL) else None


async def _within(call: Awaitable[T], timeout: float | None, what: str) -> T:
    if timeout is None:
        return await call
    try:
        async with asyncio.timeout(timeout):  # not wait_for: on 3.11 it can swallow a cancellation
            return await call
    except TimeoutError:
        raise EnvTimeoutError(f"environment {what} took longer than {timeout} s") from None


async def _abort_quietly(generator: Generator, request_id: str) -> None:
    try:
        await generator.abort(request_id)
    except Exception as exc:  # the request may have finished in the meantime
        log.debug("abort of %s failed: %r", request_id, exc)


def _timed(traj: Trajectory, stage: str, t0: float) -> None:
    """Add the stage's time since ``t0`` to the trajectory and record the busy interval."""
    t1 = time.perf_counter()
    traj.add_timing(stage, t1 - t0)
    record(stage, t0, t1, traj.traj_id)


def _end_session(generator: Any, traj: Trajectory) -> None:
    """The proxy forgets the trajectory's routing state, whatever its fate: also when it is cancelled
    (redundant, stale, at the run's stop), or the proxy's session table grows by one per cancellation."""
    if not isinstance(generator, SupportsEndSession):
        return
    try:
        generator.end_session(traj.traj_id)
    except Exception as exc:  # never mask the trajectory's own outcome
        log.warning("trajectory %s: end_session failed: %r", traj.traj_id, exc)
