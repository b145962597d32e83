"""Fault injection on the reward side: ``bursty`` waits a seeded log-normal cost, then scores with ``inner``."""

from __future__ import annotations

import time

from rollart_core.registry import build
from rollart_core.types import Trajectory
from rollart_reward import BurstyReward


def _traj(traj_id: str, env_return: float = 1.0) -> Trajectory:
    return Trajectory(
        traj_id=traj_id, task="t", env_id="e", group_id="g", seed=0, start_version=0, env_return=env_return
    )


def test_the_cost_is_seeded_per_trajectory_and_log_normal() -> None:
    reward = build("reward", "bursty", {"inner": {"impl": "env_return"}, "work_s": 0.1, "sigma": 1.0}, "x")
    assert isinstance(reward, BurstyReward) and reward.stateless
    costs = [reward.cost(f"t{i}") for i in range(2000)]
    assert costs == [reward.cost(f"t{i}") for i in range(2000)]  # same trajectory, same cost
    assert 0.08 < sorted(costs)[1000] < 0.12  # the median is work_s
    other = build("reward", "bursty", {"inner": {"impl": "env_return"}, "seed": 1}, "x")
    assert [other.cost(f"t{i}") for i in range(10)] != costs[:10]


async def test_it_scores_with_the_inner_reward_after_the_cost() -> None:
    free = build("reward", "bursty", {"inner": {"impl": "env_return"}, "work_s": 0.0}, "x")
    assert free.cost("t0") == 0.0
    assert (await free.score(_traj("t0", 0.5))).score == 0.5
    slow = build("reward", "bursty", {"inner": {"impl": "env_return"}, "work_s": 0.05, "sigma": 0.0}, "x")
    start = time.perf_counter()
    assert (await slow.score(_traj("t1", 2.0))).score == 2.0
    assert time.perf_counter() - start >= 0.045
