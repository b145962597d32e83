"""Request bodies of the OpenAI-compatible endpoint (pydantic, ``extra="forbid"``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator

from rollart_core.serving import INT64_MAX, INT64_MIN
from rollart_proxy.server.tools import tools_key

INT32_MAX = 2**31 - 1
"""Bound of the counts engines take as 32-bit integers (``max_tokens``, ``top_k``)."""

__all__ = ["ChatBody", "ChatMessage", "CompletionBody", "ReleaseBody", "UpdateWeightsBody"]


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, le=INT32_MAX)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    """A signed 64-bit integer, as vLLM's own server bounds it (a larger one breaks the engine)."""
    stream: bool = False
    n: int = Field(
        1,
        ge=1,
        description="n > 1 (without a session header): n samples of the prompt, recorded as n sibling "
        "trajectories of one group (at most the server's max_n).",
    )
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    presence_penalty: float = Field(0.0, ge=0.0, le=0.0)
    frequency_penalty: float = Field(0.0, ge=0.0, le=0.0)
    stream_options: dict[str, Any] | None = None
    user: str | None = None
    metadata: dict[str, Any] | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        for s in [v] if isinstance(v, str) else v or []:
            if not s:
                raise ValueError("stop strings must be non-empty")
        return v

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class CompletionBody(_Common):
    prompt: str | list[int] | list[str]
    logprobs: int | None = Field(None, ge=0, le=0, description="Only the sampled token's logprob (0).")
    echo: bool = Field(False, description="Not supported (must be false).")

    @field_validator("echo")
    @classmethod
    def _echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported")
        return v


class _FunctionIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    arguments: str


class _ToolCallIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    type: Literal["function"] = "function"
    function: _FunctionIn


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[_ToolCallIn] | None = None
    tool_call_id: str | None = None
    # what SDKs send back when an agent appends the reply's message object as it is (ignored)
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for p in self.content:
            if p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise ValueError(f"only text content parts are supported, got {p.get('type')!r}")
            parts.append(p["text"])
        return "".join(parts)


class ChatBody(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=0, description="Only the sampled token (0).")
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    _tools_key: str | None = PrivateAttr(None)

    def tools_active(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    def tools_key(self) -> str:
        """``tools_key(tools, tool_choice)``, computed once per request (what the caches are keyed by)."""
        if self._tools_key is None:
            self._tools_key = tools_key(self.tools, self.tool_choice)
        return self._tools_key


class UpdateWeightsBody(BaseModel):
    """``POST /admin/update_weights``. At module level: with postponed annotations FastAPI resolves the
    handler's annotation in the handler's module namespace, so :mod:`.app` imports every body model at
    module level (a class local to ``_build`` made the route's body model unresolvable and
    ``app.openapi()`` raise)."""

    model_config = ConfigDict(extra="forbid")
    version: int = Field(ge=0)


class ReleaseBody(BaseModel):
    """``POST /v1/sessions/{id}/release``: the session-bound token to revoke."""

    model_config = ConfigDict(extra="forbid")
    token: str = Field(min_length=1, max_length=200)


def _message_dict(m: ChatMessage) -> dict[str, Any]:
    """A request message as the chat template and :func:`message_key` see it."""
    d: dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.name:
        d["name"] = m.name
    if m.tool_calls:
        d["tool_calls"] = [c.model_dump() for c in m.tool_calls]
    if m.tool_call_id is not None:
        d["tool_call_id"] = m.tool_call_id
    return d
