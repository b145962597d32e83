"""Agent tasks: train any agent written against the OpenAI or the Anthropic SDK.

``env: {impl: agent, options: {entry: "my_pkg.agent:solve", model: <model dir>, episode_timeout_s: 60}}``
with::

    async def solve(client: openai.AsyncOpenAI, task: AgentTask) -> AgentResult | str: ...

(Chat Completions or Responses: ``client.chat.completions`` / ``client.responses``), or with
``sdk: anthropic``::

    async def solve(client: anthropic.AsyncAnthropic, task: AgentTask) -> AgentResult | str: ...

(Messages: ``client.messages``). Every dialect reaches the same endpoint, sessions and recording.

Per trajectory the agent gets a client bound to the trajectory's session on the proxy's
OpenAI-compatible endpoint:

- in-process (default): an ``httpx.ASGITransport`` over :class:`rollart_proxy.server.OpenAIServer`'s
  FastAPI app wrapping the run's own proxy (no socket);
- over HTTP (``base_url``, e.g. ``http://127.0.0.1:8000/v1``): an endpoint serving the run's engines;
  the env asks it for a token bound to the session (``POST /v1/sessions/{id}/bind`` with the API key
  from ``api_key`` or the ``api_key_env`` variable) and takes the session's records back with
  ``POST /v1/sessions/{id}/release``.

Every call it makes is recorded with the exact engine ids, logprobs and versions; the runner
(:func:`rollart_core.control.runner.run_agent_trajectory`) turns them into the trajectory's turns.

Failures, as fates: the agent raises → ``env_failed`` with the error; runs past
``episode_timeout_s`` → ``timed_out`` (its in-flight request is aborted); makes no model call →
``env_failed``; calls with another session's id → refused by the proxy (403), ``env_failed``.

The agent runs in the control process (the proxy lives there); an ``env_manager`` cannot lease it.
Needs ``pip install 'rollart-env[agent]'`` (the ``openai`` SDK and rollart-proxy's endpoint), and
``pip install anthropic`` for ``sdk: anthropic``.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import logging
import os
import sys
import weakref
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from rollart_core.errors import ConfigError, EnvError, EnvTimeoutError
from rollart_core.extras import require
from rollart_core.protocols import AgentCall, AgentEpisode, AgentSession

__all__ = ["AgentEnv", "AgentEnvConfig", "AgentResult", "AgentTask", "load_callable"]

log = logging.getLogger(__name__)
INSTALL = "pip install 'rollart-env[agent]'"


@dataclass(slots=True)
class AgentTask:
    """One episode's task, as the agent sees it."""

    seed: int
    task: str
    """The task's name in the run config."""
    data: dict[str, Any] = field(default_factory=dict)
    """Per-episode data: the options' ``task_data``, updated with what ``task_data_fn(seed)`` makes."""
    model: str = "policy"
    """The model name to pass as ``model=`` (``client.chat.completions.create``, ``client.responses.create``,
    ``client.messages.create``)."""
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
    """The model directory (tokenizer and chat template), the run's ``model.path``; left out of a run
    config, the run fills it in (``check_tasks``)."""
    episode_timeout_s: float = Field(300.0, gt=0)
    """Longest an episode may take; past it the trajectory is ``timed_out``."""
    task_data: dict[str, Any] = Field(default_factory=dict)
    """Per-episode data handed to the agent as ``task.data`` (the same for every episode)."""
    task_data_fn: str | None = None
    """``"module:fn"`` / ``"file.py:fn"``: ``fn(seed) -> dict`` makes per-episode data (merged over ``task_data``)."""
    sdk: Literal["openai", "anthropic"] = "openai"
    """The client the agent gets: ``openai.AsyncOpenAI`` (Chat Completions, Responses) or
    ``anthropic.AsyncAnthropic`` (Messages)."""
    served_model_name: str = "policy"
    """The model name of the in-process endpoint (over HTTP: the server's, as its bind answers)."""
    tool_parser: str | None = "hermes"
    """vLLM tool-call parser for requests with ``tools`` (None: tools refused)."""
    max_model_len: int | None = Field(None, ge=2)
    default_max_tokens: int = Field(256, ge=1)
    """``max_tokens`` of calls that do not set it."""
    base_url: str | None = None
    """The OpenAI endpoint over HTTP (``http://host:port/v1``) of a rollart-proxy server serving the
    run's engines; None: the run's own proxy in-process (no socket). Over HTTP the endpoint settings
    above (``served_model_name`` … ``default_max_tokens``) are the server's own."""
    api_key: SecretStr | None = None
    """The server's API key (``base_url`` only); None: read from the ``api_key_env`` variable. Prefer
    the variable: a config file is easily shared."""
    api_key_env: str = "ROLLART_PROXY_API_KEY"
    """Environment variable holding the API key when ``api_key`` is not set (unset or empty: none)."""

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be an http:// or https:// URL, got {v!r}")
        return v.rstrip("/") if v is not None else None

    def key(self) -> str:
        """The API key for ``base_url`` ('' when none)."""
        if self.api_key is not None:
            return self.api_key.get_secret_value()
        return os.environ.get(self.api_key_env, "")


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
    return fn


