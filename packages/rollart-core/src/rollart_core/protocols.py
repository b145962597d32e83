"""Cross-package contracts. Each plane's package implements these; core wires them together.

Primitives and who calls them:

``InferenceEngine`` (implemented by rollart-proxy back-ends, called by the LLMProxy)
    generate(request)        one turn of one trajectory: token ids in, ids + logprobs + versions out
    abort(request_id)        cancel one in-flight request (stale or redundant trajectories)
    weight_version()         policy version of the weights the engine serves now
``SupportsStream`` (optional engine capability, called by the proxy for streaming clients)
    generate_stream(request) the same turn, yielded as token deltas, then the complete output
``SupportsPause`` (optional engine capability, called by the coordinator through the proxy)
    pause(mode)              stop scheduling; ``keep`` freezes in-flight requests without loss
    resume()                 continue scheduling
``SupportsWeightUpdate`` (optional engine capability, called by the coordinator)
    update_weights(version)  pull ``version`` from the engine's weight store and load it; never
                             aborts in-flight requests
``SupportsWeightPrefetch`` (optional engine capability, called by the coordinator once a push lands)
    prefetch_weights(version) pull (and stage) ``version`` while generation goes on; returns when it
                             is ready, so the later ``update_weights(version)`` only swaps it in
``Proxy`` (rollart-proxy's LLMProxy or PD router, driven by the control plane and the runner)
    generate(request) / abort(request_id)   route one turn to an engine / cancel it everywhere
    suspend() / resume()     pause every engine with in-flight requests kept / continue
    update_weights(version)  Suspend → Update → Recompute KV → Resume on every engine; per-engine pause
    prefetch_weights(version) every engine pulls and stages ``version`` while generating
    end_session(session_id)  forget a finished trajectory's routing state
    metrics()                per-engine health, queue depth, throughput, time suspended
``SupportsEndSession`` (what the trajectory runner needs of its generator, a proxy or a bare engine)
    end_session(session_id)  forget a finished trajectory's routing state, if the generator keeps any
``SupportsHealthLoop`` (optional proxy capability, started and stopped by the pipeline)
    start_health_loop() / stop_health_loop()  probe engines, bring restarted ones to the served weights
``SupportsElasticWorkers`` (optional proxy capability, called by the pipeline's elastic rollout pool)
    add_actor_worker(name, actor, pool)  a started engine actor joins once it serves the served version
    remove_worker(name, drain_timeout_s) stop routing to it, drain, hand the rest back; then forget it
``Environment`` (rollart-env, called by the trajectory runner)
    reset(seed) / step(action_text) / close(); ``action_vocabulary`` and ``system_prompt``
``SupportsConfigCheck`` (optional capability of an environment's class, called by the pipeline and
``rollart check-config`` once per task, before anything starts)
    check_config(config)     check what the validated options point to (a data file, its rows and
                             keys; importable code; installed extras): ``ConfigError`` naming them
``SupportsAgentEpisode`` (optional environment kind, called by the trajectory runner instead of reset/step)
    run_episode(session)     an agent drives the whole episode through the session's model endpoint;
                             returns every model call (exact engine ids) and the agent's verdict
``RewardFunction`` (rollart-reward, called by a reward executor)
    score(trajectory)        a finished trajectory's reward; ``stateless`` says it may be offloaded
``SupportsBatchScore`` (optional reward capability, called by executors that batch)
    score_batch(trajectories) one result per trajectory, in order
``RewardExecutor`` (rollart-reward, called by the trajectory runner)
    score(trajectory)        run a reward function somewhere (inline, Ray, serverless); raises
                             ``RewardError`` after its retries
    stats()                  utilisation counters: busy/provisioned seconds, queueing, cold starts
``SupportsFreshStats`` (optional executor capability, called by ``rollart bench`` between segments)
    astats()                 ``stats()`` with the counters read now where they live (a function
                             runtime's own ``/stats``), not the last periodic snapshot
``Trainer`` (rollart-train, called by the coordinator)
    train_step(batch) / named_weights() / save(path) / version
``SupportsWeightPush`` (optional trainer capability, called by the coordinator after a step)
    push_weights(version)    push the current weights to the trainer's own weight store from where
                             they live (a rank of a worker group): they never pass through the caller
``WeightStore`` (rollart-weightsync; trainer pushes, inference workers pull)
    push(version, tensors) / latest_version() / pull(version, into) / wait_for(version) /
    subscribe(callback); retention (keep the last N versions) is each back-end's config
``SupportsClose`` / ``SupportsAclose`` (optional capability of a trainer, a weight store or a reward
executor, called by the pipeline's teardown)
    close() / aclose()       stop what the component started (rank processes, a function runtime)
``SupportsRestarts`` (optional trainer capability, read into the run's summary)
    restarts                 how many times the trainer's ranks were rebuilt after a failure
``ChatFormat`` (token-level chat formatting, called by the trajectory runner)
    first_turn(system, user) / next_turn(user, previous_output) / action_token_ids(actions) / decode(ids)
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from rollart_core.types import (
    GenerateOutput,
    GenerateRequest,
    RewardResult,
    SamplingParams,
    StepResult,
    Trajectory,
)

if TYPE_CHECKING:  # torch is never imported by core at run time
    import torch

__all__ = [
    "AgentCall",
    "AgentEpisode",
    "AgentSession",
    "ChatFormat",
    "Environment",
    "InferenceEngine",
    "PauseMode",
    "Proxy",
    "RewardExecutor",
    "RewardFunction",
    "SupportsAclose",
    "SupportsAgentEpisode",
    "SupportsBatchScore",
    "SupportsClose",
    "SupportsConfigCheck",
    "SupportsEndSession",
    "SupportsFreshStats",
    "SupportsElasticWorkers",
    "SupportsHealthLoop",
    "SupportsPause",
    "SupportsRestarts",
    "SupportsResume",
    "SupportsStream",
    "SupportsWeightPrefetch",
    "SupportsWeightPush",
    "SupportsWeightUpdate",
    "Trainer",
    "WeightStore",
]

PauseMode = Literal["keep", "wait", "abort"]


@runtime_checkable
class InferenceEngine(Protocol):
    """An inference worker: one engine (vLLM, SGLang, ...) serving one copy of the policy."""

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        """Generate one turn. Raises :class:`~rollart_core.errors.EngineError` on a bad request."""
        ...

    async def abort(self, request_id: str) -> None:
        """Cancel one in-flight request; a no-op if it already finished."""
        ...

    async def weight_version(self) -> int:
        """The policy version of the weights served now."""
        ...


@runtime_checkable
class SupportsStream(Protocol):
    def generate_stream(self, request: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        """Generate one turn incrementally.

        Yields partial outputs holding only the tokens new since the previous one
        (``finish_reason == ""``), then exactly one complete output (all tokens, final per-token
        versions, a non-empty ``finish_reason``). Closing the iterator early aborts the request.
        """
        ...


@runtime_checkable
class SupportsPause(Protocol):
    async def pause(self, mode: PauseMode = "keep") -> None:
        """Stop scheduling. ``keep``: in-flight requests stay and continue after :meth:`resume`."""
        ...

    async def resume(self) -> None: ...


@runtime_checkable
class SupportsWeightUpdate(Protocol):
    async def update_weights(self, version: int) -> float:
        """Load ``version`` from the weight store; returns seconds generation was blocked."""
        ...


@runtime_checkable
class SupportsWeightPrefetch(Protocol):
    async def prefetch_weights(self, version: int) -> None:
        """Prepare ``version`` (pull; load into a standby copy where the engine can) while generation
        goes on; returns when it is ready to swap in. Callers run it as a background task."""
        ...


@runtime_checkable
class Proxy(Protocol):
    """What the control plane drives: a router over the inference engines of every pool."""

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        """One turn on an engine of the request's task pool (sticky per session)."""
        ...

    async def abort(self, request_id: str) -> int:
        """Cancel ``request_id`` wherever it runs; returns on how many engines it was found."""
        ...

    async def suspend(self) -> None:
        """Pause every engine, keeping in-flight requests (they continue after :meth:`resume`)."""
        ...

    async def resume(self) -> None: ...

    async def update_weights(self, version: int) -> dict[str, float]:
        """Every healthy engine loads ``version`` from the weight store (pause with requests kept,
        swap, re-prefill the running requests, resume); returns each engine's pause in seconds."""
        ...

    async def prefetch_weights(self, version: int) -> None:
        """Every engine pulls and stages ``version`` while it generates; returns when all are ready."""
        ...

    def end_session(self, session_id: str) -> None:
        """Forget the routing state of a session whose trajectory ended."""
        ...

    async def metrics(self, engine_stats: bool = True, timeout: float = 5.0) -> dict[str, dict[str, Any]]:
        """Per engine: pool, health, queue depth, tokens/s, time suspended (and the engine's own stats)."""
        ...


