"""Workers joining and leaving a serving LLMProxy: added and removed (``add_worker`` /
``remove_worker``), and taken out when they fail a weight update while the others make it.

The engines are in-process stand-ins (the routing logic under test does not depend on the engine; a
real vLLM engine's hand-back is in ``integration/tests/test_elastic.py``). ``HeldEngine`` keeps a
request until it is released (all of its tokens) or aborted (the tokens so far, like vLLM's abort).
"""

from __future__ import annotations

import asyncio

import pytest

from rollart_core.errors import EngineError, WeightSyncError
from rollart_core.types import GenerateOutput, GenerateRequest, SamplingParams
from rollart_proxy import LLMProxy, WorkerHandle
from rollart_proxy.errors import EngineNotStartedError, WorkerUnavailableError


class HeldEngine:
    def __init__(self, name: str, *, started: bool = True, version: int = 0, token: int = 7) -> None:
        self.name, self.started, self.version, self.token = name, started, version, token
        self.hold = False  # requests wait for release() or abort()
        self.paused = False
        self.seen: list[GenerateRequest] = []
        self._done: dict[str, asyncio.Event] = {}
        self._aborted: set[str] = set()
        self.update_gate: asyncio.Event | None = None
        self.update_error: Exception | None = None
        self.restarts = 0

    def _live(self) -> None:
        if not self.started:
            raise EngineNotStartedError(f"{self.name}: not started")

    async def start(self) -> str:
        self.started = True
        return self.name

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        self._live()
        self.seen.append(request)
        rid = request.request_id
        if self.hold:
            ev = self._done.setdefault(rid, asyncio.Event())
            await ev.wait()
            self._live()
        n = request.sampling.max_tokens
        if rid in self._aborted:
            self._aborted.discard(rid)
            n = min(2, n)  # the tokens it had when the abort came
            return GenerateOutput(rid, [self.token] * n, [-0.1] * n, [self.version] * n, "abort", self.name)
        return GenerateOutput(rid, [self.token] * n, [-0.2] * n, [self.version] * n, "length", self.name)

    def release(self) -> None:
        self.hold = False
        for ev in self._done.values():
            ev.set()

    async def abort(self, request_id: str) -> None:
        self._live()
        self._aborted.add(request_id)
        if request_id in self._done:
            self._done[request_id].set()

    async def weight_version(self) -> int:
        self._live()
        return self.version

    async def update_weights(self, version: int) -> float:
        self._live()
        if self.update_gate is not None:
            await self.update_gate.wait()
        if self.update_error is not None:
            raise self.update_error
        self.version = version
        return 0.0

    async def prefetch_weights(self, version: int) -> None:
        self._live()
        if self.update_error is not None:
            raise self.update_error

    async def restart(self) -> None:  # as Ray restarts an actor: fresh, not started, initial weights
        self.restarts += 1
        self.started, self.version, self.update_error = False, 0, None

    async def pause(self, mode: str = "keep") -> None:
        self.paused = True

    async def resume(self) -> None:
        self.paused = False


def req(rid: str, max_tokens: int = 5, session: str | None = None) -> GenerateRequest:
    return GenerateRequest(rid, [1, 2, 3], SamplingParams(max_tokens=max_tokens), session_id=session)


async def until(cond: object, timeout: float = 10.0) -> None:
    async def wait() -> None:
        while not cond():  # type: ignore[operator]
            await asyncio.sleep(0.005)

    await asyncio.wait_for(wait(), timeout)


async def test_an_added_worker_is_started_and_brought_to_the_served_version_first() -> None:
    a = HeldEngine("a")
    proxy = LLMProxy([WorkerHandle("a", a)])
    await proxy.update_weights(3)
    await proxy.suspend()
    b = HeldEngine("b", started=False)  # a fresh actor: __init__ ran, start() did not
    assert await proxy.add_worker(WorkerHandle("b", b)) == 3
    assert b.started and b.version == 3 and b.paused  # joined the suspension too
    await proxy.resume()
    outs = await asyncio.gather(*(proxy.generate(req(f"r{i}")) for i in range(8)))
    assert {o.worker for o in outs} == {"a", "b"}
    assert all(o.versions == [3] * 5 for o in outs)
    assert proxy.elastic["added"] == 1
    with pytest.raises(EngineError, match="'b' exists already"):
        await proxy.add_worker(WorkerHandle("b", HeldEngine("b")))


