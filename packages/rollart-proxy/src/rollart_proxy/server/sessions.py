"""Session records and ownership: every call's token ids, logprobs and versions, per session, and
the principal (API key, admin token or session-bound token) each session belongs to; the groups of
sibling sessions that one ``n > 1`` call made, and :func:`group_trajectories` (a drained group as
the trainer's trajectories, one group of ``n``)."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from rollart_core.protocols import AgentCall, ChatFormat
from rollart_core.types import Fate, GenerateOutput, SamplingParams, Trajectory

__all__ = ["SessionRecorder", "SessionTableFull", "group_trajectories"]

_ADMIN = "admin"
"""The principal of the admin token: may touch every session."""
_BOUND = "session:"
"""Principal prefix of a session-bound token (:meth:`OpenAIServer.bind_session`)."""


class SessionTableFull(Exception):
    """A new session was refused: ``max_sessions`` sessions exist and none is idle long enough to go
    (the server answers 429)."""


class SessionRecorder:
    """Token ids, logprobs and versions of every call, per session, until the trainer takes them.

    Ownership is never lost while a session exists: at most ``max_sessions`` sessions are owned, and
    a new one beyond that takes the place of the least recently used session idle for longer than
    ``idle_ttl_s``, which goes *whole* (owner and records; ``on_evict`` drops what the server keeps
    of it), or else is refused (:class:`SessionTableFull`). A session is never left without its
    owner while its records or routing state remain, so no other key can take it over; a session
    bound to an agent's token (:meth:`OpenAIServer.bind_session`) is never evicted: it ends when
    its token is released. An evicted session's id stays its owner's: another key naming it gets
    403, as while it existed. ``idle_ttl_s`` None: sessions go only when ended (``DELETE``)."""

    def __init__(
        self,
        max_sessions: int = 100_000,
        max_calls_per_session: int = 10_000,
        idle_ttl_s: float | None = 3600.0,
        on_evict: Callable[[str], None] | None = None,
    ) -> None:
        if idle_ttl_s is not None and idle_ttl_s <= 0:
            raise ValueError(f"idle_ttl_s must be > 0 (or None: never), got {idle_ttl_s}")
        self.max_sessions = max_sessions
        self.max_calls_per_session = max_calls_per_session
        self.idle_ttl_s = idle_ttl_s
        self.on_evict = on_evict
        self.evicted = 0
        """Idle sessions that went whole to make room for a new one."""
        self.refused = 0
        """New sessions refused because the table was full (429)."""
        self._calls: dict[str, list[dict[str, Any]]] = {}
        self._owners: OrderedDict[str, str | None] = OrderedDict()
        """Session → principal that created it (least recently used first, at most ``max_sessions``)."""
        self._used: dict[str, float] = {}
        """Session → when it was last claimed (``time.monotonic``)."""
        self._pinned: set[str] = set()
        """Sessions never evicted (a session-bound token exists for them)."""
        self._tombstones: OrderedDict[str, str | None] = OrderedDict()
        """Evicted session → its owner: only that owner may start a session under the id again
        (the latest ``max_sessions`` evictions)."""
        self._groups: OrderedDict[str, list[str]] = OrderedDict()
        """Group of an ``n > 1`` call → its sibling sessions, in choice order (at most ``max_sessions``)."""

    def claim(self, session_id: str, principal: str | None) -> bool:
        """Record ``principal`` as the session's owner if it has none; False if another owns it;
        :class:`SessionTableFull` if it is new and there is no room (see the class)."""
        if session_id in self._owners:
            if not self.may_access(session_id, principal):
                return False
            self._owners.move_to_end(session_id)
            self._used[session_id] = time.monotonic()
            return True
        if not self.may_access(session_id, principal):  # evicted from another key: not to take over
            return False
        if not self.has_room(1):
            self.refused += 1
            raise SessionTableFull(
                f"max_sessions={self.max_sessions} sessions exist and none has been idle for "
                f"{self.idle_ttl_s} s: end sessions (DELETE /v1/sessions/{{id}}) or retry later"
            )
        self._owners[session_id] = principal
        self._used[session_id] = time.monotonic()
        self._tombstones.pop(session_id, None)
        return True

    def has_room(self, n: int) -> bool:
        """Whether ``n`` new sessions fit, after evicting idle ones whole if need be."""
        excess = len(self._owners) + n - self.max_sessions
        if excess > 0 and self.idle_ttl_s is not None:
            cutoff = time.monotonic() - self.idle_ttl_s
            idle: list[str] = []
            for sid in self._owners:  # least recently used first
                if self._used.get(sid, 0.0) > cutoff or len(idle) == excess:
                    break
                if sid not in self._pinned:
                    idle.append(sid)
            for sid in idle:
                self.evict(sid)
            excess -= len(idle)
        return excess <= 0

    def evict(self, session_id: str) -> None:
        """Drop a whole session: its owner, its records, and (``on_evict``) the server's state of it;
        its id stays its owner's (a tombstone)."""
        self._tombstones[session_id] = self._owners.get(session_id)
        while len(self._tombstones) > self.max_sessions:
            self._tombstones.popitem(last=False)
        self.forget(session_id)
        self._calls.pop(session_id, None)
        self.evicted += 1
        if self.on_evict is not None:
            self.on_evict(session_id)

    def may_access(self, session_id: str, principal: str | None) -> bool:
        """Whether ``principal`` may use the session: its owner (or the admin); an unknown session
        (nothing recorded, no owner, not evicted from another owner) is anybody's to start."""
        if principal == _ADMIN:
            return True
        if session_id in self._owners:
            return self._owners[session_id] == principal
        if session_id in self._tombstones:
            return self._tombstones[session_id] == principal
        return session_id not in self._calls

    def forget(self, session_id: str) -> None:
        self._owners.pop(session_id, None)
        self._used.pop(session_id, None)
        self._pinned.discard(session_id)

    def pin(self, session_id: str) -> None:
        """Never evict this owned session (until :meth:`forget`): a token bound to it is out."""
        if session_id in self._owners:
            self._pinned.add(session_id)

    def sizes(self) -> dict[str, int]:
        return {"recorded_sessions": len(self._calls), "owned_sessions": len(self._owners)}

    def add_group(self, group_id: str, members: list[str]) -> None:
        """Remember the sibling sessions of one ``n > 1`` call (oldest group forgotten first)."""
        self._groups[group_id] = list(members)
        while len(self._groups) > self.max_sessions:
            self._groups.popitem(last=False)

    def group_ids(self) -> list[str]:
        """The groups not yet drained (oldest first)."""
        return list(self._groups)

    def group(self, group_id: str) -> list[str] | None:
        return self._groups.get(group_id)

    def drain_group(self, group_id: str) -> list[dict[str, Any]]:
        """Take a group's records, one entry per sibling ``{"session_id", "index", "calls"}``, and
        forget the group (its sessions stay owned: a sibling may still be continued)."""
        members = self._groups.pop(group_id, [])
        return [{"session_id": m, "index": i, "calls": self.drain(m)} for i, m in enumerate(members)]

    def record(
        self,
        session_id: str,
        endpoint: str,
        prompt_ids: list[int],
        out: GenerateOutput,
        sampling: SamplingParams | None = None,
        group: tuple[str, int, int] | None = None,
    ) -> None:
        """``group``: ``(group_id, index, size)`` when the call was one choice of an ``n > 1`` call.
        A session without an owner (ended or evicted while the call ran) records nothing: its
        records would belong to nobody."""
        if session_id not in self._owners:
            return
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
                "group_id": group[0] if group else None,
                "group_index": group[1] if group else None,
                "group_size": group[2] if group else None,
            }
        )

    def get(self, session_id: str) -> list[dict[str, Any]]:
        return list(self._calls.get(session_id, ()))

    def drain(self, session_id: str) -> list[dict[str, Any]]:
        return self._calls.pop(session_id, [])


