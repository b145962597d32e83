"""Session records and ownership: every call's token ids, logprobs and versions, per session, and
the principal (API key, admin token or session-bound token) each session belongs to."""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

from rollart_core.types import GenerateOutput, SamplingParams

__all__ = ["SessionRecorder"]

_ADMIN = "admin"
"""The principal of the admin token: may touch every session."""
_BOUND = "session:"
"""Principal prefix of a session-bound token (:meth:`OpenAIServer.bind_session`)."""


class SessionRecorder:
    """Token ids, logprobs and versions of every call, per session, until the trainer takes them."""

    def __init__(self, max_sessions: int = 100_000, max_calls_per_session: int = 10_000) -> None:
        self.max_sessions = max_sessions
        self.max_calls_per_session = max_calls_per_session
        self._calls: dict[str, list[dict[str, Any]]] = {}
        self._owners: OrderedDict[str, str | None] = OrderedDict()
        """Session → principal that created it (LRU, at most ``max_sessions``)."""

    def claim(self, session_id: str, principal: str | None) -> bool:
        """Record ``principal`` as the session's owner if it has none; False if another owns it."""
        if session_id in self._owners:
            if not self.may_access(session_id, principal):
                return False
            self._owners.move_to_end(session_id)
            return True
        self._owners[session_id] = principal
        while len(self._owners) > self.max_sessions:
            self._owners.popitem(last=False)
        return True

    def may_access(self, session_id: str, principal: str | None) -> bool:
        owner = self._owners.get(session_id, principal)
        return principal == _ADMIN or owner == principal

    def forget(self, session_id: str) -> None:
        self._owners.pop(session_id, None)

    def sizes(self) -> dict[str, int]:
        return {"recorded_sessions": len(self._calls), "owned_sessions": len(self._owners)}

    def record(
        self,
        session_id: str,
        endpoint: str,
        prompt_ids: list[int],
        out: GenerateOutput,
        sampling: SamplingParams | None = None,
    ) -> None:
        if session_id not in self._calls and len(self._calls) >= self.max_sessions:
            self._calls.pop(next(iter(self._calls)))  # oldest session first
        calls = self._calls.setdefault(session_id, [])
        if len(calls) >= self.max_calls_per_session:
            calls.pop(0)  # a session nobody drains keeps only its latest calls
        calls.append(
            {
                "request_id": out.request_id,
                "endpoint": endpoint,
                "prompt_ids": list(prompt_ids),
                "output_ids": list(out.token_ids),
                "logprobs": list(out.logprobs),
                "versions": list(out.versions),
                "finish_reason": out.finish_reason,
                "worker": out.worker,
                "time": time.time(),
                "temperature": sampling.temperature if sampling is not None else None,
                "allowed_token_ids": list(sampling.allowed_token_ids)
                if sampling and sampling.allowed_token_ids
                else None,
            }
        )

    def get(self, session_id: str) -> list[dict[str, Any]]:
        return list(self._calls.get(session_id, ()))

    def drain(self, session_id: str) -> list[dict[str, Any]]:
        return self._calls.pop(session_id, [])
