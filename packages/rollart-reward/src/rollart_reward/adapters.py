"""Invocation shapes of function platforms: how a reward call becomes an HTTP request and back.

- :class:`JsonAdapter`: generic ``POST {url}/invoke`` with ``{"key", "trajectory"}`` (and batches).
- :class:`LambdaAdapter`: AWS Lambda ``Invoke`` shape, ``POST /2015-03-31/functions/{fn}/invocations``,
  ``X-Amz-Invocation-Type: RequestResponse``; a function error is a 200 with ``X-Amz-Function-Error``.
- :class:`FcAdapter`: Alibaba Function Compute 3.0 shape, ``POST /2023-03-30/functions/{fn}/invocations``
  with ``x-fc-invocation-type: Sync``, or ``Async`` with a caller-chosen ``x-fc-async-task-id`` and
  polling ``GET .../async-tasks/{id}``.

These reproduce the request/response shapes only; request signing (SigV4, FC signatures) is the
deployment's job (e.g. an authenticating gateway in front) and is not implemented here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from rollart_core.types import RewardResult
from rollart_reward.wire import result_from_dict

__all__ = [
    "Adapter",
    "FcAdapter",
    "FunctionFailed",
    "JsonAdapter",
    "LambdaAdapter",
    "Retryable",
    "make_adapter",
]

COLD_START_HEADER = "X-Rollart-Cold-Start"


class Retryable(Exception):
    """An attempt failed in a way another attempt may fix (429, 5xx, timeout, malformed body)."""

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class FunctionFailed(Retryable):
    """The endpoint is healthy but the reward function raised (does not trip the circuit breaker)."""


@dataclass
class Call:
    method: str
    path: str
    headers: dict[str, str]
    body: Any = None


def _retry_after(headers: Any) -> float | None:
    try:
        return float(headers.get("Retry-After")) if headers.get("Retry-After") else None
    except ValueError:
        return None


def check_status(status: int, text: str, headers: Any) -> None:
    """Raise :class:`Retryable` for 429/5xx, ``ValueError`` (permanent) for other non-2xx."""
    if status == 429 or status >= 500:
        raise Retryable(f"HTTP {status}: {text[:500]}", _retry_after(headers))
    if status >= 300:
        raise ValueError(f"HTTP {status}: {text[:500]}")


def parse_json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        raise Retryable(f"malformed JSON from endpoint: {text[:1000]!r}") from None


def parse_result(d: Any, text: str) -> RewardResult:
    try:
        return result_from_dict(d)
    except Exception:
        raise Retryable(f"malformed reward result from endpoint: {text[:1000]!r}") from None


class Adapter:
    """Builds the request of one call and parses its response."""

    supports_batch = False
    supports_async = False

    def __init__(self, function: str) -> None:
        self.function = function

    def request(self, key: str, trajectory: dict[str, Any]) -> Call:
        raise NotImplementedError

    def response(self, status: int, text: str, headers: Any) -> RewardResult:
        raise NotImplementedError


class JsonAdapter(Adapter):
    supports_batch = True

    def request(self, key: str, trajectory: dict[str, Any]) -> Call:
        return Call("POST", "/invoke", {"Idempotency-Key": key}, {"key": key, "trajectory": trajectory})

    def batch_request(self, items: list[tuple[str, dict[str, Any]]]) -> Call:
        return Call("POST", "/invoke", {}, {"items": [{"key": k, "trajectory": t} for k, t in items]})

    def response(self, status: int, text: str, headers: Any) -> RewardResult:
        if status == 500:
            body = parse_json(text)
            if isinstance(body, dict) and "error" in body:
                raise FunctionFailed(f"reward function failed: {body['error']}")
        check_status(status, text, headers)
        body = parse_json(text)
        return parse_result(body.get("result") if isinstance(body, dict) else None, text)

    def batch_response(self, status: int, text: str, headers: Any) -> list[dict[str, Any]]:
        check_status(status, text, headers)
        body = parse_json(text)
        if not isinstance(body, dict) or not isinstance(body.get("results"), list):
            raise Retryable(f"malformed batch response: {text[:1000]!r}")
        return body["results"]


class LambdaAdapter(Adapter):
    def request(self, key: str, trajectory: dict[str, Any]) -> Call:
        return Call(
            "POST",
            f"/2015-03-31/functions/{self.function}/invocations",
            {"X-Amz-Invocation-Type": "RequestResponse", "Idempotency-Key": key},
            {"key": key, "trajectory": trajectory},
        )

    def response(self, status: int, text: str, headers: Any) -> RewardResult:
        check_status(status, text, headers)
        if headers.get("X-Amz-Function-Error"):
            raise FunctionFailed(f"reward function failed: {text[:500]}")
        return parse_result(parse_json(text), text)


class FcAdapter(Adapter):
    supports_async = True

    def _path(self) -> str:
        return f"/2023-03-30/functions/{self.function}/invocations"

    def request(self, key: str, trajectory: dict[str, Any]) -> Call:
        return Call(
            "POST",
            self._path(),
            {"x-fc-invocation-type": "Sync", "Idempotency-Key": key},
            {"key": key, "trajectory": trajectory},
        )

    def response(self, status: int, text: str, headers: Any) -> RewardResult:
        check_status(status, text, headers)
        if headers.get("x-fc-error-type"):
            raise FunctionFailed(f"reward function failed: {text[:500]}")
        return parse_result(parse_json(text), text)

    def submit(self, key: str, task_id: str, trajectory: dict[str, Any]) -> Call:
        return Call(
            "POST",
            self._path(),
            {"x-fc-invocation-type": "Async", "x-fc-async-task-id": task_id, "Idempotency-Key": key},
            {"key": key, "trajectory": trajectory},
        )

    def poll(self, task_id: str) -> Call:
        return Call("GET", f"/2023-03-30/functions/{self.function}/async-tasks/{task_id}", {})

    def poll_response(self, status: int, text: str, headers: Any) -> RewardResult | None:
        """The result, None while running; :class:`FunctionFailed` if the task failed."""
        check_status(status, text, headers)
        body = parse_json(text)
        state = body.get("status") if isinstance(body, dict) else None
        if state in ("Running", "Enqueued", "Dequeued"):
            return None
        if state == "Succeeded":
            return parse_result(parse_json(body.get("returnPayload", "")), text)
        if state == "Failed":
            raise FunctionFailed(f"async task failed: {body.get('errorMessage')}")
        raise Retryable(f"unexpected async task status: {text[:500]!r}")


def make_adapter(name: str, function: str) -> Adapter:
    return {"json": JsonAdapter, "lambda": LambdaAdapter, "fc": FcAdapter}[name](function)
