"""Fast checks of the proxy's control logic on small in-process fakes (named as such): bounded session
tables, the bounded wait queue, recovery of a restarted worker onto the served version, fan-outs that
survive a dead worker. The same paths run against real vLLM in Ray actors in
integration/tests/test_engine_restart.py."""

from __future__ import annotations

import asyncio

import pytest

from rollart_core.errors import EngineError
from rollart_core.types import GenerateOutput, GenerateRequest, SamplingParams
from rollart_proxy import LLMProxy, WorkerHandle
from rollart_proxy.errors import EngineNotStartedError, ProxyOverloadedError, WorkerUnavailableError


class FakeEngine:
    """An engine that answers at once (or when ``gate`` opens); ``restart()`` makes it behave like an
    actor Ray restarted (not started, version 0); ``dead`` like one whose process is gone."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.version = 0
        self.is_started = True
        self.dead = False
        self.gate: asyncio.Event | None = None
        self.starts = 0
        self.start_calls = 0
        self.start_gate: asyncio.Event | None = None
        self.paused = False

    def _alive(self) -> None:
        if self.dead:
            raise WorkerUnavailableError(f"{self.name}: actor died")
        if not self.is_started:
            raise EngineNotStartedError(f"{self.name}: not started")

    def restart(self) -> None:
        self.dead, self.is_started, self.version, self.paused = False, False, 0, False

    async def start(self) -> str:
        self.start_calls += 1
        if self.start_gate is not None:  # an engine start takes a while
            await self.start_gate.wait()
        self.starts += 1
        self.is_started = True
        return self.name

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        self._alive()
        if self.gate is not None:
            await self.gate.wait()
        self._alive()
        return GenerateOutput(request.request_id, [7], [-0.5], [self.version], "length", self.name)

    async def abort(self, request_id: str) -> None:
        self._alive()

    async def weight_version(self) -> int:
        self._alive()
        return self.version

    async def update_weights(self, version: int) -> float:
        self._alive()
        self.version = version
        return 0.0

    async def pause(self, mode: str = "keep") -> None:
        self._alive()
        self.paused = True

    async def resume(self) -> None:
        self._alive()
        self.paused = False


def req(rid: str, session: str | None = None) -> GenerateRequest:
    return GenerateRequest(rid, [1, 2, 3], SamplingParams(max_tokens=1), session_id=session)


async def test_session_tables_stay_bounded_after_many_sessions() -> None:
    proxy = LLMProxy(
        [WorkerHandle("a", FakeEngine("a")), WorkerHandle("b", FakeEngine("b"))], max_sessions=100
    )
    for i in range(2000):  # a client that never ends its sessions
        await proxy.generate(req(f"r{i}", session=f"s{i}"))
    assert proxy.session_counts() == {"sessions": 100, "sessions_in_flight": 0, "requests_in_flight": 0}
    assert (
        proxy.session_worker("s1999") is not None and proxy.session_worker("s0") is None
    )  # LRU: oldest gone
    for i in range(1900, 2000):  # the runner ends each trajectory's session
        proxy.end_session(f"s{i}")
    assert proxy.session_counts()["sessions"] == 0
    # a session with a request in flight stays abortable until it ends, then leaves no entry
    eng = proxy.workers["a"].engine
    eng.gate = asyncio.Event()  # type: ignore[attr-defined]
    proxy.workers["b"].healthy = False
    t = asyncio.create_task(proxy.generate(req("slow", session="live")))
    await asyncio.wait_for(_until(lambda: proxy.session_counts()["sessions_in_flight"] == 1), 10)
    proxy.end_session("live")
    assert await proxy.abort("live") == 1
    eng.gate.set()  # type: ignore[attr-defined]
    await asyncio.wait_for(t, 10)
    assert proxy.session_counts() == {"sessions": 1, "sessions_in_flight": 0, "requests_in_flight": 0}


async def _until(cond: object) -> None:
    while not cond():  # type: ignore[operator]
        await asyncio.sleep(0.005)


async def test_wait_queue_is_bounded() -> None:
    eng = FakeEngine("a")
    eng.gate = asyncio.Event()
    proxy = LLMProxy([WorkerHandle("a", eng, max_inflight=2, max_queued=3)])
    tasks = [asyncio.create_task(proxy.generate(req(f"q{i}"))) for i in range(5)]
    await asyncio.wait_for(_until(lambda: proxy.workers["a"].outstanding == 5), 10)
    with pytest.raises(ProxyOverloadedError, match="queue is full"):
        await proxy.generate(req("one-too-many"))
    eng.gate.set()
    assert len(await asyncio.wait_for(asyncio.gather(*tasks), 10)) == 5
    assert (await proxy.generate(req("after"))).worker == "a"


async def test_restarted_worker_is_started_and_updated_before_it_serves() -> None:
    a, b = FakeEngine("a"), FakeEngine("b")
    proxy = LLMProxy([WorkerHandle("a", a), WorkerHandle("b", b)], max_retries=1)
    await proxy.update_weights(3)
    b.dead = True
    outs = await asyncio.gather(*(proxy.generate(req(f"x{i}")) for i in range(4)))  # b's requests fail over
    assert {o.worker for o in outs} == {"a"} and not proxy.workers["b"].healthy
    assert await proxy.check_health() == 0  # still dead
    b.restart()
    await proxy.suspend()
    assert await proxy.check_health() == 1
    assert b.starts == 1 and b.version == 3 and b.paused  # joined the suspension too
    await proxy.resume()
    m = await proxy.metrics()
    assert m["b"]["restarts_seen"] == 1 and m["b"]["recovered"] == 1 and m["b"]["healthy"]
    # a restart found by the health loop, with no request failing first
    b.restart()
    proxy.start_health_loop(0.01)
    try:
        await asyncio.wait_for(_until(lambda: proxy.workers["b"].metrics.recovered == 2), 10)
    finally:
        await proxy.stop_health_loop()
    assert b.version == 3 and proxy.workers["b"].metrics.restarts_seen == 2


async def test_lone_worker_restart_requests_wait_and_one_start_serves_them() -> None:
    """The pool's only engine dies and Ray restarts it: requests wait for its recovery instead of
    failing, and the many waiters share one start of the restarted engine."""
    b = FakeEngine("b")
    proxy = LLMProxy([WorkerHandle("b", b)], recover_poll_s=0.01)
    await proxy.update_weights(2)
    b.dead = True
    tasks = [asyncio.create_task(proxy.generate(req(f"w{i}"))) for i in range(8)]
    await asyncio.wait_for(_until(lambda: not proxy.workers["b"].healthy), 10)
    b.start_gate = asyncio.Event()
    b.restart()  # back, not started, on version 0
    await asyncio.wait_for(_until(lambda: b.start_calls >= 1), 10)
    assert not any(t.done() for t in tasks)  # still waiting, none failed
    b.start_gate.set()
    outs = await asyncio.wait_for(asyncio.gather(*tasks), 10)
    assert {o.worker for o in outs} == {"b"} and all(o.versions == [2] for o in outs)
    assert b.start_calls == 1 and b.starts == 1  # one recovery, joined by all eight
    assert proxy.workers["b"].metrics.recovered == 1


async def test_wait_for_a_dead_pool_is_bounded() -> None:
    c = FakeEngine("c")
    c.dead = True
    lone = LLMProxy([WorkerHandle("c", c)], recover_wait_s=0.05, recover_poll_s=0.01)
    with pytest.raises(WorkerUnavailableError, match=r"none recovered within recover_wait_s=0.05"):
        await asyncio.wait_for(lone.generate(req("x")), 10)
    at_once = LLMProxy([WorkerHandle("c", c)], recover_wait_s=0)
    with pytest.raises(WorkerUnavailableError, match=r"failed on|no healthy worker"):
        await asyncio.wait_for(at_once.generate(req("y")), 10)
    with pytest.raises(EngineError, match="recover_wait_s"):
        LLMProxy([WorkerHandle("c", c)], recover_wait_s=-1)


async def test_fan_out_skips_a_dead_worker_and_recovery_catches_up() -> None:
    a, b = FakeEngine("a"), FakeEngine("b")
    proxy = LLMProxy([WorkerHandle("a", a), WorkerHandle("b", b)])
    b.dead = True
    assert set(await proxy.update_weights(1)) == {"a"}
    assert not proxy.workers["b"].healthy and await proxy.weight_versions() == {"a": 1}
    b.dead = False  # came back without a restart, on version 0
    assert await proxy.check_health() == 1 and b.version == 1 and b.starts == 0
