"""``n > 1`` as a group, on an in-process fake engine (named as such) behind the real proxy and the
real endpoint app (the tiny model's real chat template and tokenizer): ``n`` choices, recorded as
``n`` sibling sessions of one group that the trainer's GRPO advantage treats as one group; refused
with a session, above ``max_n``, with ``stream``; nothing recorded when one choice fails. The same
against a real vLLM engine: ``test_server_guard.py::test_n_samples_are_one_group``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollart_core.errors import ConfigError, EngineError
from rollart_core.types import Fate, GenerateOutput, GenerateRequest
from rollart_proxy import LLMProxy, WorkerHandle

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


class FakeEngine:
    """Answers each request with ``max_tokens`` ids derived from its seed (or its order), logprob
    -0.5, version 7. ``fail_at``: the k-th request (from 1) raises; the others wait on ``gate``
    until released, and ``aborted`` lists those cancelled."""

    def __init__(self) -> None:
        self.requests: list[GenerateRequest] = []
        self.aborted: list[str] = []
        self.fail_at: int | None = None
        self.gate: asyncio.Event | None = None
        self.is_started = True

    async def start(self) -> str:
        return "fake"

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        self.requests.append(request)
        k = len(self.requests)
        if k == self.fail_at:
            await asyncio.sleep(0.01)
            raise EngineError("the fake engine refused this request")
        if self.gate is not None:
            await self.gate.wait()
        base = 20 + 10 * (request.sampling.seed if request.sampling.seed is not None else k)
        ids = [base + i for i in range(request.sampling.max_tokens)]
        return GenerateOutput(request.request_id, ids, [-0.5] * len(ids), [7] * len(ids), "length", "fake")

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def weight_version(self) -> int:
        return 7

    async def update_weights(self, version: int) -> float:
        return 0.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rollart_train.tiny import create_tiny_model

    return create_tiny_model(tmp_path_factory.mktemp("groups") / "tiny")


@pytest.fixture
async def served(model_dir: Path) -> AsyncIterator[tuple[Any, FakeEngine, httpx.AsyncClient]]:
    from rollart_proxy.server import OpenAIServer

    engine = FakeEngine()
    server = OpenAIServer(
        LLMProxy([WorkerHandle("fake", engine)]),
        str(model_dir),
        served_model_name="tiny",
        max_n=4,
        api_key="",
    )
    transport = httpx.ASGITransport(app=server.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://rollart-proxy") as client:
        yield server, engine, client


async def test_n_choices_are_recorded_as_one_group(served: Any) -> None:
    from rollart_proxy.server import group_trajectories
    from rollart_train.losses import batch_advantages

    server, engine, client = served
    r = await client.post("/v1/chat/completions", json={**CHAT, "n": 4, "seed": 5, "logprobs": True})
    assert r.status_code == 200, r.text
    reply = r.json()
    group_id, sessions = reply["rollart"]["group_id"], reply["rollart"]["sessions"]
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2, 3]
    assert sessions == [f"{group_id}-{i}" for i in range(4)] and reply["id"] == group_id
    assert reply["usage"]["completion_tokens"] == 12 and reply["choices"][0]["logprobs"]["content"]
    # one engine request per choice, seeds 5..8: distinct samples of the same prompt
    assert sorted(q.sampling.seed for q in engine.requests) == [5, 6, 7, 8]  # type: ignore[misc]
    assert len({tuple(q.prompt_ids) for q in engine.requests}) == 1
    outputs = [c["token_ids"] for c in reply["rollart"]["choices"]]
    assert len({tuple(o) for o in outputs}) == 4

    # the group's records: n siblings, each its own session, sharing the group id
    r = await client.get(f"/v1/groups/{group_id}")
    members = r.json()["members"]
    assert [m["session_id"] for m in members] == sessions
    calls = [m["calls"][0] for m in members]
    assert {c["group_id"] for c in calls} == {group_id} and [c["group_index"] for c in calls] == [0, 1, 2, 3]
    assert [c["output_ids"] for c in calls] == outputs and all(c["versions"] == [7, 7, 7] for c in calls)
    drained = (await client.post(f"/v1/groups/{group_id}/drain")).json()["members"]
    assert drained == members
    assert (await client.get(f"/v1/groups/{group_id}")).status_code == 404  # taken
    assert server.recorder.get(sessions[0]) == []

    # the trainer's view: four trajectories of one group, advantages relative to each other
    trajs = group_trajectories(drained, group_id, _Decode(server), rewards=[1.0, 0.0, 0.0, 1.0])  # type: ignore[arg-type]
    assert {t.group_id for t in trajs} == {group_id} and [t.traj_id for t in trajs] == sessions
    assert all(t.fate is Fate.FINISHED and t.min_version() == 7 for t in trajs)
    assert [t.turns[0].output_ids for t in trajs] == outputs
    adv = batch_advantages(trajs, "grpo", gamma=1.0, step_weight=1.0, scale_by_std=True)
    assert adv == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-4)  # one group of four, not four groups of one


class _Decode:
    """The part of a ChatFormat that :func:`group_trajectories` uses: decode, by the server's template."""

    def __init__(self, server: Any) -> None:
        self.server = server

    def decode(self, ids: Any) -> str:
        return str(self.server.template.decode(list(ids)))


async def test_a_sibling_is_a_session_the_client_may_continue(served: Any) -> None:
    _, _, client = served
    completion = {"model": "tiny", "max_tokens": 3}
    reply = (await client.post("/v1/completions", json={**completion, "prompt": "a b", "n": 2})).json()
    group_id, (first, _) = reply["rollart"]["group_id"], reply["rollart"]["sessions"]
    assert reply["object"] == "text_completion" and len(reply["choices"]) == 2
    r = await client.post(
        "/v1/completions", json={**completion, "prompt": "a b c"}, headers={"X-Session-Id": first}
    )
    assert r.status_code == 200
    members = (await client.post(f"/v1/groups/{group_id}/drain")).json()["members"]
    assert [len(m["calls"]) for m in members] == [2, 1]


async def test_bad_n_is_refused_and_nothing_is_recorded_half_way(served: Any) -> None:
    server, engine, client = served
    for extra, headers, match in [
        ({"n": 2}, {"X-Session-Id": "s1"}, "one call is one turn of one trajectory"),
        ({"n": 5}, {}, "exceeds this server's maximum of 4"),
        ({"n": 2, "stream": True}, {}, "stream"),
        ({"n": 0}, {}, "n"),
    ]:
        r = await client.post("/v1/chat/completions", json={**CHAT, **extra}, headers=headers)
        assert r.status_code == 400 and match in r.json()["error"]["message"], (extra, r.text)
    assert engine.requests == [] and server.recorder.sizes()["recorded_sessions"] == 0

    # the third of four choices fails: the others are aborted on the engine, nothing is recorded
    engine.fail_at, engine.gate = 3, asyncio.Event()
    r = await client.post("/v1/chat/completions", json={**CHAT, "n": 4})
    assert r.status_code == 400 and "refused" in r.json()["error"]["message"]
    assert len(engine.aborted) == 3
    assert server.recorder.sizes() == {"recorded_sessions": 0, "owned_sessions": 0}
    assert server.recorder.group_ids() == []
    assert server.proxy.session_counts()["sessions"] == 0


def test_max_n_must_be_positive(model_dir: Path) -> None:
    from rollart_proxy.server import OpenAIServer

    with pytest.raises(ConfigError, match="max_n"):
        OpenAIServer(LLMProxy([WorkerHandle("fake", FakeEngine())]), str(model_dir), max_n=0, api_key="")  # type: ignore[arg-type]
