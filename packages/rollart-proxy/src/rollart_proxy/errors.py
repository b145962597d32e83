"""Errors of the proxy plane: a bad request versus a worker that cannot serve.

:class:`~rollart_core.errors.EngineError` means the request itself was rejected (bad sampling
parameters, prompt too long, unknown token ids): retrying it elsewhere would fail the same way.
:class:`WorkerUnavailableError` means the worker failed (died, unreachable, shut down): the proxy
retries the request on another worker of the same pool.
"""

from __future__ import annotations

from rollart_core.errors import EngineError

__all__ = ["WorkerUnavailableError"]


class WorkerUnavailableError(EngineError):
    """A worker could not serve a request (dead, unreachable, shutting down): retryable elsewhere."""