_servers: weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], Any]] = weakref.WeakKeyDictionary()
"""proxy → its in-process OpenAI endpoints (one per endpoint setting), built on first use."""


def _server_for(generator: Any, cfg: AgentEnvConfig) -> Any:
    OpenAIServer = require("rollart_proxy.server", INSTALL).OpenAIServer
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

    @classmethod
    def check_config(cls, config: AgentEnvConfig) -> None:
        """The agent's code imports and is async, ``task_data_fn`` imports, the extras are installed
        (``SupportsConfigCheck``): what building the env checks, before a run starts anything."""
        cls(config)

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
        # a missing extra fails when the env is built (before a run starts), not in every episode
        self._openai = require("openai", INSTALL)
        self._anthropic = require("anthropic", "pip install anthropic") if config.sdk == "anthropic" else None
        self._httpx = require("httpx", INSTALL)
        # the HTTP package the agent's SDK takes clients of (anthropic 2.x ships its own fork, httpx2)
        self._sdk_httpx = self._httpx
        if self._anthropic is not None:
            sdk_client = self._anthropic.DefaultAsyncHttpxClient.__mro__[1]
            self._sdk_httpx = importlib.import_module(sdk_client.__module__.split(".")[0])
        if config.base_url is None:  # the endpoint in-process
            for module in ("fastapi", "jinja2", "jsonschema", "rollart_proxy.server"):
                require(module, INSTALL)

    async def run_episode(self, session: AgentSession) -> AgentEpisode:
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
        connect = self._over_http if cfg.base_url is not None else self._in_process
        error: Exception | None = None
        result: Any = None
        async with connect(session) as (client, binding):
            task.model = binding.model
            try:
                async with asyncio.timeout(cfg.episode_timeout_s):  # not wait_for (3.11 cancellation)
                    result = await self._solve(client, task)
            except TimeoutError:
                await binding.abort()
                error = EnvTimeoutError(f"the agent ran past episode_timeout_s={cfg.episode_timeout_s}")
            except asyncio.CancelledError:  # redundant or too stale: free the engine's slot too
                await asyncio.shield(binding.abort())
                raise
            except Exception as e:
                error = e
        refused = binding.released["refused"]
        if refused:  # even an agent that swallowed the 403 does not get its trajectory trained
            why = f": {type(error).__name__}: {error}" if error is not None else ""
            raise EnvError(f"the agent called with another session's id ({refused} calls refused){why}")
        if isinstance(error, EnvTimeoutError):
            raise error
        if error is not None:
            raise EnvError(f"the agent raised {type(error).__name__}: {error}") from error
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
            for r in binding.released["calls"]
        ]
        return AgentEpisode(calls, result.answer, result.reward, dict(result.info))

    async def close(self) -> None:
        return None

    def _client(self, base_url: str, token: str, http: Any, headers: dict[str, str]) -> Any:
        """The agent's SDK client on the endpoint at ``base_url`` (``.../v1``); never retries (a retried
        call would be a second, unrecorded sample)."""
        if self._anthropic is not None:  # its SDK adds /v1/messages to the root itself
            root = base_url.removesuffix("/v1")
            return self._anthropic.AsyncAnthropic(
                base_url=root, api_key=token, http_client=http, max_retries=0, default_headers=headers
            )
        return self._openai.AsyncOpenAI(
            base_url=base_url, api_key=token, http_client=http, max_retries=0, default_headers=headers
        )

    @asynccontextmanager
    async def _in_process(self, session: AgentSession) -> AsyncIterator[tuple[Any, _Binding]]:
        """A client on the run's own proxy through the endpoint's app in-process (no socket)."""
        server = _server_for(session.generator, self.config)
        token = server.bind_session(session.session_id)
        binding = _InProcessBinding(server, token, session)
        http = self._sdk_httpx.AsyncClient(
            transport=self._sdk_httpx.ASGITransport(app=server.app),
            base_url="http://rollart-proxy",
            timeout=self.config.episode_timeout_s,
        )
        client = self._client(
            "http://rollart-proxy/v1",
            token,
            http,
            {server.session_header: session.session_id, server.task_header: session.task},
        )
        try:
            yield client, binding
        finally:
            binding.released = server.release_session(token)
            await client.close()
            await http.aclose()

    @asynccontextmanager
    async def _over_http(self, session: AgentSession) -> AsyncIterator[tuple[Any, _Binding]]:
        """A client on the endpoint at ``base_url``, with a token bound to the session over HTTP."""
        cfg = self.config
        assert cfg.base_url is not None  # the caller chose this path for it
        key = cfg.key()
        control = self._httpx.AsyncClient(
            base_url=cfg.base_url,
            timeout=30.0,
            trust_env=False,  # rollart's endpoints are reached directly, never through a proxy
            headers={"Authorization": f"Bearer {key}"} if key else {},
        )
        http: Any = None
        client: Any = None
        try:
            bound = await _post(control, f"/sessions/{session.session_id}/bind", {})
            binding = _HttpBinding(control, session.session_id, bound["token"], bound["model"])
            http = self._sdk_httpx.AsyncClient(timeout=cfg.episode_timeout_s, trust_env=False)
            client = self._client(
                cfg.base_url,
                bound["token"],
                http,
                {bound["session_header"]: session.session_id, bound["task_header"]: session.task},
            )
            release = f"/sessions/{session.session_id}/release"
            try:
                yield client, binding
            except BaseException:  # cancelled: end the session, but let the cancellation through
                try:
                    await _post(control, release, {"token": bound["token"]})
                except EnvError as e:
                    log.warning("releasing session %s failed: %s", session.session_id, e)
                raise
            binding.released = await _post(control, release, {"token": bound["token"]})
        finally:
            if client is not None:
                await client.close()
            if http is not None:
                await http.aclose()
            await control.aclose()


