from __future__ import annotations

import asyncio

import pytest

from rollart_core.control.buffer import SampleBuffer
from rollart_core.control.state import RunState
from rollart_core.errors import ConfigError
from rollart_core.resources import AffinitySpec, affinity, get_affinity, ray_actor_options
from rollart_core.types import Fate, Trajectory, Turn


def test_affinity_records_only() -> None:
    @affinity(pool="H800", num_gpus=1, num_cpus=4, count=2)
    class Worker:
        def __init__(self, x: int) -> None:
            self.x = x

    assert Worker(3).x == 3  # the class is unchanged and usable without Ray
    spec = get_affinity(Worker)
    assert spec == AffinitySpec(pool="H800", num_cpus=4, num_gpus=1, count=2)
    assert get_affinity(Worker, pool="H20").pool == "H20"
    assert ray_actor_options(spec) == {"num_cpus": 4, "num_gpus": 1, "resources": {"H800": 1}}


def test_affinity_rejects_bad_values_and_serverless_placement() -> None:
    with pytest.raises(ConfigError):
        affinity(count=0)
    with pytest.raises(ConfigError):
        ray_actor_options(AffinitySpec(serverless=True))


def _traj(tid: str, group: str, version: int, fate: Fate = Fate.FINISHED) -> Trajectory:
    t = Trajectory(tid, "task", "env", group, 0, version)
    t.turns.append(Turn([1, 2], [3], [-0.5], [version]))
    t.fate = fate
    return t


async def test_buffer_waits_for_complete_groups() -> None:
    state = RunState(alpha=0)
    state.announce("g0", 2)
    getter = asyncio.create_task(state.get_batch(1, version=0))
    state.settle(_traj("a", "g0", 0))
    await asyncio.sleep(0)  # give the getter a chance to (wrongly) return early
    assert not getter.done()
    state.settle(_traj("b", "g0", 0, Fate.ENV_FAILED))
    batch = await asyncio.wait_for(getter, 5)
    assert [t.traj_id for t in batch] == ["a"]  # failed members are counted, not trained on
    assert state.fates == {"finished": 1, "env_failed": 1}


async def test_buffer_staleness_gate() -> None:
    state = RunState(alpha=1)
    state.announce("g", 3)
    for tid, v in (("v0", 0), ("v1", 1), ("v2", 2)):
        state.settle(_traj(tid, "g", v))
    batch = await state.get_batch(1, version=2)
    assert sorted(t.traj_id for t in batch) == ["v1", "v2"]
    assert state.fates["aborted_stale"] == 1
    assert state.fates["finished"] == 2


async def test_buffer_rejects_unannounced_and_fateless() -> None:
    state = RunState()
    with pytest.raises(ValueError):
        state.settle(_traj("x", "nope", 0))
    state.announce("g", 1)
    t = _traj("y", "g", 0)
    t.fate = None
    with pytest.raises(ValueError):
        state.settle(t)
    assert state.fates == {}  # nothing counted for a refused trajectory
    with pytest.raises(ConfigError):
        SampleBuffer(alpha=-1)


def test_trajectory_flattening() -> None:
    t = Trajectory("t", "task", "env", "g", 0, 0)
    t.turns.append(Turn([1, 2, 3], [4, 5], [-0.1, -0.2], [0, 0]))
    t.turns.append(Turn([6], [7], [-0.3], [1]))
    assert t.token_ids() == [1, 2, 3, 4, 5, 6, 7]
    assert t.loss_mask() == [0, 0, 0, 1, 1, 0, 1]
    assert t.behaviour_logprobs() == [0.0, 0.0, 0.0, -0.1, -0.2, 0.0, -0.3]
    assert t.token_versions() == [-1, -1, -1, 0, 0, -1, 1]
    assert t.min_version() == 0 and t.num_generated() == 3


async def test_buffer_drops_groups_with_nothing_trainable_and_keeps_waiting() -> None:
    state = RunState(alpha=0)
    for g in ("stale", "failed", "good"):
        state.announce(g, 1)
    state.settle(_traj("s", "stale", 0))
    state.settle(_traj("f", "failed", 1, Fate.ENV_FAILED))
    getter = asyncio.create_task(state.get_batch(1, version=1))
    await asyncio.sleep(0)
    assert not getter.done()  # two ready groups, but neither has anything to train on
    state.settle(_traj("g", "good", 1))
    batch = await asyncio.wait_for(getter, 5)
    assert [t.traj_id for t in batch] == ["g"]
    assert state.buffer.pending_groups() == 0
    assert state.buffer.dropped_groups == ["stale", "failed"]
    assert state.fates == {"aborted_stale": 1, "env_failed": 1, "finished": 1}


def _capacity(state: RunState, limit: int):
    """Admission control's wait: until fewer than ``limit`` groups are pending."""
    return state.wait_for(lambda: True if state.buffer.pending_groups() < limit else None)


async def test_admission_wait_is_released_by_consumption() -> None:
    state = RunState()
    state.announce("a", 1)
    waiter = asyncio.create_task(_capacity(state, 1))
    await asyncio.sleep(0)
    assert not waiter.done()
    state.settle(_traj("x", "a", 0))
    await state.get_batch(1, version=0)
    await asyncio.wait_for(waiter, 5)