async def test_an_add_during_a_weight_update_ends_on_the_new_version() -> None:
    a = HeldEngine("a")
    proxy = LLMProxy([WorkerHandle("a", a)])
    a.update_gate = asyncio.Event()
    update = asyncio.create_task(proxy.update_weights(4))
    await until(lambda: proxy.fleet._update_lock.locked())
    b = HeldEngine("b")
    add = asyncio.create_task(proxy.add_worker(WorkerHandle("b", b)))
    await asyncio.sleep(0.05)
    assert not add.done() and "b" not in proxy.workers  # waits for the update: never half-way
    a.update_gate.set()
    await update
    assert await add == 4 and b.version == 4


async def test_a_worker_that_cannot_come_up_is_not_added() -> None:
    class NoUpdate:
        name = "c"

        async def weight_version(self) -> int:
            return 0

        async def generate(self, request: GenerateRequest) -> GenerateOutput:
            raise AssertionError("never routed to")

        async def abort(self, request_id: str) -> None: ...

    proxy = LLMProxy([WorkerHandle("a", HeldEngine("a"))])
    await proxy.update_weights(2)
    with pytest.raises(EngineError, match="c serves version 0, not 2, and cannot update"):
        await proxy.add_worker(WorkerHandle("c", NoUpdate()))  # type: ignore[arg-type]
    assert list(proxy.workers) == ["a"]
    assert (await proxy.generate(req("x"))).worker == "a"


async def test_a_removed_worker_drains_its_requests_and_takes_no_new_one() -> None:
    a, b = HeldEngine("a"), HeldEngine("b")
    proxy = LLMProxy([WorkerHandle("a", a), WorkerHandle("b", b)])
    b.hold = True
    proxy.workers["a"].healthy = False  # so that the first request lands on b
    on_b = asyncio.create_task(proxy.generate(req("on-b", session="s")))
    await until(lambda: proxy.workers["b"].inflight == 1)
    proxy.workers["a"].healthy = True
    remove = asyncio.create_task(proxy.remove_worker("b", drain_timeout_s=30))
    await until(lambda: proxy.workers["b"].draining)
    news = await asyncio.gather(*(proxy.generate(req(f"n{i}", session="s")) for i in range(4)))
    assert {o.worker for o in news} == {"a"}  # sticky session or not: never the draining worker
    assert not remove.done()
    b.release()
    assert (await on_b).worker == "b" and (await on_b).finish_reason == "length"
    assert await remove == {"drained": 1, "handed_back": 0}
    assert list(proxy.workers) == ["a"] and proxy.session_worker("s") == "a"
    assert (await proxy.metrics(engine_stats=False)).keys() == {"a"}


async def test_requests_left_after_the_drain_continue_elsewhere_from_their_tokens() -> None:
    a, b = HeldEngine("a", token=7), HeldEngine("b", token=5)
    proxy = LLMProxy([WorkerHandle("a", a), WorkerHandle("b", b, max_inflight=1)])
    await proxy.update_weights(1)
    b.hold = True
    proxy.workers["a"].healthy = False  # so that both requests land on b
    running = asyncio.create_task(proxy.generate(req("running", max_tokens=6)))
    await until(lambda: proxy.workers["b"].inflight == 1)
    queued = asyncio.create_task(proxy.generate(req("queued", max_tokens=6)))  # waits for b's one slot
    await until(lambda: proxy.workers["b"].metrics.queued == 1)
    proxy.workers["a"].healthy = True
    out = await proxy.remove_worker("b", drain_timeout_s=0.05)
    assert out == {"drained": 0, "handed_back": 2}
    r, q = await running, await queued
    # the running one keeps b's 2 tokens and gets the other 4 from a; the queued one had none
    assert r.token_ids == [5, 5, 7, 7, 7, 7] and r.versions == [1] * 6 and r.worker == "a"
    assert r.logprobs == [-0.1, -0.1, -0.2, -0.2, -0.2, -0.2] and r.finish_reason == "length"
    assert q.token_ids == [7] * 6 and q.worker == "a"
    cont = next(x for x in a.seen if x.request_id == "running")
    assert cont.prompt_ids == [1, 2, 3, 5, 5] and cont.sampling.max_tokens == 4
    assert proxy.elastic == {"added": 0, "removed": 1, "handed_back": 2}
    assert proxy.session_counts()["requests_in_flight"] == 0


async def test_a_client_abort_wins_over_a_hand_back() -> None:
    a, b = HeldEngine("a"), HeldEngine("b")
    proxy = LLMProxy([WorkerHandle("a", a), WorkerHandle("b", b)])
    b.hold = True
    a.hold = True
    on_a = asyncio.create_task(proxy.generate(req("on-a")))
    await until(lambda: proxy.workers["a"].inflight == 1)
    t = asyncio.create_task(proxy.generate(req("x")))
    await until(lambda: proxy.workers["b"].inflight == 1)
    assert await proxy.abort("x") == 1
    out = await t
    assert out.finish_reason == "abort" and out.worker == "b"
    a.release()
    await on_a