@runtime_checkable
class SupportsEndSession(Protocol):
    def end_session(self, session_id: str) -> None:
        """Forget the routing state of a session whose trajectory ended."""
        ...


@runtime_checkable
class SupportsHealthLoop(Protocol):
    def start_health_loop(self, period_s: float | None = None) -> None:
        """Start probing the engines in the background (restarted ones come back on the served
        weights); ``period_s`` None: the proxy's configured period."""
        ...

    async def stop_health_loop(self) -> None:
        """Stop the probing and wait for it to end."""
        ...


@runtime_checkable
class SupportsElasticWorkers(Protocol):
    async def add_actor_worker(self, name: str, actor: Any, pool: str) -> int:
        """Route to the engine in Ray actor ``actor`` (engine group ``pool``) once it is started and
        serves the proxy's weight version; returns that version. Raises naming the stage that failed."""
        ...

    async def remove_worker(self, name: str, drain_timeout_s: float = 60.0) -> dict[str, int]:
        """Stop routing to ``name``; wait up to ``drain_timeout_s`` for its requests, then continue the
        rest on other engines of its group from the tokens they have. Returns
        ``{"drained": n, "handed_back": n}``. The last healthy engine of a group is never removed."""
        ...


@runtime_checkable
class Environment(Protocol):
    """A stateful text environment: text in, text out."""

    action_vocabulary: Sequence[str] | None
    """Discrete actions, each one token (used for ``allowed_token_ids``); None for free text."""
    system_prompt: str | None

    async def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        """Start an episode; deterministic given ``seed``. Returns observation and info."""
        ...

    async def step(self, action_text: str) -> StepResult:
        """Apply an action. An unparsable action yields an observation saying so, not an exception;
        an action the environment cannot carry out (a tool it crashes) raises
        :class:`~rollart_core.errors.InvalidActionError` (the episode ends, scored with its reward),
        never another exception, which would count as the environment's own fault (``env_failed``)."""
        ...

    async def close(self) -> None: ...


