"""run_group: launch G + k, keep the first G finished, cancel exactly the surplus."""

from __future__ import annotations

import asyncio

import pytest

from rollart_core.types import Fate, Trajectory
from rollart_env import run_group


def trajs(n: int) -> list[Trajectory]:
    return [Trajectory(f"t{i}", "task", "env", "g0", seed=1, start_version=0) for i in range(n)]


def runner(delays: dict[str, float], fail: set[str] = frozenset(), cleaned: list[str] | None = None):
    async def run(t: Trajectory) -> Trajectory:
        try:
            await asyncio.sleep(delays[t.traj_id])
            t.fate = Fate.ENV_FAILED if t.traj_id in fail else Fate.FINISHED
            return t
        except asyncio.CancelledError:
            t.fate = t.fate or Fate.CANCELLED_REDUNDANT
            raise
        finally:
            if cleaned is not None:
                cleaned.append(t.traj_id)

    return run


async def test_keeps_the_first_g_and_cancels_the_rest() -> None:
    ts = trajs(6)
    delays = {"t0": 0.05, "t1": 5, "t2": 0.01, "t3": 0.08, "t4": 5, "t5": 0.03}
    cleaned: list[str] = []
    out = await run_group(ts, runner(delays, cleaned=cleaned), group_size=4)
    assert [t.traj_id for t in out.kept] == ["t2", "t5", "t0", "t3"]
    assert {t.traj_id for t in out.cancelled} == {"t1", "t4"}
    assert out.fates() == {"finished": 4, "cancelled_redundant": 2} and out.complete
    assert sorted(cleaned) == sorted(t.traj_id for t in ts)  # every cancelled run cleaned up before return


async def test_failures_do_not_count_and_surplus_masks_them() -> None:
    ts = trajs(5)
    delays = {"t0": 0.01, "t1": 0.02, "t2": 0.03, "t3": 0.04, "t4": 5}
    out = await run_group(ts, runner(delays, fail={"t0"}), group_size=3)
    assert [t.traj_id for t in out.kept] == ["t1", "t2", "t3"]
    assert out.fates() == {"env_failed": 1, "finished": 3, "cancelled_redundant": 1}


async def test_redundancy_zero_and_short_groups() -> None:
    ts = trajs(3)
    out = await run_group(ts, runner({"t0": 0.01, "t1": 0.02, "t2": 0.01}, fail={"t1"}), group_size=3)
    assert not out.complete and len(out.kept) == 2 and out.cancelled == []
    assert sum(out.fates().values()) == 3


async def test_a_run_that_raises_is_counted_not_lost() -> None:
    async def run(t: Trajectory) -> None:
        if t.traj_id == "t1":
            raise RuntimeError("bug in run")
        t.fate = Fate.FINISHED

    out = await run_group(trajs(3), run, group_size=2)
    assert out.fates() == {"finished": 2, "env_failed": 1}


async def test_cancelling_the_group_cancels_every_member() -> None:
    ts = trajs(3)
    task = asyncio.ensure_future(run_group(ts, runner(dict.fromkeys(("t0", "t1", "t2"), 5.0)), group_size=2))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert {t.fate for t in ts} == {Fate.CANCELLED_REDUNDANT}


async def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="group_size"):
        await run_group(trajs(1), runner({}), group_size=2)


async def test_run_batch_keeps_the_first_complete_groups_and_cancels_the_straggling_group() -> None:
    from rollart_env import run_batch

    groups = [
        [Trajectory(f"g{g}t{i}", "task", "env", f"g{g}", seed=g, start_version=0) for i in range(3)]
        for g in range(3)
    ]
    delays = {f"g{g}t{i}": 0.01 * (i + 1) for g in range(3) for i in range(3)}
    delays |= {"g1t0": 5, "g1t1": 5}  # group 1 straggles: 2 of its 3 are slow (k=1 cannot mask that)
    delays["g2t2"] = 5  # group 2 has one straggler, masked by its redundancy
    cleaned: list[str] = []
    out = await run_batch(groups, runner(delays, fail={"g0t1"}, cleaned=cleaned), group_size=2, needed=2)
    assert sorted(g.kept[0].group_id for g in out.complete) == ["g0", "g2"] and out.cancelled_groups == 1
    fates = out.fates()
    # exactly the batch is 'finished'; the straggling group's trajectories and the surplus are cancelled
    assert fates == {"finished": 4, "env_failed": 1, "cancelled_redundant": 4}, fates
    assert sum(fates.values()) == 9 and len(cleaned) == 9  # every task ended (closed) before the return
    assert {t.traj_id for t in groups[1]} <= {
        t.traj_id for t in out.trajectories if t.fate is Fate.CANCELLED_REDUNDANT
    }


async def test_run_batch_with_too_few_complete_groups_returns_what_completed() -> None:
    from rollart_env import run_batch

    groups = [
        [Trajectory(f"g{g}t{i}", "task", "env", f"g{g}", seed=g, start_version=0) for i in range(2)]
        for g in range(2)
    ]
    out = await run_batch(
        groups,
        runner({f"g{g}t{i}": 0.01 for g in range(2) for i in range(2)}, fail={"g1t0"}),
        group_size=2,
        needed=2,
    )
    assert len(out.complete) == 1 and out.cancelled_groups == 0
    assert out.fates() == {"finished": 2, "env_failed": 1, "cancelled_redundant": 1}
    with pytest.raises(ValueError):
        await run_batch(groups, runner({}), group_size=2, needed=3)
