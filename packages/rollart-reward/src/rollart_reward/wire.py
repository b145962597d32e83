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
import math
from typing import Any

from rollart_core.errors import RewardError
from rollart_core.serving import INT64_MAX, INT64_MIN
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


def trajectory_from_dict(d: Any) -> Trajectory:
    """Inverse of :func:`trajectory_to_dict`; unknown, missing or mistyped fields raise :class:`RewardError`."""
    if not isinstance(d, dict):
        raise RewardError(f"a trajectory must be a JSON object, got {_kind(d)}")
    d = dict(d)
    turns = d.pop("turns", [])
    if not isinstance(turns, list):
        raise RewardError(f"malformed trajectory: 'turns' must be a list, got {_kind(turns)}")
    for i, t in enumerate(turns):
        if not isinstance(t, dict):
            raise RewardError(f"malformed trajectory: turns[{i}] must be an object, got {_kind(t)}")
        _check_fields(t, _TURN_TYPES, f"turns[{i}].")
    _check_fields(d, _TRAJECTORY_TYPES, "")
    try:
        traj = Trajectory(**d, turns=[Turn(**t) for t in turns])
        traj.fate = Fate(d["fate"]) if d.get("fate") is not None else None
    except (TypeError, ValueError) as exc:
        raise RewardError(f"malformed trajectory: {exc}") from None
    return traj


_NUM = (int, float)
_TRAJECTORY_TYPES: dict[str, tuple[type, ...]] = {
    "traj_id": (str,),
    "task": (str,),
    "env_id": (str,),
    "group_id": (str,),
    "seed": (int,),
    "start_version": (int,),
    "reward": _NUM,
    "env_return": _NUM,
    "fate": (str, type(None)),
    "terminated": (bool,),
    "truncated": (bool,),
    "error": (str, type(None)),
    "timings": (dict,),
    "info": (dict,),
}
_TURN_TYPES: dict[str, tuple[type, ...]] = {
    "context_ids": (list,),
    "output_ids": (list,),
    "output_logprobs": (list,),
    "output_versions": (list,),
    "finish_reason": (str,),
    "action_text": (str,),
    "env_reward": _NUM,
    "allowed_token_ids": (list, type(None)),
    "temperature": _NUM,
    "new_sequence": (bool,),
}
_INT_LISTS = ("context_ids", "output_ids", "output_versions", "allowed_token_ids")


def _check_fields(d: dict[str, Any], types: dict[str, tuple[type, ...]], where: str) -> None:
    """Type check of the JSON fields (unknown and missing ones are left to the dataclass)."""
    for name, value in d.items():
        allowed = types.get(name)
        if allowed is None:
            continue
        if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
            raise RewardError(
                f"malformed trajectory: {where}{name} must be "
                f"{' or '.join(_kind_name(t) for t in allowed)}, got {_kind(value)}"
            )
        if (
            name in _INT_LISTS
            and isinstance(value, list)  # the type check let through a list or, where allowed, None
            and not all(isinstance(x, int) and not isinstance(x, bool) for x in value)
        ):
            raise RewardError(f"malformed trajectory: {where}{name} must be a list of integers")
        if (
            name == "output_logprobs"
            and isinstance(value, list)
            and not all(isinstance(x, _NUM) and not isinstance(x, bool) for x in value)
        ):
            raise RewardError(f"malformed trajectory: {where}{name} must be a list of numbers")
        numbers = value if name in _INT_LISTS or name == "output_logprobs" else [value]
        for x in numbers if isinstance(numbers, list) else ():
            if isinstance(x, int) and not isinstance(x, bool) and not INT64_MIN <= x <= INT64_MAX:
                raise RewardError(f"malformed trajectory: {where}{name} holds {x}, beyond 64 bits")
            if isinstance(x, float) and not math.isfinite(x) and name != "output_logprobs":
                raise RewardError(f"malformed trajectory: {where}{name} must be finite, got {x}")


def _kind_name(t: type) -> str:
    return {
        str: "a string",
        int: "an integer",
        float: "a number",
        bool: "a boolean",
        list: "a list",
        dict: "an object",
        type(None): "null",
    }[t]


def _kind(x: Any) -> str:
    return "null" if x is None else type(x).__name__


def result_to_dict(result: RewardResult) -> dict[str, Any]:
    return {"score": float(result.score), "details": result.details}


def result_from_dict(d: Any) -> RewardResult:
    if (
        not isinstance(d, dict)
        or not isinstance(d.get("score"), (int, float))
        or isinstance(d.get("score"), bool)
    ):
        raise RewardError(
            f"malformed reward result: {json.dumps(d)[:500] if _jsonable(d) else repr(d)[:500]}"
        )
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