@runtime_checkable
class SupportsConfigCheck(Protocol):
    """Implemented by an environment's *class* (a ``classmethod``): the checks its constructor would
    make of the world its options point to, without building one (the runner builds one env per
    trajectory, after the engines have started: too late to learn that a file is missing). Cheap and
    without side effects; a wrapper env forwards to the env it wraps
    (:func:`rollart_core.registry.check`)."""

    def check_config(self, config: Any) -> None:
        """Raise :class:`~rollart_core.errors.ConfigError` naming the file / row / key at fault (or
        :class:`~rollart_core.errors.MissingExtraError` naming the install command)."""
        ...


@dataclass(slots=True)
class AgentSession:
    """What the runner hands an agent episode: the trajectory's session on the proxy."""

    session_id: str
    """The trajectory id; every model call of the episode must carry it (the proxy refuses others)."""
    task: str
    seed: int
    generator: Any
    """The proxy the runner generates with (``LLMProxy`` / PD router): the episode's endpoint wraps it."""
    sampling: SamplingParams
    """The task's sampling parameters (defaults for calls that do not set their own)."""


@dataclass(slots=True)
class AgentCall:
    """One model call of an agent episode, as the engine saw it."""

    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str = ""
    temperature: float = 1.0
    allowed_token_ids: tuple[int, ...] | None = None
    """The sampling the outputs were drawn under (the trainer applies the same)."""


@dataclass(slots=True)
class AgentEpisode:
    """A finished agent episode: its model calls in order, and the agent's verdict."""

    calls: list[AgentCall]
    answer: str | None = None
    reward: float | None = None
    """The agent's own reward; None: the task's reward function scores the trajectory."""
    info: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class SupportsAgentEpisode(Protocol):
    """An environment whose episode is run by an agent program (e.g. one written against the OpenAI
    SDK) rather than stepped by the runner. The agent's failures are raised as
    :class:`~rollart_core.errors.EnvError` (``env_failed``) or
    :class:`~rollart_core.errors.EnvTimeoutError` (``timed_out``)."""

    async def run_episode(self, session: AgentSession) -> AgentEpisode:
        """Run one episode whose model calls go through ``session``; ends the endpoint's session."""
        ...

    async def close(self) -> None: ...


@runtime_checkable
class RewardFunction(Protocol):
    """Scores a finished trajectory. Registered by name in the ``rollart.reward`` entry-point group."""

    stateless: bool
    """True if the function keeps no state between calls and may run anywhere (serverless)."""

    async def score(self, trajectory: Trajectory) -> RewardResult:
        """The reward and its details. Raising means this attempt failed (executors retry)."""
        ...


@runtime_checkable
class SupportsBatchScore(Protocol):
    async def score_batch(self, trajectories: Sequence[Trajectory]) -> list[RewardResult]:
        """One result per trajectory, in order (e.g. one batched judge call)."""
        ...


