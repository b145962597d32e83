"""Agent tasks: train any agent written against the OpenAI SDK.

``env: {impl: agent, options: {entry: "my_pkg.agent:solve", model: <model dir>, episode_timeout_s: 60}}``
with::

    async def solve(client: openai.AsyncOpenAI, task: AgentTask) -> AgentResult | str: ...

Per trajectory the agent gets a client bound to the trajectory's session on the proxy's
OpenAI-compatible endpoint, in-process (an ``httpx.ASGITransport`` over
:class:`rollart_proxy.server.OpenAIServer`'s FastAPI app wrapping the run's own proxy: no socket).
Every call it makes is recorded with the exact engine ids, logprobs and versions; the runner
(:func:`rollart_core.control.runner.run_agent_trajectory`) turns them into the trajectory's turns.

Failures, as fates: the agent raises → ``env_failed`` with the error; runs past
``episode_timeout_s`` → ``timed_out`` (its in-flight request is aborted); makes no model call →
``env_failed``; calls with another session's id → refused by the proxy (403), ``env_failed``.

The agent runs in the control process (the proxy lives there); an ``env_manager`` cannot lease it.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import logging
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from rollart_core.errors import ConfigError, EnvError, EnvTimeoutError
from rollart_core.protocols import AgentCall, AgentEpisode, AgentSession

__all__ = ["AgentEnv", "AgentEnvConfig", "AgentResult", "AgentTask", "load_callable"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class AgentTask:
    """One episode's task, as the agent sees it."""

    seed: int
    task: str
    """The task's name in the run config."""
    data: dict[str, Any] = field(default_factory=dict)
    """Per-episode data: the options' ``task_data``, updated with what ``task_data_fn(seed)`` makes."""
    model: str = "policy"
    """The model name to pass to ``client.chat.completions.create(model=...)``."""
    max_tokens: int = 256
    temperature: float = 1.0
    """The task's sampling settings (what the agent should ask for, unless it knows better)."""


@dataclass(slots=True)
class AgentResult:
    """What an agent returns: a final answer and/or its own reward, and info (e.g. ``success``)."""

    answer: str | None = None
    reward: float | None = None
    """None: the task's reward function scores the trajectory (``info["answer"]`` holds the answer)."""
    info: dict[str, Any] = field(default_factory=dict)


class AgentEnvConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    entry: str
    """``"package.module:solve"`` or ``"path/to/file.py:solve"``: ``async def solve(client, task)``."""
    model: str
    """The model directory (tokenizer and chat template), the run's ``model.path``."""
    episode_timeout_s: float = Field(300.0, gt=0)
    """Longest an episode may take; past it the trajectory is ``timed_out``."""
    task_data: dict[str, Any] = Field(default_factory=dict)
    """Per-episode data handed to the agent as ``task.data`` (the same for every episode)."""
    task_data_fn: str | None = None
    """``"module:fn"`` / ``"file.py:fn"``: ``fn(seed) -> dict`` makes per-episode data (merged over ``task_data``)."""
    served_model_name: str = "policy"
    tool_parser: str | None = "hermes"
    """vLLM tool-call parser for requests with ``tools`` (None: tools refused)."""
    max_model_len: int | None = Field(None, ge=2)
    default_max_tokens: int = Field(256, ge=1)
    """``max_tokens`` of calls that do not set it."""


