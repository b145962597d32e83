"""JSON wire format for trajectories and reward results (what travels to a reward function endpoint).

``trajectory_to_dict`` / ``trajectory_from_dict`` round-trip every field of
:class:`rollart_core.types.Trajectory`; ``info`` must itself be JSON-serialisable. The idempotency key
of a trajectory is attempt-independent: the same trajectory always gets the same key, so a retried
call can be recognised by the function runtime and never counted twice.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from rollart_core.errors import RewardError
from rollart_core.types import Fate, RewardResult, Trajectory, Turn

__all__ = [
    "idempotency_key",
    "result_from_dict",
    "result_to_dict",
    "trajectory_from_dict",
    "trajectory_to_dict",
]

WIRE_VERSION = 1


def trajectory_to_dict(traj: Trajectory) -> dict[str, Any]:
    d = {f.name: getattr(traj, f.name) for f in dataclasses.fields(traj) if f.name != "turns"}
    d["turns"] = [{f.name: getattr(t, f.name) for f in dataclasses.fields(t)} for t in traj.turns]
    d["fate"] = traj.fate.value if traj.fate is not None else None
    d["timings"] = dict(traj.timings)
    d["info"] = dict(traj.info)
    return d


def trajectory_from_dict(d: dict[str, Any]) -> Trajectory:
    """Inverse of :func:`trajectory_to_dict`; unknown or missing fields raise :class:`RewardError`."""
    if not isinstance(d, dict):
        raise RewardError(f"a trajectory must be a JSON object, got {type(d).__name__}")
    d = dict(d)
    try:
        turns = [Turn(**t) for t in d.pop("turns", [])]
        fate = d.pop("fate", None)
        traj = Trajectory(**d, turns=turns)
    except TypeError as exc:
        raise RewardError(f"malformed trajectory: {exc}") from None
    traj.fate = Fate(fate) if fate is not None else None
    return traj


def result_to_dict(result: RewardResult) -> dict[str, Any]:
    return {"score": float(result.score), "details": result.details}


def result_from_dict(d: Any) -> RewardResult:
    if not isinstance(d, dict) or not isinstance(d.get("score"), (int, float)) or isinstance(d.get("score"), bool):
        raise RewardError(f"malformed reward result: {json.dumps(d)[:500] if _jsonable(d) else repr(d)[:500]}")
    details = d.get("details", {})
    if not isinstance(details, dict):
        raise RewardError(f"reward result details must be an object, got {type(details).__name__}")
    return RewardResult(float(d["score"]), details)


def idempotency_key(traj: Trajectory, function: str = "") -> str:
    """Stable key for (function, trajectory): the same on every attempt, different per trajectory."""
    h = hashlib.sha256()
    h.update(function.encode())
    h.update(b"\0")
    h.update(traj.traj_id.encode())
    h.update(b"\0")
    h.update(json.dumps([[t.context_ids, t.output_ids] for t in traj.turns], separators=(",", ":")).encode())
    return h.hexdigest()[:32]


def _jsonable(x: Any) -> bool:
    try:
        json.dumps(x)
        return True
    except (TypeError, ValueError):
        return False