def group_trajectories(
    drained: Sequence[dict[str, Any]],
    group_id: str,
    chat: ChatFormat,
    *,
    task: str = "gateway",
    rewards: Sequence[float] | None = None,
) -> list[Trajectory]:
    """A drained group (:meth:`SessionRecorder.drain_group`, or ``POST /v1/groups/{id}/drain``'s
    ``members``) as the trainer's trajectories: one per sibling, all with ``group_id``, so that a
    group-relative advantage (GRPO) compares the ``n`` samples of one prompt with each other. A
    sibling continued with further calls (its session id as ``X-Session-Id``) has them as later turns.
    ``rewards`` (one per sibling, in choice order): the client's scores; the trajectories are then
    ``finished``. Without them reward and fate are left for the caller to set."""
    from rollart_core.control.runner import assemble_agent_turns
    from rollart_core.control.state import decide

    if rewards is not None and len(rewards) != len(drained):
        raise ValueError(f"{len(rewards)} rewards for a group of {len(drained)}")
    out: list[Trajectory] = []
    for k, member in enumerate(drained):
        calls = [
            AgentCall(
                r["prompt_ids"],
                r["output_ids"],
                r["logprobs"],
                r["versions"],
                r["finish_reason"],
                r["temperature"] if r.get("temperature") is not None else 1.0,
                tuple(r["allowed_token_ids"]) if r.get("allowed_token_ids") else None,
            )
            for r in member["calls"]
        ]
        versions = [v for c in calls for v in c.versions]
        traj = Trajectory(
            member["session_id"],
            task,
            "gateway",
            group_id,
            int(member.get("index", k)),
            min(versions, default=0),
        )
        assemble_agent_turns(traj, calls, chat)
        traj.terminated = True
        if rewards is not None:
            traj.reward = float(rewards[k])
            decide(traj, Fate.FINISHED)
        out.append(traj)
    return out
