"""SGLang prefill/decode disaggregation: one prefill server + one decode server as one worker.

NOT YET RUN AGAINST LIVE SGLANG SERVERS (SGLang does not run on the CPU machines this project is
developed on); written against SGLang's PD protocol, the one its router (``sglang_router``,
``mini_lb``) speaks: the servers are started with ``--disaggregation-mode prefill`` (plus
``--disaggregation-bootstrap-port``) and ``--disaggregation-mode decode``, and
``--disaggregation-transfer-backend mooncake`` (RDMA; ``nixl`` elsewhere). Every request goes to
*both* servers at the same time, with the same three extra fields:

- ``bootstrap_host`` / ``bootstrap_port``: where the prefill server's KV bootstrap listens;
- ``bootstrap_room``: a random 63-bit id that pairs the two halves of this request.

The prefill server computes the prompt's KV and ships it to the decode server, which generates;
the output is the decode server's. :class:`SglangPDEngine` wraps such a pair as one
:class:`~rollart_core.protocols.InferenceEngine`, so the LLMProxy routes, sticks sessions and
retries at the level of pairs; suspend/resume and weight updates cover both servers (the prefill
server first: a request must not be prefilled by newer weights than it is decoded with).
(vLLM engines disaggregate through their KV connectors instead: :mod:`rollart_proxy.pd`.)
"""

from __future__ import annotations

import asyncio
import logging
import random
from urllib.parse import urlparse

from rollart_core.protocols import PauseMode
from rollart_core.types import GenerateOutput, GenerateRequest
from rollart_proxy.engines.sglang_server_engine import SglangServerEngine
from rollart_proxy.errors import WorkerUnavailableError

__all__ = ["SglangPDEngine"]

log = logging.getLogger(__name__)


class SglangPDEngine:
    """A prefill server and a decode server behind one engine interface."""

    def __init__(
        self,
        prefill: SglangServerEngine,
        decode: SglangServerEngine,
        *,
        name: str | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.prefill, self.decode = prefill, decode
        self.name = name or f"{prefill.name}+{decode.name}"
        self._rng = rng or random.SystemRandom()
        self._bootstrap: tuple[str, int] | None = None

    async def start(self) -> str:
        await asyncio.gather(self.prefill.start(), self.decode.start())
        host = urlparse(self.prefill.base).hostname or "127.0.0.1"
        self._bootstrap = (host, await self.prefill.bootstrap_port())
        return self.name

    async def shutdown(self) -> None:
        await asyncio.gather(self.prefill.shutdown(), self.decode.shutdown())

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        if self._bootstrap is None:
            raise WorkerUnavailableError(f"{self.name}: not started")
        host, port = self._bootstrap
        extra = {"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": self._rng.randrange(2**63)}
        pre = asyncio.ensure_future(self.prefill.generate(request, extra))
        dec = asyncio.ensure_future(self.decode.generate(request, extra))
        try:
            done, _ = await asyncio.wait({pre, dec}, return_when=asyncio.FIRST_EXCEPTION)
            if pre in done and pre.exception() is not None and not dec.done():
                # the decode half would wait for KV that never comes: abort it, report the failure
                await asyncio.shield(self._abort_quietly(self.decode, request.request_id))
            out = await dec
            await pre  # the prefill half's errors are not lost
        except BaseException:
            for t in (pre, dec):
                t.cancel()
            await asyncio.gather(pre, dec, return_exceptions=True)
            raise
        out.worker = self.name
        return out

    @staticmethod
    async def _abort_quietly(engine: SglangServerEngine, rid: str) -> None:
        try:
            await engine.abort(rid)
        except Exception as exc:  # the server may be the one that is gone
            log.debug("abort of %s on %s failed: %r", rid, engine.name, exc)

    async def abort(self, request_id: str) -> None:
        await asyncio.gather(self._abort_quietly(self.prefill, request_id), self.decode.abort(request_id))

    async def weight_version(self) -> int:
        return min(await self.prefill.weight_version(), await self.decode.weight_version())

    async def pause(self, mode: PauseMode = "keep") -> None:
        await asyncio.gather(self.prefill.pause(mode), self.decode.pause(mode))

    async def resume(self) -> None:
        await asyncio.gather(self.prefill.resume(), self.decode.resume())

    async def update_weights(self, version: int) -> float:
        """Both halves to ``version`` while both are suspended (retract: KV recomputed on resume)."""
        own = not (self.prefill._paused and self.decode._paused)
        if own:
            await self.pause("keep")
        try:
            paused = await asyncio.gather(
                self.prefill.update_weights(version), self.decode.update_weights(version)
            )
        finally:
            if own:
                await self.resume()
        return max(paused)

    async def get_stats(self) -> dict[str, object]:
        pre, dec = await asyncio.gather(self.prefill.get_stats(), self.decode.get_stats())
        return {"prefill": pre, "decode": dec}
