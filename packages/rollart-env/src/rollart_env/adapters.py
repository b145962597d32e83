"""Adapters: any gymnasium environment (through a text wrapper) and GEM-style text environments.

``GymnasiumEnv`` makes ``gymnasium.make(env_id, **make_kwargs)`` text in / text out: observations
become text (the ``ansi`` rendering when available, else ``str(obs)``), and a reply becomes an
action of a ``Discrete`` space by name (``action_names``) or by index. A different mapping is a
:class:`TextWrapper` given as ``"package.module:Class"``. Needs ``pip install 'rollart-env[gym]'``.

``GemEnv`` adapts GEM's API (``reset(seed) -> (obs: str, info)``, ``step(action: str) -> (obs,
reward, terminated, truncated, info)``, both synchronous): an env made by ``gem.make(env_id)``
(``pip install gem-llm``) or by any factory at ``"package.module:callable"``.

Both call the synchronous environment inline (cheap steps) or, with ``threaded: true``, in a worker
thread so that a slow step does not block the other environments sharing the event loop.
"""

from __future__ import annotations

import asyncio
import importlib
import re
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rollart_core.errors import ConfigError
from rollart_core.extras import require
from rollart_core.types import StepResult

__all__ = ["DiscreteTextWrapper", "GemConfig", "GemEnv", "GymnasiumConfig", "GymnasiumEnv", "TextWrapper"]

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _load(path: str, what: str) -> Any:
    module, _, attr = path.partition(":")
    if not module or not attr:
        raise ConfigError(f"{what} must be 'package.module:name', got {path!r}")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"cannot load {what} {path!r}: {exc}") from None


