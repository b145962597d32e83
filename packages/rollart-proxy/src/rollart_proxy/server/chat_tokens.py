"""Exact token ids for multi-call chat sessions.

An assistant message that this endpoint generated and that the client sends back unchanged is
not re-tokenised: its sampled token ids are spliced into the prompt where the chat template
renders that message. Re-tokenising would not give the sampled ids back (BPE merges differently
across the boundary, and a template re-serialises tool calls its own way: ``{"a":1}`` sampled,
``{"a": 1}`` rendered), and the trainer would then train on tokens the policy never produced.

Why splicing rather than rendering incrementally (prompt k = prompt k-1 + output k-1 + template
tokens of the new messages): a template is a function of the whole conversation (system prompt,
tool block, roles), and "the tokens of the new messages" are only defined by rendering all of it;
splicing renders the whole conversation every call, exactly as the model's template says, and
replaces only the generated spans. When the client rewrites its history, the prompt is simply
what the template renders (the trajectory then starts a new segment), with no special case.

How: each remembered assistant message is rendered with a unique sentinel as its whole content
(and no tool calls); the text is split at the sentinels, the pieces are encoded, and the sampled
ids go in between. If the sampled ids end with the end-of-turn token, the template's own
end-of-turn text right after the sentinel is dropped (the model already produced it).
"""

from __future__ import annotations

import json
import secrets
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["GeneratedMessages", "message_key", "splice_encode"]


def message_key(content: str | None, tool_calls: Sequence[dict[str, Any]] | None) -> str:
    """What identifies an assistant message sent back unchanged: its text and its calls' names and
    arguments (not the call ids, which some clients rewrite)."""
    calls = [
        [c.get("function", {}).get("name"), c.get("function", {}).get("arguments")] for c in tool_calls or ()
    ]
    return json.dumps([content or "", calls], ensure_ascii=False)


class GeneratedMessages:
    """Per session: the sampled ids of each assistant message generated for it (bounded, LRU)."""

    def __init__(self, max_sessions: int = 100_000, max_per_session: int = 1024) -> None:
        self.max_sessions = max_sessions
        self.max_per_session = max_per_session
        self._by_session: OrderedDict[str, OrderedDict[str, list[int]]] = OrderedDict()

    def remember(self, session_id: str, key: str, output_ids: Sequence[int]) -> None:
        msgs = self._by_session.setdefault(session_id, OrderedDict())
        self._by_session.move_to_end(session_id)
        msgs[key] = list(output_ids)
        msgs.move_to_end(key)
        while len(msgs) > self.max_per_session:
            msgs.popitem(last=False)
        while len(self._by_session) > self.max_sessions:
            self._by_session.popitem(last=False)

    def lookup(self, session_id: str, key: str) -> list[int] | None:
        msgs = self._by_session.get(session_id)
        return None if msgs is None else msgs.get(key)

    def forget(self, session_id: str) -> None:
        self._by_session.pop(session_id, None)

    def __len__(self) -> int:
        return len(self._by_session)


def splice_encode(
    render: Callable[[list[dict[str, Any]]], str],
    encode: Callable[[str], list[int]],
    messages: list[dict[str, Any]],
    splices: dict[int, list[int]],
    end_of_turn: tuple[int, str] | None,
) -> tuple[list[int], int]:
    """Prompt ids of ``messages`` with ``splices`` (message index → sampled ids) in place of those
    messages' rendered content; ``end_of_turn``: ``(token id, its text)``. Returns the ids and the
    number of messages spliced (0 when a sentinel did not survive the template: plain encoding)."""
    if not splices:
        return encode(render(messages)), 0
    nonce = secrets.token_hex(8)
    sentinels = {i: f"\u27e6rollart-{nonce}-{i}\u27e7" for i in splices}
    msgs = [
        {"role": m["role"], "content": sentinels[i]} if i in sentinels else m for i, m in enumerate(messages)
    ]
    text = render(msgs)
    order = sorted(splices)
    positions = [text.find(sentinels[i]) for i in order]
    if (
        any(p < 0 for p in positions)
        or positions != sorted(positions)
        or any(text.count(sentinels[i]) != 1 for i in order)
    ):
        return encode(render(messages)), 0  # the template does not render content verbatim
    ids: list[int] = []
    pos = 0
    for i, start in zip(order, positions, strict=True):
        ids += encode(text[pos:start]) if start > pos else []
        sampled = splices[i]
        ids += sampled
        pos = start + len(sentinels[i])
        if (
            end_of_turn is not None
            and sampled
            and sampled[-1] == end_of_turn[0]
            and text.startswith(end_of_turn[1], pos)
        ):
            pos += len(end_of_turn[1])
    if pos < len(text):
        ids += encode(text[pos:])
    return ids, len(order)
