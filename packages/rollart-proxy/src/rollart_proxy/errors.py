"""Errors of the proxy plane: a bad request versus a worker that cannot serve.

:class:`~rollart_core.errors.EngineError` means the request itself was rejected (bad sampling
parameters, prompt too long, unknown token ids): retrying it elsewhere would fail the same way.
:class:`WorkerUnavailableError` means the worker failed (died, unreachable, shut down): the proxy
retries the request on another worker of the same pool. :class:`EngineNotStartedError` is the
worker that answers but was never started (an engine actor Ray restarted: ``__init__`` ran again,
``start()`` did not): the proxy starts it and brings it to the served weights before it serves.
:class:`ProxyOverloadedError` means every worker's queue is full (HTTP 429): back off and retry.
"""

from __future__ import annotations

from rollart_core.errors import EngineError

__all__ = ["EngineNotStartedError", "ProxyOverloadedError", "WorkerUnavailableError"]


class WorkerUnavailableError(EngineError):
    """A worker could not serve a request (dead, unreachable, shutting down): retryable elsewhere."""


class EngineNotStartedError(WorkerUnavailableError):
    """The engine answers but was never started in its process (e.g. an actor restarted by Ray)."""


class ProxyOverloadedError(EngineError):
    """Every candidate worker's in-flight slots and wait queue are full: the request is refused."""
