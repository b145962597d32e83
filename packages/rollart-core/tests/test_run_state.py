"""RunState's rules, one test each: every change checks its rule and wakes the waiters, every fate
is counted once, and a failure is set once and raised in every waiter at once."""

from __future__ import annotations

import asyncio

import pytest

from rollart_core.control.clock import ClockError
from rollart_core.control.state import RunState, decide, fate_of
from rollart_core.errors import ConfigError, EngineError, EnvError, EnvTimeoutError, RewardError
from rollart_core.types import Fate, Trajectory, Turn


def _traj(tid: str, group: str, version: int = 0, fate: Fate | None = Fate.FINISHED) -> Trajectory:
    t = Trajectory(tid, "task", "env", group, 0, version)
    t.turns.append(Turn([1, 2], [3, 4], [-0.5, -0.5], [version, version]))
    t.fate = fate
    return t


def test_a_group_is_announced_once() -> None:
    state = RunState()
    state.announce("g", 2)
    with pytest.raises(ValueError, match="already announced"):
        state.announce("g", 2)
    assert state.launched == 2


def test_a_group_of_no_trajectory_is_refused() -> None:
    with pytest.raises(ValueError, match="0 trajectories launched"):
        RunState().announce("g", 0)


def test_a_trajectory_is_settled_only_with_a_fate_and_in_an_announced_group() -> None:
    state = RunState()
    with pytest.raises(ValueError, match="never announced"):
        state.settle(_traj("a", "nope"))
    state.announce("g", 1)
    with pytest.raises(ValueError, match="no fate"):
        state.settle(_traj("a", "g", fate=None))
    assert state.fates == {} and state.buffer.groups["g"].arrived == []


def test_a_fate_is_counted_once() -> None:
    state = RunState()
    state.announce("g", 2)
    a = _traj("a", "g")
    state.settle(a)
    with pytest.raises(ValueError, match="its second"):
        state.settle(a)  # the same trajectory twice
    state.settle(_traj("b", "g"))
    with pytest.raises(ValueError, match="beyond the 2 launched"):
        state.settle(_traj("c", "g"))  # more fates than trajectories launched
    assert state.fates == {"finished": 2} and state.launched == 2


def test_a_finished_trajectory_its_group_no_longer_needs_is_redundant() -> None:
    state = RunState()
    state.announce("g", 3, needed=2)
    assert not state.settle(_traj("a", "g"))
    assert state.settle(_traj("b", "g"))  # the last one the group needed: the caller cancels the rest
    late = _traj("c", "g")
    assert not state.settle(late)
    assert late.fate is Fate.CANCELLED_REDUNDANT
    assert state.fates == {"finished": 2, "cancelled_redundant": 1}


def test_stale_members_are_relabelled_once_when_their_group_is_taken() -> None:
    state = RunState(alpha=1)
    state.announce("g", 2)
    old, new = _traj("old", "g", 0), _traj("new", "g", 2)
    state.settle(old)
    state.settle(new)
    state.trained_to(2)
    assert state.take_batch(1) == [new]
    assert old.fate is Fate.ABORTED_STALE
    assert state.fates == {"finished": 1, "aborted_stale": 1}
    assert state.stale_tokens == 2
    assert state.clock.last_batch == 2  # the batch was taken at the trained version


def test_a_batch_mix_must_sum_to_the_batch() -> None:
    with pytest.raises(ValueError, match="does not sum"):
        RunState().take_batch(2, {"a": 1})


@pytest.mark.parametrize(
    "move",
    [
        lambda s: s.serve(1),  # not trained yet
        lambda s: s.trained_to(0),  # backwards
        lambda s: s.will_serve(2),  # past trained + 1
        lambda s: s.will_serve(0),  # already served
    ],
)
def test_a_version_move_that_breaks_the_clock_is_refused_and_wakes_nobody(move) -> None:
    state = RunState()
    before = (state.clock.trained, state.clock.served, state.clock.coming, state.changes)
    with pytest.raises(ClockError):
        move(state)
    assert (state.clock.trained, state.clock.served, state.clock.coming, state.changes) == before


async def test_every_change_wakes_the_waiters() -> None:
    state = RunState()
    seen: list[int] = []

    async def watch() -> None:
        start = state.changes
        await state.wait_for(lambda: True if state.changes > start else None)
        seen.append(state.changes)

    for change in (
        lambda: state.trained_to(1),
        lambda: state.serve(1),
        lambda: state.will_serve(2),
        lambda: state.announce("g", 1),
        lambda: state.settle(_traj("t", "g", 1)),
        lambda: state.take_batch(1),
        lambda: state.fail(RuntimeError("x")) and None,
    ):
        waiter = asyncio.create_task(watch())
        await asyncio.sleep(0)
        assert not waiter.done()
        change()
        if state.failure is None:
            await asyncio.wait_for(waiter, 5)
        else:
            with pytest.raises(RuntimeError):
                await asyncio.wait_for(waiter, 5)
    assert len(seen) == 6


async def test_a_failure_is_set_once_and_raised_in_every_waiter_at_once() -> None:
    state = RunState()
    waiters = [asyncio.create_task(state.wait_for(lambda: None)) for _ in range(3)]
    served = asyncio.create_task(state.until_served(1))
    await asyncio.sleep(0)
    first, second = ConfigError("first"), ConfigError("second")
    assert state.fail(first)
    assert not state.fail(second)
    assert state.failure is first
    done, _ = await asyncio.wait(waiters, timeout=1)  # at once: no poll interval to wait out
    assert len(done) == 3 and all(w.exception() is first for w in waiters)
    with pytest.raises(ConfigError, match="first"):
        await state.wait_for(lambda: "too late")  # and in every wait that starts later
    # a trajectory waiting for its version is not failed by the run: it is cancelled at the stop
    assert not served.done()
    served.cancel()


async def test_a_wait_looks_again_at_its_deadline_without_a_change() -> None:
    state = RunState()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 0.05
    looks = 0

    def ready() -> bool | None:
        nonlocal looks
        looks += 1
        return True if loop.time() >= deadline else None

    assert await asyncio.wait_for(state.wait_for(ready, wake_at=lambda: deadline), 5)
    assert looks <= 3  # once now, once at the deadline (and at most once more for timer slack)


def test_one_mapping_from_an_exception_to_a_fate() -> None:
    assert fate_of(EngineError("e")) is Fate.GENERATION_FAILED
    assert fate_of(RewardError("r")) is Fate.REWARD_FAILED
    assert fate_of(EnvTimeoutError("t")) is Fate.TIMED_OUT and fate_of(TimeoutError()) is Fate.TIMED_OUT
    assert fate_of(EnvError("x")) is Fate.ENV_FAILED and fate_of(ConfigError("c")) is Fate.ENV_FAILED
    t = _traj("t", "g", fate=None)
    decide(t, EnvError("no slot"), "no environment: no slot")
    assert (t.fate, t.error) == (Fate.ENV_FAILED, "no environment: no slot")
    decide(t, KeyError("k"))
    assert (t.fate, t.error) == (Fate.ENV_FAILED, "KeyError('k')")
    decide(t, TimeoutError())
    assert (t.fate, t.error) == (Fate.TIMED_OUT, "TimeoutError()")