async def test_removal_refusals_name_the_reason() -> None:
    a, b = HeldEngine("a"), HeldEngine("b")
    proxy = LLMProxy([WorkerHandle("a", a, pool="p"), WorkerHandle("b", b, pool="q")])
    with pytest.raises(EngineError, match="last healthy worker of pool 'p'"):
        await proxy.remove_worker("a")
    with pytest.raises(EngineError, match="no worker 'z' \\(workers: a, b\\)"):
        await proxy.remove_worker("z")
    with pytest.raises(EngineError, match="drain_timeout_s must be >= 0"):
        await proxy.remove_worker("a", drain_timeout_s=-1)
    # a dead worker can go even when it is its pool's only one: nothing is routed to it
    proxy.workers["b"].healthy = False
    assert await proxy.remove_worker("b") == {"drained": 0, "handed_back": 0}
    assert list(proxy.workers) == ["a"]


async def test_a_dead_worker_mid_hand_back_fails_over() -> None:
    """A removed worker whose engine dies instead of answering the abort: the request is retried on
    another worker like any worker failure."""
    a, b = HeldEngine("a"), HeldEngine("b")
    proxy = LLMProxy([WorkerHandle("a", a), WorkerHandle("b", b)])
    a.hold = b.hold = True
    on_a = asyncio.create_task(proxy.generate(req("on-a")))
    await until(lambda: proxy.workers["a"].inflight == 1)
    t = asyncio.create_task(proxy.generate(req("x")))
    await until(lambda: proxy.workers["b"].inflight == 1)

    async def dies(request_id: str) -> None:
        b._done["x"].set()
        b.started = False  # its generate now raises: the actor is gone
        raise WorkerUnavailableError("b: actor died")

    b.abort = dies  # type: ignore[method-assign]
    a.release()
    await on_a
    await proxy.remove_worker("b", drain_timeout_s=0.01)
    out = await t
    assert out.worker == "a" and out.token_ids == [7] * 5


async def test_an_engine_that_fails_an_update_is_taken_out_and_restarted_while_the_others_go_on() -> None:
    a, b, c = HeldEngine("a"), HeldEngine("b"), HeldEngine("c")
    proxy = LLMProxy([WorkerHandle("a", a), WorkerHandle("b", b), WorkerHandle("c", c)])
    b.update_error = WeightSyncError("b: pulling version 2 took over update_stage_timeout_s=300")
    c.update_gate = asyncio.Event()  # hangs
    proxy.fleet.update_timeout_s = 0.2
    assert await proxy.update_weights(2) == {"a": 0.0}
    assert proxy.version == 2 and a.version == 2
    assert not proxy.workers["b"].healthy and not proxy.workers["c"].healthy
    assert b.restarts == 1 and c.restarts == 1
    assert proxy.workers["b"].metrics.update_failures == 1
    assert {(await proxy.generate(req(f"r{i}"))).worker for i in range(4)} == {"a"}
    c.update_gate.set()
    assert await proxy.check_health() == 2  # both restarted, started and brought to version 2
    assert (b.started, b.version, c.started, c.version) == (True, 2, True, 2)


async def test_an_update_no_engine_could_make_names_each_one() -> None:
    a, b = HeldEngine("a"), HeldEngine("b")
    proxy = LLMProxy([WorkerHandle("a", a), WorkerHandle("b", b)])
    a.update_error = WeightSyncError("a: loading version 3 took over update_stage_timeout_s=1")
    b.update_gate = asyncio.Event()
    proxy.fleet.update_timeout_s = 0.1
    with pytest.raises(
        WeightSyncError,
        match=r"no engine could update to version 3: a: loading .*; b: update to version 3 took over update_timeout_s=0.1",
    ):
        await proxy.update_weights(3)
    assert proxy.version is None and a.restarts == b.restarts == 0  # nothing to fall back on: the run stops


async def test_a_failed_prefetch_takes_the_engine_out_too() -> None:
    a, b = HeldEngine("a"), HeldEngine("b")
    proxy = LLMProxy([WorkerHandle("a", a), WorkerHandle("b", b)])
    b.update_error = RuntimeError("disk full")
    await proxy.prefetch_weights(1)
    assert proxy.workers["a"].healthy and not proxy.workers["b"].healthy
    assert b.restarts == 0  # its served weights are untouched: recovery updates it, no restart
