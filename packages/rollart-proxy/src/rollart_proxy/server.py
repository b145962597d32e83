"""OpenAI-compatible HTTP endpoint served by the proxy (FastAPI + uvicorn, bound to 127.0.0.1).

Black-box agents (anything speaking the OpenAI API) are trained through it: every call made with
a session header (``X-Session-Id: <trajectory id>``) is routed as one turn of that trajectory
(sticky worker, task pool from ``X-Rollart-Task``) and recorded with its prompt token ids, output
token ids, logprobs and the policy version of every token, for the trainer to fetch.

Endpoints:

- ``POST /v1/chat/completions``, ``POST /v1/completions`` (``stream: true`` too), ``GET /v1/models``
- ``GET /v1/sessions/{id}`` (records of a session), ``POST /v1/sessions/{id}/drain`` (take them),
  ``POST /v1/sessions/{id}/abort`` (abort the trajectory's in-flight request),
  ``DELETE /v1/sessions/{id}`` (end the session: records and stickiness dropped)
- ``POST /admin/suspend``, ``POST /admin/resume``, ``POST /admin/update_weights`` ``{"version"}``,
  ``GET /admin/weight_versions``, ``GET /metrics`` (per worker), ``GET /health``

Bad input gets a 4xx with an OpenAI-style ``{"error": {"message", "type", "code"}}`` body: unknown
model 404, malformed body / invalid sampling parameters / prompt longer than the context 400. A
request no worker can serve gets 503. Streaming responses are well-formed SSE; the chunks are sent
when the turn completes (engines return whole turns).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from rollart_core.errors import EngineError
from rollart_core.types import GenerateOutput, GenerateRequest, SamplingParams
from rollart_proxy.chat_template import ChatTemplate
from rollart_proxy.errors import WorkerUnavailableError
from rollart_proxy.proxy import LLMProxy

__all__ = ["OpenAIServer", "SessionRecorder"]


class _ApiError(Exception):
    def __init__(self, status: int, message: str, code: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


# request bodies --------------------------------------------------------------------------------

class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    n: int = Field(1, ge=1, le=1, description="Only n=1 is supported (one trajectory turn per call).")
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


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

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
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=0, description="Only the sampled token (0).")


# session records -------------------------------------------------------------------------------

class SessionRecorder:
    """Token ids, logprobs and versions of every call, per session, until the trainer takes them."""

    def __init__(self, max_sessions: int = 100_000) -> None:
        self.max_sessions = max_sessions
        self._calls: dict[str, list[dict[str, Any]]] = {}

    def record(self, session_id: str, endpoint: str, prompt_ids: list[int], out: GenerateOutput) -> None:
        if session_id not in self._calls and len(self._calls) >= self.max_sessions:
            self._calls.pop(next(iter(self._calls)))  # oldest session first
        self._calls.setdefault(session_id, []).append({
            "request_id": out.request_id, "endpoint": endpoint, "prompt_ids": list(prompt_ids),
            "output_ids": list(out.token_ids), "logprobs": list(out.logprobs), "versions": list(out.versions),
            "finish_reason": out.finish_reason, "worker": out.worker, "time": time.time(),
        })

    def get(self, session_id: str) -> list[dict[str, Any]]:
        return list(self._calls.get(session_id, ()))

    def drain(self, session_id: str) -> list[dict[str, Any]]:
        return self._calls.pop(session_id, [])


# the server ------------------------------------------------------------------------------------

class OpenAIServer:
    """``OpenAIServer(proxy, model_path).app`` is the FastAPI app; :meth:`start` serves it in the
    running event loop (same loop as the proxy's engines)."""

    def __init__(
        self,
        proxy: LLMProxy,
        model_path: str,
        *,
        served_model_name: str | None = None,
        max_model_len: int | None = None,
        default_max_tokens: int = 256,
        session_header: str = "X-Session-Id",
        task_header: str = "X-Rollart-Task",
    ) -> None:
        from pathlib import Path

        self.proxy = proxy
        self.template = ChatTemplate(model_path)
        self.model_name = served_model_name or Path(model_path).name
        self._model_aliases = {self.model_name, str(model_path)}
        self.max_model_len = max_model_len
        self.default_max_tokens = default_max_tokens
        self.session_header = session_header
        self.task_header = task_header
        self.recorder = SessionRecorder()
        self._server: Any = None
        self._task: asyncio.Task[None] | None = None
        self.app = self._build()

    # serving -----------------------------------------------------------------------------------

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Serve in the running loop; returns the bound port."""
        import uvicorn

        config = uvicorn.Config(self.app, host=host, port=port, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._task = asyncio.create_task(self._server.serve())
        deadline = time.monotonic() + 30
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise RuntimeError("uvicorn exited before it started")
            if time.monotonic() > deadline:
                raise TimeoutError("uvicorn did not start within 30 s")
            await asyncio.sleep(0.02)
        return int(self._server.servers[0].sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await asyncio.wait_for(self._task, 30)
            self._server = self._task = None

    # app ---------------------------------------------------------------------------------------

    def _build(self) -> FastAPI:
        app = FastAPI(title="rollart-proxy", docs_url=None, redoc_url=None)

        @app.exception_handler(_ApiError)
        async def _api_error(_: Request, e: _ApiError) -> JSONResponse:
            return _error(e.status, e.message, e.code, e.param)

        @app.exception_handler(RequestValidationError)
        async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
            msgs = "; ".join(f"{'.'.join(str(x) for x in err.get('loc', ()))}: {err.get('msg')}" for err in e.errors())
            return _error(400, f"invalid request: {msgs}")

        @app.exception_handler(WorkerUnavailableError)
        async def _unavailable(_: Request, e: WorkerUnavailableError) -> JSONResponse:
            return _error(503, str(e), "service_unavailable")

        @app.exception_handler(EngineError)
        async def _engine(_: Request, e: EngineError) -> JSONResponse:
            return _error(400, str(e))

        @app.get("/health")
        async def health() -> dict[str, str]:
            return {"status": "ok"}

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "rollart",
                                                "max_model_len": self.max_model_len}]}

        @app.post("/v1/completions")
        async def completions(body: CompletionBody, request: Request) -> Any:
            self._check_model(body.model)
            if isinstance(body.prompt, list) and body.prompt and isinstance(body.prompt[0], str):
                if len(body.prompt) != 1:
                    raise _ApiError(400, "only one prompt per request is supported", param="prompt")
                prompt_ids = self.template.encode(body.prompt[0])
            elif isinstance(body.prompt, str):
                prompt_ids = self.template.encode(body.prompt)
            else:
                prompt_ids = list(body.prompt)  # token ids
            return await self._serve("completions", body, prompt_ids, body.max_tokens, request)

        @app.post("/v1/chat/completions")
        async def chat(body: ChatBody, request: Request) -> Any:
            self._check_model(body.model)
            try:
                msgs = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                        for m in body.messages]
            except ValueError as e:
                raise _ApiError(400, str(e), param="messages") from None
            prompt_ids = self.template.encode_messages(msgs)
            return await self._serve("chat", body, prompt_ids, body.max_completion_tokens or body.max_tokens, request)

        @app.get("/v1/sessions/{session_id}")
        async def session(session_id: str) -> dict[str, Any]:
            return {"session_id": session_id, "calls": self.recorder.get(session_id)}

        @app.post("/v1/sessions/{session_id}/drain")
        async def drain(session_id: str) -> dict[str, Any]:
            return {"session_id": session_id, "calls": self.recorder.drain(session_id)}

        @app.post("/v1/sessions/{session_id}/abort")
        async def abort(session_id: str) -> dict[str, Any]:
            return {"session_id": session_id, "aborted": await self.proxy.abort(session_id)}

        @app.delete("/v1/sessions/{session_id}")
        async def end(session_id: str) -> dict[str, Any]:
            self.proxy.end_session(session_id)
            return {"session_id": session_id, "calls": len(self.recorder.drain(session_id))}

        @app.post("/admin/suspend")
        async def suspend() -> dict[str, Any]:
            await self.proxy.suspend()
            return {"suspended": True}

        @app.post("/admin/resume")
        async def resume() -> dict[str, Any]:
            await self.proxy.resume()
            return {"suspended": False}

        class _Update(BaseModel):
            model_config = ConfigDict(extra="forbid")
            version: int = Field(ge=0)

        @app.post("/admin/update_weights")
        async def update(body: _Update) -> dict[str, Any]:
            return {"version": body.version, "paused_s": await self.proxy.update_weights(body.version)}

        @app.get("/admin/weight_versions")
        async def versions() -> dict[str, int]:
            return await self.proxy.weight_versions()

        @app.get("/metrics")
        async def metrics() -> dict[str, Any]:
            return await self.proxy.metrics()

        return app

    def _check_model(self, model: str) -> None:
        if model not in self._model_aliases:
            raise _ApiError(404, f"The model {model!r} does not exist (served: {self.model_name!r})",
                            "model_not_found", "model")

    async def _serve(self, endpoint: str, body: _Common, prompt_ids: list[int], max_tokens: int | None,
                     request: Request) -> Any:
        if not prompt_ids:
            raise _ApiError(400, "empty prompt", param="prompt")
        if self.max_model_len is not None and len(prompt_ids) >= self.max_model_len:
            raise _ApiError(400, f"prompt of {len(prompt_ids)} tokens exceeds the context of {self.max_model_len}",
                            "context_length_exceeded", "prompt")
        if max_tokens is None:
            room = (self.max_model_len - len(prompt_ids)) if self.max_model_len else self.default_max_tokens
            max_tokens = max(1, min(self.default_max_tokens, room))
        try:
            sampling = SamplingParams(
                max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                stop=body.stops(), stop_token_ids=tuple(body.stop_token_ids or ()),
                allowed_token_ids=tuple(body.allowed_token_ids) if body.allowed_token_ids is not None else None,
                seed=body.seed,
            )
        except ValidationError as e:
            raise _ApiError(400, f"invalid sampling parameters: {e.errors()[0].get('msg')}") from None
        session = request.headers.get(self.session_header) or None
        rid = f"{session or 'anon'}-{uuid.uuid4().hex[:12]}"
        req = GenerateRequest(rid, prompt_ids, sampling, session_id=session,
                              task=request.headers.get(self.task_header) or None)
        if body.stream:
            # Validate and route before the 200 goes out: errors up to the first token stay 4xx/503.
            parts = self.proxy.generate_stream(req)
            try:
                first = await anext(parts)
            except BaseException:
                await parts.aclose()  # type: ignore[attr-defined]
                raise
            return StreamingResponse(self._sse(endpoint, body, first, parts, prompt_ids, session),
                                     media_type="text/event-stream")
        out = await self.proxy.generate(req)
        self._record(session, endpoint, prompt_ids, out)
        return self._response(endpoint, body, out, prompt_ids)

    def _record(self, session: str | None, endpoint: str, prompt_ids: list[int], out: GenerateOutput) -> None:
        if session:
            self.recorder.record(session, endpoint, prompt_ids, out)

    def _text(self, out: GenerateOutput, stops: tuple[str, ...]) -> tuple[str, str]:
        text = self.template.decode(out.token_ids)
        finish = "length" if out.finish_reason == "length" else "stop"
        for s in stops:  # the engine stopped on it; OpenAI excludes it from the text
            i = text.find(s)
            if i >= 0:
                text = text[:i]
        return text, finish

    def _extra(self, out: GenerateOutput, prompt_ids: list[int]) -> dict[str, Any]:
        return {"prompt_token_ids": prompt_ids, "token_ids": out.token_ids, "versions": out.versions,
                "worker": out.worker, "engine_finish_reason": out.finish_reason}

    def _response(self, endpoint: str, body: _Common, out: GenerateOutput, prompt_ids: list[int]) -> dict[str, Any]:
        text, finish = self._text(out, body.stops())
        usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": len(out.token_ids),
                 "total_tokens": len(prompt_ids) + len(out.token_ids)}
        base = {"id": out.request_id, "created": int(time.time()), "model": self.model_name, "usage": usage,
                "rollart": self._extra(out, prompt_ids)}
        toks = [self.template.token_str(t) for t in out.token_ids]
        if endpoint == "chat":
            lp = None
            if getattr(body, "logprobs", False):
                lp = {"content": [{"token": t, "logprob": p, "bytes": list(t.encode()), "top_logprobs": []}
                                  for t, p in zip(toks, out.logprobs, strict=True)]}
            return {**base, "object": "chat.completion", "choices": [{
                "index": 0, "message": {"role": "assistant", "content": text}, "logprobs": lp, "finish_reason": finish}]}
        lp = None
        if getattr(body, "logprobs", None) is not None:
            lp = {"tokens": toks, "token_logprobs": out.logprobs, "top_logprobs": None, "text_offset": None}
        return {**base, "object": "text_completion",
                "choices": [{"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}]}

    async def _sse(self, endpoint: str, body: _Common, first: GenerateOutput, parts: AsyncIterator[GenerateOutput],
                   prompt_ids: list[int], session: str | None) -> AsyncIterator[str]:
        """Server-sent events: one chunk per token delta, text detokenised incrementally.

        Text that could still turn out to be the start of a stop string (or half a UTF-8
        character) is held back until the next delta or the end. If the client goes away, the
        request is aborted on its engine (closing ``parts`` cancels it).
        """
        stops = body.stops()
        hold = max((len(x) for x in stops), default=1) - 1
        head = {"id": first.request_id, "created": int(time.time()), "model": self.model_name}
        obj = "chat.completion.chunk" if endpoint == "chat" else "text_completion"
        want_lp = bool(getattr(body, "logprobs", False)) if endpoint == "chat" else getattr(body, "logprobs", None) is not None
        ids: list[int] = []
        lps: list[float] = []
        sent_text = 0
        sent_tokens = 0
        role_sent = False

        def chunk(text: str, new_ids: list[int], new_lps: list[float], finish: str | None) -> str:
            nonlocal role_sent
            lp: dict[str, Any] | None = None
            if want_lp and new_ids:
                toks = [self.template.token_str(t) for t in new_ids]
                lp = ({"content": [{"token": t, "logprob": p, "bytes": list(t.encode()), "top_logprobs": []}
                                   for t, p in zip(toks, new_lps, strict=True)]} if endpoint == "chat"
                      else {"tokens": toks, "token_logprobs": new_lps, "top_logprobs": None, "text_offset": None})
            if endpoint == "chat":
                delta: dict[str, Any] = {"content": text} if text or finish is None else {}
                if not role_sent:
                    delta["role"], role_sent = "assistant", True
                c: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}
            else:
                c = {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}
            return f"data: {json.dumps({**head, 'object': obj, 'choices': [c]})}\n\n"

        try:
            part: GenerateOutput | None = first
            while part is not None and not part.finish_reason:
                ids += part.token_ids
                lps += part.logprobs
                text = self.template.decode(ids)
                safe = len(text) - hold
                while safe > sent_text and text[safe - 1] == "\ufffd":  # an incomplete UTF-8 sequence
                    safe -= 1
                if safe > sent_text or not role_sent:
                    yield chunk(text[sent_text:max(safe, sent_text)], ids[sent_tokens:], lps[sent_tokens:], None)
                    sent_text = max(safe, sent_text)
                    sent_tokens = len(ids)
                part = await anext(parts, None)
        finally:
            await parts.aclose()  # type: ignore[attr-defined]
        if part is None:  # the proxy always ends with the complete output
            raise RuntimeError(f"stream of {first.request_id} ended without a complete output")
        out = part
        self._record(session, endpoint, prompt_ids, out)
        text, finish = self._text(out, stops)
        if text[sent_text:] or out.token_ids[sent_tokens:]:
            yield chunk(text[sent_text:], out.token_ids[sent_tokens:], out.logprobs[sent_tokens:], None)
        yield chunk("", [], [], finish)
        if (body.stream_options or {}).get("include_usage"):
            usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": len(out.token_ids),
                     "total_tokens": len(prompt_ids) + len(out.token_ids)}
            yield f"data: {json.dumps({**head, 'object': obj, 'choices': [], 'usage': usage, 'rollart': self._extra(out, prompt_ids)})}\n\n"
        yield "data: [DONE]\n\n"


def _error(status: int, message: str, code: str = "invalid_request_error", param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": code, "param": param, "code": status}},
                        status_code=status)