async def test_dropping_useless_groups_wakes_admission_control() -> None:
    """A producer waiting for capacity must be woken when get_batch drops a stale group."""
    state = RunState(alpha=0)
    state.announce("stale", 1)
    state.settle(_traj("s", "stale", 0))
    producer = asyncio.create_task(_capacity(state, 1))
    getter = asyncio.create_task(state.get_batch(1, version=1))
    await asyncio.wait_for(producer, 5)  # released although nothing was consumed
    state.announce("fresh", 1)
    state.settle(_traj("f", "fresh", 1))
    assert [t.traj_id for t in await asyncio.wait_for(getter, 5)] == ["f"]


async def test_batch_mix_takes_each_tasks_share_however_fast_the_other_task_is() -> None:
    state = RunState(alpha=1)
    for g in ("c0", "c1", "c2"):
        state.announce(g, 1, "calc")
    for g in ("l0", "l1"):
        state.announce(g, 1, "lake")
    assert state.buffer.pending_by_task() == {"calc": 3, "lake": 2}
    for g in ("c0", "c1", "c2", "l0"):  # the fast task's groups are all ready, the slow one's not yet
        state.settle(_traj(g, g, 0))
    getter = asyncio.create_task(state.get_batch(4, {"calc": 2, "lake": 2}, version=0))
    await asyncio.sleep(0)
    assert not getter.done()  # 4 ready groups, but only one of the lake task
    state.settle(_traj("l1", "l1", 0))
    batch = await asyncio.wait_for(getter, 5)
    assert [t.group_id for t in batch] == ["c0", "c1", "l0", "l1"]  # oldest of each task, in launch order
    assert state.buffer.pending_by_task() == {"calc": 1}
    with pytest.raises(ValueError, match="does not sum"):
        await state.get_batch(2, {"calc": 1}, version=0)


async def test_buffer_state_keeps_each_groups_task() -> None:
    state = RunState(alpha=0)
    state.announce("g", 1, "lake")
    state.settle(_traj("t", "g", 0))
    restored = RunState(alpha=0)
    restored.restore(state.buffer.state_dict(), state.fates, state.launched, inflight=0)
    assert restored.buffer.pending_by_task() == {"lake": 1}
    assert restored.fates == {"finished": 1} and restored.launched == 1
    assert [t.traj_id for t in await restored.get_batch(1, {"lake": 1}, version=0)] == ["t"]


def test_the_producer_launches_the_task_furthest_below_its_batch_share() -> None:
    from rollart_core.config import TaskConfig
    from rollart_core.control.admission import next_task

    env, reward = {"impl": "frozenlake"}, {"impl": "success"}
    tasks = [
        TaskConfig(name="calc", env=env, reward=reward, groups_per_step=2),
        TaskConfig(name="lake", env=env, reward=reward, groups_per_step=1),
    ]
    assert next_task(tasks, {}) == 0
    assert next_task(tasks, {"calc": 2}) == 1  # lake has none pending
    assert next_task(tasks, {"calc": 1, "lake": 1}) == 0  # calc: 0.5 of its share pending, lake: 1
    assert next_task(tasks, {"calc": 4, "lake": 1}) == 1
    assert next_task(tasks, {"calc": 4, "lake": 1}, among=[0]) == 0  # only calc can be admitted


def test_admission_launches_a_group_only_if_it_can_be_trained_within_alpha() -> None:
    from rollart_core.control.admission import on_time

    # 2 groups per batch, alpha 2, engines serving the version of the next batch (5): a new group
    # queued behind 5 pending ones is trained in the 3rd batch (version 7), 2 after its start: on time
    assert on_time(5, 2, next_version=5, served_version=5, alpha=2)
    assert not on_time(6, 2, next_version=5, served_version=5, alpha=2)  # 4th batch: version 8
    # while the batch of version 5 trains (the next is 6) on weights 5, one slot fewer
    assert on_time(3, 2, next_version=6, served_version=5, alpha=2)
    assert not on_time(4, 2, next_version=6, served_version=5, alpha=2)
    # a task short of its batch share is admitted whenever the engines are within alpha
    assert on_time(0, 3, next_version=6, served_version=5, alpha=1)
    assert not on_time(0, 3, next_version=6, served_version=5, alpha=0)  # alpha 0: wait for weights 6
    assert on_time(0, 3, next_version=6, served_version=6, alpha=0)


async def test_wait_for_is_woken_by_every_change_of_the_run_state() -> None:
    state = RunState(alpha=1)
    waiter = asyncio.create_task(state.wait_for(lambda: "go" if state.clock.served >= 1 else None))
    await asyncio.sleep(0)
    state.trained_to(1)
    await asyncio.sleep(0)
    assert not waiter.done()
    state.serve(1)  # a version served wakes the waiter: nobody has to remember to notify
    assert await asyncio.wait_for(waiter, 5) == "go"
    waiter = asyncio.create_task(state.wait_for(lambda: state.buffer.pending_groups() or None))
    await asyncio.sleep(0)
    state.announce("g", 1, "calc")
    assert await asyncio.wait_for(waiter, 5) == 1