def load_callable(spec: str, what: str) -> Callable[..., Any]:
    """``"module:attr"`` or ``"file.py:attr"`` → the callable (ConfigError naming ``what`` otherwise)."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{what}: expected 'module:function' or 'file.py:function', got {spec!r}")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name).resolve()
            name = f"rollart_agent_{path.stem}_{abs(hash(str(path)))}"
            module = sys.modules.get(name)
            if module is None:
                file_spec = importlib.util.spec_from_file_location(name, path)
                if file_spec is None or file_spec.loader is None or not path.is_file():
                    raise ConfigError(f"{what}: no Python file {str(path)!r}")
                module = importlib.util.module_from_spec(file_spec)
                sys.modules[name] = module
                file_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"{what}: cannot import {module_name!r}: {e!r}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"{what}: {module_name!r} has no callable {attr!r}")
    return fn  # type: ignore[no-any-return]


_servers: weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], Any]] = weakref.WeakKeyDictionary()
"""proxy → its in-process OpenAI endpoints (one per endpoint setting), built on first use."""


def _server_for(generator: Any, cfg: AgentEnvConfig) -> Any:
    try:
        from rollart_proxy.server import OpenAIServer
    except ImportError as e:
        raise ConfigError(
            f"agent tasks need rollart-proxy's OpenAI endpoint ({e}): pip install 'rollart-proxy[server]'"
        ) from None
    key = (cfg.model, cfg.served_model_name, cfg.tool_parser, cfg.max_model_len, cfg.default_max_tokens)
    servers = _servers.setdefault(generator, {})
    if key not in servers:
        servers[key] = OpenAIServer(
            generator,
            cfg.model,
            served_model_name=cfg.served_model_name,
            max_model_len=cfg.max_model_len,
            default_max_tokens=cfg.default_max_tokens,
            api_key="",
            admin_key="",
            tool_parser=cfg.tool_parser,
        )
    return servers[key]


class AgentEnv:
    """An environment whose episode an OpenAI-SDK agent runs (``SupportsAgentEpisode``)."""

    Config = AgentEnvConfig
    action_vocabulary = None
    system_prompt = None

    def __init__(self, config: AgentEnvConfig) -> None:
        self.config = config
        self._solve = load_callable(config.entry, "env.options.entry")
        if not inspect.iscoroutinefunction(self._solve):
            raise ConfigError(
                f"env.options.entry: {config.entry!r} must be an async function "
                "(async def solve(client, task))"
            )
        self._make_data = (
            load_callable(config.task_data_fn, "env.options.task_data_fn") if config.task_data_fn else None
        )

    async def run_episode(self, session: AgentSession) -> AgentEpisode:
        import httpx
        import openai

        cfg = self.config
        data = dict(cfg.task_data)
        if self._make_data is not None:
            try:
                data.update(self._make_data(session.seed))
            except Exception as e:
                raise EnvError(f"task_data_fn failed for seed {session.seed}: {e!r}") from e
        task = AgentTask(
            session.seed,
            session.task,
            data,
            cfg.served_model_name,
            session.sampling.max_tokens,
            session.sampling.temperature,
        )
        server = _server_for(session.generator, cfg)
        token = server.bind_session(session.session_id)
        http = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=server.app),
            base_url="http://rollart-proxy",
            timeout=cfg.episode_timeout_s,
        )
        client = openai.AsyncOpenAI(
            base_url="http://rollart-proxy/v1",
            api_key=token,
            http_client=http,
            max_retries=0,
            default_headers={server.session_header: session.session_id, server.task_header: session.task},
        )
        try:
            try:
                result = await asyncio.wait_for(self._solve(client, task), cfg.episode_timeout_s)
            except TimeoutError:
                await _abort_quietly(session)
                raise EnvTimeoutError(
                    f"the agent ran past episode_timeout_s={cfg.episode_timeout_s}"
                ) from None
            except Exception as e:
                refused = server.refused.get(session.session_id, 0)
                if refused:
                    raise EnvError(
                        f"the agent called with another session's id ({refused} calls refused): "
                        f"{type(e).__name__}: {e}"
                    ) from e
                raise EnvError(f"the agent raised {type(e).__name__}: {e}") from e
        finally:
            released = server.release_session(token)
            await client.close()
            await http.aclose()
        if released["refused"]:
            raise EnvError(
                f"the agent called with another session's id ({released['refused']} calls refused)"
            )
        if isinstance(result, str):
            result = AgentResult(answer=result)
        if not isinstance(result, AgentResult):
            raise EnvError(f"the agent returned {type(result).__name__}, not an AgentResult or a str")
        calls = [
            AgentCall(
                r["prompt_ids"],
                r["output_ids"],
                r["logprobs"],
                r["versions"],
                r["finish_reason"],
                r["temperature"] if r.get("temperature") is not None else 1.0,
                tuple(r["allowed_token_ids"]) if r.get("allowed_token_ids") else None,
            )
            for r in released["calls"]
        ]
        return AgentEpisode(calls, result.answer, result.reward, dict(result.info))

    async def close(self) -> None:
        return None


async def _abort_quietly(session: AgentSession) -> None:
    try:
        await session.generator.abort(session.session_id)
    except Exception as e:  # nothing in flight, or the engine went away
        log.debug("abort of %s failed: %r", session.session_id, e)