@runtime_checkable
class RewardExecutor(Protocol):
    """Runs a reward function somewhere. Registered in the ``rollart.reward_executor`` group."""

    async def score(self, trajectory: Trajectory) -> RewardResult:
        """Score one trajectory; raises :class:`~rollart_core.errors.RewardError` after retries."""
        ...

    def stats(self) -> dict[str, float]:
        """Counters: ``calls``, ``failures``, ``busy_s``, ``provisioned_s``, ``utilisation``,
        ``queue_delay_s_mean``, ``cold_starts`` (those that apply to the executor)."""
        ...


@runtime_checkable
class SupportsFreshStats(Protocol):
    async def astats(self) -> dict[str, float]:
        """:meth:`RewardExecutor.stats` with its counters read now (e.g. from a function runtime the
        executor started: ``runtime_busy_s``, ``runtime_provisioned_s``, ``runtime_cold_starts``)."""
        ...


@runtime_checkable
class Trainer(Protocol):
    """Owns the policy's trainable copy. Compute-bound and synchronous: callers run it off-loop."""

    version: int
    """Policy version of the current weights (0 = initial, +1 per optimizer step)."""

    def train_step(self, batch: Sequence[Trajectory]) -> dict[str, float]:
        """One policy update on ``batch``; bumps :attr:`version`; returns metrics."""
        ...

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """Full (unsharded) tensors in Hugging Face naming, for the weight store."""
        ...

    def save(self, path: str) -> None: ...


@runtime_checkable
class SupportsResume(Protocol):
    def load(self, path: str) -> None:
        """Restore weights, optimizer state and :attr:`Trainer.version` from ``save(path)``."""
        ...


@runtime_checkable
class SupportsWeightPush(Protocol):
    def push_weights(self, version: int) -> dict[str, float]:
        """Push the current weights as ``version`` to the weight store the trainer was built with and
        return once it is committed (metrics such as ``push_s``). The full weights move from where
        they live (e.g. rank 0 of a worker group) to the store, never through the caller. Blocking:
        callers run it off their event loop. Raises WeightSyncError if the commit fails."""
        ...


@runtime_checkable
class WeightStore(Protocol):
    """Versioned weights: the trainer pushes asynchronously, inference workers pull on demand.

    A version becomes visible only once completely written (atomic commit): a reader never sees
    a partial version. Each back-end keeps only its last N committed versions (its config's
    ``keep_last``); older ones are deleted after a newer commit.
    """

    def push(self, version: int, tensors: Mapping[str, torch.Tensor]) -> Future[None]:
        """Start writing ``version``; returns once the tensors are snapshotted (the caller may
        modify them afterwards). The future completes at commit or carries WeightSyncError."""
        ...

    def latest_version(self) -> int | None:
        """Newest committed version, or None if nothing was committed."""
        ...

    def pull(self, version: int, into: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Read a committed version (bucket by bucket); raises WeightSyncError if it is not
        committed, was deleted by retention, or fails its checksum.

        ``into``: preallocated tensors (same names and shapes) filled in place and returned as
        the same objects; tensors of the version not named in ``into`` are allocated.
        """
        ...

    def wait_for(self, version: int, timeout: float | None = None) -> int:
        """Block until ``version`` or newer is committed; returns the newest committed version.
        Raises WeightSyncError on timeout."""
        ...

    def subscribe(self, callback: Callable[[int], None]) -> Callable[[], None]:
        """Call ``callback(version)`` (on a store thread) for newly committed versions; a slow
        subscriber is handed only the newest version. Returns a function that unsubscribes."""
        ...


@runtime_checkable
class SupportsClose(Protocol):
    def close(self) -> None:
        """Stop what this component started (rank processes, a holder process); idempotent."""
        ...


@runtime_checkable
class SupportsAclose(Protocol):
    async def aclose(self) -> None:
        """Stop what this component started (e.g. a reward function runtime); idempotent."""
        ...


@runtime_checkable
class SupportsRestarts(Protocol):
    restarts: int
    """How many times the trainer's ranks were rebuilt after a failure."""


@runtime_checkable
class ChatFormat(Protocol):
    """Turns text into the exact token ids the policy sees, turn by turn (no re-tokenisation)."""

    def first_turn(self, system: str | None, user: str) -> list[int]: ...

    def next_turn(self, user: str, previous_output: Sequence[int]) -> list[int]:
        """Tokens that close the previous assistant turn (unless it closed itself) and open the next."""
        ...

    def action_token_ids(self, actions: Sequence[str]) -> list[int]:
        """One token id per action; raises ConfigError if an action is not a single token."""
        ...

    def stop_token_ids(self) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...
