"""Make an engine living in a Ray actor look like a local :class:`InferenceEngine`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from rollart_core.errors import EngineError
from rollart_core.protocols import PauseMode
from rollart_core.types import GenerateOutput, GenerateRequest
from rollart_proxy.errors import WorkerUnavailableError

__all__ = ["RayActorEngine"]


class RayActorEngine:
    """Forwards every call to ``handle.<method>.remote(...)``; request errors keep their type. A dead,
    restarting or unreachable actor raises :class:`WorkerUnavailableError` naming the worker."""

    def __init__(self, handle: Any, name: str) -> None:
        self.handle = handle
        self.name = name

    async def _call(self, method: str, *args: Any) -> Any:
        from ray.exceptions import RayActorError, RayTaskError, WorkerCrashedError

        try:
            return await getattr(self.handle, method).remote(*args)
        except RayTaskError as exc:
            _reraise_engine_error(exc)
            raise
        except (RayActorError, WorkerCrashedError) as exc:
            raise WorkerUnavailableError(
                f"worker {self.name}: actor unavailable during {method}: {type(exc).__name__}"
            ) from exc

    async def start(self) -> str:
        return await self._call("start")

    async def pid(self) -> int:
        return await self._call("pid")

    async def restart(self) -> None:
        """Kill the actor's process so that Ray restarts it (within the actor's ``max_restarts``): the
        proxy then starts it and brings it to the served weights. An engine whose weight update failed
        half-way is never trusted again as it is."""
        import ray

        ray.kill(self.handle, no_restart=False)

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        return await self._call("generate", request)

    async def generate_stream(self, request: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        """Streams through a Ray streaming generator when the actor has ``generate_stream``;
        otherwise yields the complete output only."""
        from ray.exceptions import RayActorError, RayTaskError, WorkerCrashedError

        method = getattr(self.handle, "generate_stream", None)
        if method is None:
            yield await self.generate(request)
            return
        refs = method.options(num_returns="streaming").remote(request)
        try:
            async for ref in refs:
                yield await ref
        except RayTaskError as exc:
            _reraise_engine_error(exc)
            raise
        except (RayActorError, WorkerCrashedError) as exc:
            raise WorkerUnavailableError(
                f"worker {self.name}: actor unavailable mid-stream: {type(exc).__name__}"
            ) from exc

    async def abort(self, request_id: str) -> None:
        await self._call("abort", request_id)

    async def weight_version(self) -> int:
        return await self._call("weight_version")

    async def pause(self, mode: PauseMode = "keep") -> None:
        await self._call("pause", mode)

    async def resume(self) -> None:
        await self._call("resume")

    async def update_weights(self, version: int) -> float:
        return await self._call("update_weights", version)

    async def prefetch_weights(self, version: int) -> None:
        return await self._call("prefetch_weights", version)

    async def read_parameter(self, name: str) -> tuple[list[int], str, bytes]:
        return await self._call("read_parameter", name)

    async def get_stats(self) -> dict[str, Any]:
        return await self._call("get_stats")

    async def progress(self) -> dict[str, int]:
        return await self._call("progress")


def _reraise_engine_error(exc: Any) -> None:
    """Request errors keep their type across the actor boundary (WorkerUnavailableError is retried)."""
    if isinstance(exc.cause, EngineError):
        raise type(exc.cause)(str(exc.cause)) from None
