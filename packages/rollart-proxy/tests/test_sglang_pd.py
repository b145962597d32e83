"""SglangPDEngine against FAKE SGLang servers (SGLang cannot run on these CPU machines): two small
HTTP servers on 127.0.0.1 that speak the part of SGLang's API the pair uses and check the PD
protocol: both halves of a request arrive at the same time with the same bootstrap host, port and
room; the decode half finishes only after the prefill half arrived (the KV handoff); the output is
the decode server's; weight updates reach both servers; a failed prefill does not hang the decode."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from fastapi import FastAPI, Request  # rollart-proxy[server]; the workspace's cpu extra installs it
from fastapi.responses import JSONResponse, StreamingResponse

from rollart_core.types import GenerateRequest, SamplingParams


class FakeSglangServer:
    """NOT SGLang: a stand-in that records requests and answers in SGLang's shapes."""

    def __init__(self, role: str, rooms: dict[int, asyncio.Event], bootstrap_port: int = 8998) -> None:
        self.role, self.rooms, self.requests, self.calls = role, rooms, [], []
        self.fail_generate = False
        self.aborted: dict[str, asyncio.Event] = {}
        app = FastAPI()

        @app.get("/health")
        async def health() -> dict[str, Any]:
            return {}

        @app.get("/get_model_info")
        async def model_info() -> dict[str, Any]:
            return {"model_path": "fake"}

        @app.get("/get_server_info")
        async def server_info() -> dict[str, Any]:
            return {"disaggregation_bootstrap_port": bootstrap_port} if role == "prefill" else {}

        @app.post("/{path}")
        async def control(path: str, request: Request) -> Any:
            body = json.loads(await request.body() or b"{}")
            self.calls.append((path, body))
            if path == "abort_request":
                self.aborted.setdefault(body["rid"], asyncio.Event()).set()
            if path != "generate":
                return {"success": True}
            self.requests.append(body)
            if self.fail_generate:
                return JSONResponse({"error": {"message": "prefill died"}}, status_code=503)
            event = rooms.setdefault(body["bootstrap_room"], asyncio.Event())
            aborted = self.aborted.setdefault(body["rid"], asyncio.Event())
            if role == "prefill":
                event.set()
            else:  # decode needs the prefill's KV (or an abort)
                waits = [asyncio.ensure_future(e.wait()) for e in (event, aborted)]
                await asyncio.wait(waits, timeout=10, return_when=asyncio.FIRST_COMPLETED)
                for w in waits:
                    w.cancel()
                if not event.is_set():
                    raise RuntimeError("decode half got no KV: the pair must abort it")

            async def sse():
                n = body["sampling_params"]["max_new_tokens"] if role == "decode" else 1
                toks = [[-0.5, 100 + i, "x"] for i in range(n)]
                meta = {
                    "output_token_logprobs": toks,
                    "completion_tokens": n,
                    "weight_version": "0",
                    "finish_reason": {"type": "length"},
                    "cached_tokens": 0,
                }
                yield f"data: {json.dumps({'meta_info': meta})}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(sse(), media_type="text/event-stream")

        self.app = app

    async def start(self) -> str:
        import uvicorn

        self.server = uvicorn.Server(
            uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
        )
        self.task = asyncio.create_task(self.server.serve())
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or self.task.done():
                raise RuntimeError("fake server did not start")
            await asyncio.sleep(0.01)
        return f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        self.server.should_exit = True
        await asyncio.wait_for(self.task, 30)


async def test_sglang_pd_pair_speaks_the_bootstrap_protocol(tmp_path) -> None:
    from rollart_proxy import LLMProxy, WorkerHandle
    from rollart_proxy.engines.sglang_server_engine import SglangServerEngine
    from rollart_proxy.errors import WorkerUnavailableError
    from rollart_proxy.sglang_pd import SglangPDEngine

    rooms: dict[int, asyncio.Event] = {}
    pre_srv, dec_srv = FakeSglangServer("prefill", rooms, 8998), FakeSglangServer("decode", rooms)
    urls = [await pre_srv.start(), await dec_srv.start()]
    tpl = str(tmp_path / "v{version}")
    pre, dec = (
        SglangServerEngine(SglangServerEngine.Config(url=u, weights_path_template=tpl), name=n)
        for u, n in zip(urls, ("pre", "dec"), strict=True)
    )
    pair = SglangPDEngine(pre, dec, name="pair")
    try:
        await pair.start()
        proxy = LLMProxy([WorkerHandle("pair", pair)])
        outs = await asyncio.gather(
            *(
                proxy.generate(GenerateRequest(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=5)))
                for i in range(3)
            )
        )
        assert [len(o.token_ids) for o in outs] == [5, 5, 5] and {o.worker for o in outs} == {"pair"}
        assert len(pre_srv.requests) == len(dec_srv.requests) == 3
        for p, d in zip(
            sorted(pre_srv.requests, key=lambda b: b["rid"]),
            sorted(dec_srv.requests, key=lambda b: b["rid"]),
            strict=True,
        ):
            assert p == d  # the same request, bootstrap fields included
            assert p["bootstrap_host"] == "127.0.0.1" and p["bootstrap_port"] == 8998
            assert 0 <= p["bootstrap_room"] < 2**63
        assert len({b["bootstrap_room"] for b in dec_srv.requests}) == 3
        # a weight update covers both servers, suspended together (retract), then both continue
        await pair.update_weights(1)
        for srv in (pre_srv, dec_srv):
            paths = [c[0] for c in srv.calls]
            assert "update_weights_from_disk" in paths and paths.index("pause_generation") < paths.index(
                "update_weights_from_disk"
            ) < paths.index("continue_generation")
        assert await pair.weight_version() == 1
        # a prefill that fails: the decode half is aborted, the request fails (retryable), no hang
        pre_srv.fail_generate = True
        with pytest.raises(WorkerUnavailableError):
            await asyncio.wait_for(
                pair.generate(GenerateRequest("doomed", [1, 2], SamplingParams(max_tokens=3))), 20
            )
        assert ("abort_request", {"rid": "doomed"}) in dec_srv.calls
    finally:
        await pair.shutdown()
        await pre_srv.stop()
        await dec_srv.stop()