async def _call(threaded: bool, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    if threaded:
        return await asyncio.to_thread(fn, *args, **kwargs)
    return fn(*args, **kwargs)


@runtime_checkable
class TextWrapper(Protocol):
    """Maps a gymnasium env's observations to text and replies to actions."""

    def observation_text(self, env: Any, observation: Any) -> str: ...

    def action(self, env: Any, text: str) -> Any | None:
        """The action for ``text``, or None if it does not parse."""
        ...


class DiscreteTextWrapper:
    """Text = the ``ansi`` rendering (escape codes stripped) or ``str(obs)``; actions by name or index."""

    def __init__(self, action_names: Sequence[str] | None) -> None:
        self.action_names = [a.lower() for a in action_names] if action_names else None

    def observation_text(self, env: Any, observation: Any) -> str:
        if getattr(env, "render_mode", None) == "ansi":
            text = env.render()
            if isinstance(text, str) and text.strip():
                return _ANSI.sub("", text).strip("\n")
        return str(observation)

    def action(self, env: Any, text: str) -> int | None:
        word = text.strip().strip("`'\".").lower()
        n = int(env.action_space.n)
        if self.action_names is not None and word in self.action_names:
            return self.action_names.index(word)
        if word.lstrip("-").isdigit() and 0 <= int(word) < n:
            return int(word)
        return None


class GymnasiumConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    env_id: str
    """A registered gymnasium id, e.g. ``FrozenLake-v1``."""
    make_kwargs: dict[str, Any] = Field(default_factory=dict)
    render_mode: Literal["ansi"] | None = "ansi"
    """``ansi`` uses the text rendering as the observation where the env has one."""
    action_names: list[str] | None = None
    """Names of the Discrete actions in order, e.g. ``[L, D, R, U]``; also the action vocabulary."""
    wrapper: str | None = None
    """A :class:`TextWrapper` as ``package.module:Class`` (constructed with no arguments)."""
    system_prompt: str | None = None
    max_steps: int | None = Field(None, ge=1)
    """Truncate after this many steps (in addition to the env's own time limit)."""
    format_penalty: float = -0.1
    threaded: bool = False


class GymnasiumEnv:
    """A gymnasium env, text in and text out."""

    Config = GymnasiumConfig

    def __init__(self, config: GymnasiumConfig) -> None:
        self.config = config
        gym = require("gymnasium", "pip install 'rollart-env[gym]'")
        kwargs = dict(config.make_kwargs)
        if config.render_mode is not None:
            kwargs.setdefault("render_mode", config.render_mode)
        try:
            self.env = gym.make(config.env_id, **kwargs)
        except gym.error.Error as exc:
            raise ConfigError(f"gymnasium cannot make {config.env_id!r}: {exc}") from None
        if config.wrapper is not None:
            self.wrapper: TextWrapper = _load(config.wrapper, "wrapper")()
        else:
            if not isinstance(self.env.action_space, gym.spaces.Discrete):
                raise ConfigError(
                    f"{config.env_id}: the default text wrapper needs a Discrete action space, "
                    f"got {self.env.action_space}; give a TextWrapper in 'wrapper'"
                )
            if config.action_names is not None and len(config.action_names) != self.env.action_space.n:
                raise ConfigError(
                    f"action_names has {len(config.action_names)} names for {self.env.action_space.n} actions"
                )
            self.wrapper = DiscreteTextWrapper(config.action_names)
        self.action_vocabulary = tuple(config.action_names) if config.action_names else None
        self.system_prompt = config.system_prompt
        self.steps = 0
        self._last_text = ""

    async def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        obs, info = await _call(self.config.threaded, self.env.reset, seed=seed)
        self.steps = 0
        self._last_text = self.wrapper.observation_text(self.env, obs)
        return self._last_text, dict(info)

    async def step(self, action_text: str) -> StepResult:
        self.steps += 1
        limit = self.config.max_steps
        truncated_here = limit is not None and self.steps >= limit
        action = self.wrapper.action(self.env, action_text)
        if action is None:
            names = ", ".join(self.config.action_names or [])
            hint = f" reply with one of: {names}" if names else ""
            return StepResult(
                f"Invalid action {action_text.strip()[:20]!r};{hint}\n{self._last_text}",
                self.config.format_penalty,
                False,
                truncated_here,
                {"invalid": True},
            )
        obs, reward, terminated, truncated, info = await _call(self.config.threaded, self.env.step, action)
        self._last_text = self.wrapper.observation_text(self.env, obs)
        terminated = bool(terminated)
        return StepResult(
            self._last_text,
            float(reward),
            terminated,
            (bool(truncated) or truncated_here) and not terminated,
            dict(info),
        )

    async def close(self) -> None:
        self.env.close()


class GemConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    env_id: str | None = None
    """A GEM id for ``gem.make``, e.g. ``game:GuessTheNumber-v0`` (needs ``pip install gem-llm``)."""
    factory: str | None = None
    """Or any callable returning a GEM-style env, as ``package.module:callable``."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    system_prompt: str | None = None
    action_vocabulary: list[str] | None = None
    threaded: bool = False

    @model_validator(mode="after")
    def _one_source(self) -> GemConfig:
        if (self.env_id is None) == (self.factory is None):
            raise ValueError("give exactly one of env_id (gem.make) or factory")
        return self


class GemEnv:
    """A GEM-style (synchronous, text) environment behind the async Environment protocol."""

    Config = GemConfig

    def __init__(self, config: GemConfig, *, env: Any | None = None) -> None:
        self.config = config
        if env is not None:
            self.env = env
        elif config.factory is not None:
            self.env = _load(config.factory, "factory")(**config.kwargs)
        else:
            gem = require("gem", "pip install gem-llm")
            self.env = gem.make(config.env_id, **config.kwargs)
        self.action_vocabulary = tuple(config.action_vocabulary) if config.action_vocabulary else None
        self.system_prompt = config.system_prompt

    async def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        obs, info = await _call(self.config.threaded, self.env.reset, seed=seed)
        return str(obs), dict(info or {})

    async def step(self, action_text: str) -> StepResult:
        obs, reward, terminated, truncated, info = await _call(
            self.config.threaded, self.env.step, action_text
        )
        return StepResult(
            str(obs), float(reward), bool(terminated), bool(truncated) and not terminated, dict(info or {})
        )

    async def close(self) -> None:
        close = getattr(self.env, "close", None)
        if callable(close):
            await _call(self.config.threaded, close)
