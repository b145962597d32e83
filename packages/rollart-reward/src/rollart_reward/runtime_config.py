"""The function runtime's configuration: scaling, fault injection and serving options
(:class:`RuntimeConfig`), and the environment variables ``rollart-reward serve`` reads its keys from."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["ADMIN_KEY_ENV", "API_KEY_ENV", "FaultConfig", "RuntimeConfig", "ScalingConfig"]

API_KEY_ENV = "ROLLART_REWARD_API_KEY"
"""Environment variable ``rollart-reward serve`` reads its bearer token from (keeps it out of ``ps``)."""
ADMIN_KEY_ENV = "ROLLART_REWARD_ADMIN_KEY"
"""Environment variable ``rollart-reward serve`` reads its admin token from."""


class FaultConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    seed: int = 0
    error_before: float = Field(0.0, ge=0, le=1)
    """Rate of 503 answers before the function runs."""
    error_after: float = Field(0.0, ge=0, le=1)
    """Rate of 503 answers after the function ran (its result is cached): tests idempotency."""
    delay: float = Field(0.0, ge=0, le=1)
    """Rate of responses held back by ``delay_s`` (client timeouts)."""
    delay_s: float = Field(2.0, ge=0)
    malformed: float = Field(0.0, ge=0, le=1)
    """Rate of 200 answers whose body is not JSON."""


class ScalingConfig(BaseModel):
    """How the runtime scales and what it accepts: the part of :class:`RuntimeConfig` a caller that
    starts the runtime itself (the ``serverless`` reward executor) sets."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    min_workers: int = Field(0, ge=0)
    max_workers: int = Field(8, ge=1)
    idle_timeout_s: float = Field(2.0, gt=0)
    """Keep-alive of an idle worker before it is stopped (down to ``min_workers``); see ``idle_policy``."""
    idle_policy: Literal["fixed", "ski_rental", "learned"] = "learned"
    """``fixed``: exactly ``idle_timeout_s``. ``ski_rental``: at least as long as a cold start currently
    costs (moving average), so stopping never costs more than twice the best choice in hindsight.
    ``learned``: at most the ski-rental keep-alive, chosen from the last idle periods (how long idle
    workers waited for their next call, or that they never got one) to minimise provisioned time
    (idle keep-alive plus the cold starts it causes), as in "Serverless in the Wild" (ATC'20); one
    idle period in eight still uses the ski-rental keep-alive, so longer gaps stay observable."""
    call_timeout_s: float = Field(60.0, gt=0)
    """A call running longer kills its worker and fails (504)."""
    max_queue: int = Field(10_000, ge=1)
    """More waiting calls than this are refused with 429."""
    cache_size: int = Field(100_000, ge=0)
    """Idempotency cache entries (results and execution counts by key)."""
    max_body_bytes: int = Field(16 << 20, ge=1024)
    """Larger request bodies are refused with 413."""
    body_timeout_s: float = Field(30.0, gt=0)
    """A request body not received within this is refused with 408 (a client that declares a body
    and never sends it holds no handler)."""
    max_batch: int = Field(1024, ge=1)
    """Most items in one ``{"items": [...]}`` request (more: 413)."""
    max_async_tasks: int = Field(10_000, ge=1)
    """Async (Event / FC Async) calls held at once, running or finished and not yet forgotten; a new
    one beyond this is refused with 429. Finished ones are forgotten oldest first."""
    faults: FaultConfig = FaultConfig()
    """Fault injection (tests, chaos runs): seeded 503s before/after running, held-back responses
    (client timeouts), malformed bodies. All rates 0 by default: no faults."""


class RuntimeConfig(ScalingConfig):
    function: str = "success"
    """Reward function name (``rollart.reward`` entry point) or ``package.module:Class``."""
    options: dict[str, Any] = Field(default_factory=dict)
    """The function's own config."""
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535)
    """0 picks a free port."""
    api_key: str | None = Field(None, repr=False, min_length=1)
    """Bearer token every request except ``GET /healthz`` must carry (``Authorization: Bearer ...``);
    None = no token (a warning when bound beyond loopback)."""
    admin: bool = False
    """Enable ``/admin/*`` (fault knobs, stats reset) without an admin key: for tests only, on a
    loopback bind without ``api_key`` (otherwise set ``admin_key``)."""
    admin_key: str | None = Field(None, repr=False, min_length=1)
    """Bearer token of ``/admin/*``, apart from ``api_key`` (which never opens them); setting it
    enables them. Must differ from ``api_key``."""

    @model_validator(mode="after")
    def _admin_apart(self) -> RuntimeConfig:
        if self.admin_key is not None and self.admin_key == self.api_key:
            raise ValueError("admin_key must differ from api_key (an invoke key never opens /admin/*)")
        return self

    @property
    def admin_enabled(self) -> bool:
        return self.admin or self.admin_key is not None
