"""Reward calls as Ray tasks on the CPU pool: elastic within the cluster, no dedicated worker.

Each call is one task (``num_cpus``, optionally pinned to a pool's custom resource); the function is
built once per Ray worker process and reused. Needs ``pip install 'rollart-reward[ray]'``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from rollart_core.errors import RewardError
from rollart_core.extras import require
from rollart_core.types import RewardResult, Trajectory
from rollart_reward.metrics import UtilisationMeter
from rollart_reward.wire import result_from_dict, trajectory_to_dict

__all__ = ["RayExecutor", "RayExecutorConfig"]

log = logging.getLogger(__name__)
_FUNCTIONS: dict[str, Any] = {}  # per Ray worker process: built reward functions by (name, options)


class RayExecutorConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    function: str
    """Reward name (``rollart.reward`` entry point) or ``package.module:Class``."""
    options: dict[str, Any] = Field(default_factory=dict)
    num_cpus: float = Field(0.25, gt=0)
    pool: str | None = None
    """Custom resource the tasks must run on (the CPU pool); None = anywhere."""
    retries: int = Field(2, ge=0)


def _score_task(name: str, options_json: str, traj: dict[str, Any], submitted: float) -> dict[str, Any]:
    import asyncio
    import json

    from rollart_core.registry import build
    from rollart_reward.wire import result_to_dict, trajectory_from_dict

    started = time.time()
    key = f"{name}\0{options_json}"
    fn = _FUNCTIONS.get(key)
    if fn is None:
        fn = _FUNCTIONS[key] = build("reward", name, json.loads(options_json), where=f"reward {name}")
    t0 = time.perf_counter()
    try:
        result = asyncio.run(fn.score(trajectory_from_dict(traj)))
        out: dict[str, Any] = {"result": result_to_dict(result)}
    except Exception as exc:
        out = {"error": f"{type(exc).__name__}: {exc}"}
    out.update(busy_s=time.perf_counter() - t0, queue_s=max(0.0, started - submitted))
    return out


class RayExecutor:
    """``score`` submits one Ray task per attempt; raises :class:`RewardError` after ``retries``."""

    Config = RayExecutorConfig

    def __init__(self, config: RayExecutorConfig, **_: Any) -> None:
        self.config = config
        self.meter = UtilisationMeter(slots=None)
        self._remote: Any = None

    def _task(self) -> Any:
        if self._remote is None:
            ray = require("ray", "pip install 'rollart-reward[ray]'")
            c = self.config
            self._remote = ray.remote(
                num_cpus=c.num_cpus, max_retries=1, resources={c.pool: 0.001} if c.pool else None
            )(_score_task)
        return self._remote

    async def score(self, trajectory: Trajectory) -> RewardResult:
        import json

        c = self.config
        data, opts = trajectory_to_dict(trajectory), json.dumps(c.options, sort_keys=True)
        last = ""
        self.meter.enter()
        try:
            for attempt in range(c.retries + 1):
                try:
                    out = await self._task().remote(c.function, opts, data, time.time())
                except Exception as exc:  # worker died, task error: retry
                    out = {"error": f"ray task failed: {exc!r}", "busy_s": 0.0, "queue_s": 0.0}
                ok = "result" in out
                self.meter.record(busy_s=out["busy_s"], queue_s=out["queue_s"], ok=ok)
                if ok:
                    return result_from_dict(out["result"])
                last = out["error"]
                log.warning("reward task for %s attempt %d failed: %s", trajectory.traj_id, attempt + 1, last)
                if attempt < c.retries:
                    self.meter.retries += 1
        finally:
            self.meter.leave()
        raise RewardError(f"reward for {trajectory.traj_id} failed after {c.retries + 1} attempts: {last}")

    def stats(self) -> dict[str, float]:
        return self.meter.stats()