class _Binding(Protocol):
    """A session-bound client's handle: abort its in-flight request; its records and refusals
    (``released``) once the context that made it has exited."""

    released: dict[str, Any]
    model: str
    """The endpoint's model name (what the agent passes as ``model``)."""

    async def abort(self) -> None: ...


class _InProcessBinding:
    def __init__(self, server: Any, token: str, session: AgentSession) -> None:
        self.server, self.token, self.session = server, token, session
        self.model = server.model_name
        self.released = {"calls": [], "refused": 0}

    async def abort(self) -> None:
        try:
            await self.session.generator.abort(self.session.session_id)
        except Exception as e:  # nothing in flight, or the engine went away
            log.debug("abort of %s failed: %r", self.session.session_id, e)


class _HttpBinding:
    def __init__(self, control: Any, session_id: str, token: str, model: str) -> None:
        self.control, self.session_id, self.token, self.model = control, session_id, token, model
        self.released = {"calls": [], "refused": 0}

    async def abort(self) -> None:
        try:
            await _post(self.control, f"/sessions/{self.session_id}/abort", {})
        except EnvError as e:  # nothing in flight, or the server went away
            log.debug("abort of %s failed: %r", self.session_id, e)


async def _post(control: Any, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """A session-control call to the endpoint; an HTTP failure is the episode's (EnvError)."""
    try:
        r = await control.post(path, json=body)
    except Exception as e:
        raise EnvError(f"agent endpoint {control.base_url}{path}: {type(e).__name__}: {e}") from e
    if r.status_code != 200:
        raise EnvError(f"agent endpoint {control.base_url}{path}: {r.status_code} {r.text[:300]}")
    return r.json()
