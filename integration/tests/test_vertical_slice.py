"""The foundation's vertical slice, real end to end: tiny Qwen2 → vLLM (CPU) in a Ray actor →
LLMProxy → multi-turn FrozenLake trajectories → reward → SampleBuffer → GRPO step on the torch
trainer → filesystem weight store → the engine pulls and loads → the next trajectories carry v1."""

from __future__ import annotations

import asyncio
import math

import pytest

from rollart_core.control.runner import run_trajectory
from rollart_core.control.state import RunState
from rollart_core.errors import EngineError
from rollart_core.types import Fate, GenerateRequest, SamplingParams, StepResult, Trajectory

from .conftest import rollout_step

pytestmark = [pytest.mark.vllm, pytest.mark.ray]


# vLLM's CPU build repacks linear weights into oneDNN layouts (the Parameter left behind is empty),
# so compare exactly what it keeps as plain tensors, incl. the fused qkv bias; the logprob check
# below covers the linear layers.
def _trainer_view(params: dict, name: str):
    import torch

    if name.endswith("qkv_proj.bias"):
        pre = name.removesuffix("qkv_proj.bias")
        return torch.cat([params[f"{pre}{x}_proj.bias"] for x in "qkv"]).detach()
    return params[name].detach()


COMPARED = [
    "model.embed_tokens.weight",
    "lm_head.weight",
    "model.layers.0.input_layernorm.weight",
    "model.layers.1.self_attn.qkv_proj.bias",
    "model.norm.weight",
]


async def _engine_tensor(p, name: str):
    import torch

    engine = next(iter(p.proxy.workers.values())).engine
    shape, dtype, raw = await engine.read_parameter(name)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(getattr(torch, dtype)).reshape(shape)


async def _vllm_logprobs(p, ids: list[int]) -> list[float]:
    out = await p.proxy.generate(
        GenerateRequest(
            "score-" + str(hash(tuple(ids)) & 0xFFFF) + str(len(ids)),
            ids,
            SamplingParams(max_tokens=1),
            prompt_logprobs=True,
        )
    )
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    return [float(x) for x in out.prompt_logprobs[1:]]


async def test_one_trajectory_multi_turn(pipeline) -> None:
    p = pipeline
    task = p.config.tasks[0]
    traj = Trajectory("single-0", task.name, "frozenlake", "single", seed=123, start_version=0)
    await run_trajectory(
        traj,
        env=p.make_env(task, 0),
        generator=p.proxy,
        chat=p.chat,
        scorer=p.rewards[task.name],
        sampling=task.sampling,
        max_turns=task.max_turns,
    )
    assert traj.fate is Fate.FINISHED, traj.error
    assert traj.turns and (traj.terminated or traj.truncated)
    allowed = set(p.chat.action_token_ids(["L", "D", "R", "U"]))
    for turn in traj.turns:
        assert len(turn.output_ids) == 1 and set(turn.output_ids) <= allowed  # allowed_token_ids honoured
        assert len(turn.output_logprobs) == 1 and turn.output_logprobs[0] < 0
        assert turn.output_versions == [0]
    assert len(traj.token_ids()) == len(traj.loss_mask()) == len(traj.behaviour_logprobs())
    # the context of turn k+1 starts after everything of turn k: one growing token sequence
    assert traj.info["reward_details"]["success"] == (traj.reward == 1.0)


async def test_env_failure_is_a_fate_not_a_crash(pipeline) -> None:
    from rollart_env import FrozenLakeEnv

    class BrokenOnSecondStep(FrozenLakeEnv):
        n = 0

        async def step(self, action_text: str) -> StepResult:
            self.n += 1
            if self.n == 2:
                raise ConnectionError("environment container went away")
            return await super().step(action_text)

    p = pipeline
    task = p.config.tasks[0]
    env = BrokenOnSecondStep()
    env.config = env.config.model_copy(update={"hole_prob": 0.0, "max_steps": 20})
    traj = Trajectory("broken-0", task.name, "frozenlake", "broken", seed=5, start_version=0)
    await run_trajectory(
        traj,
        env=env,
        generator=p.proxy,
        chat=p.chat,
        scorer=p.rewards[task.name],
        sampling=task.sampling,
        max_turns=10,
    )
    assert traj.fate is Fate.ENV_FAILED and "container went away" in (traj.error or "")


async def test_an_env_call_past_the_tasks_timeout_ends_the_trajectory_timed_out(pipeline) -> None:
    from rollart_env import FrozenLakeEnv

    class HangsOnSecondStep(FrozenLakeEnv):
        n = 0
        closed = False

        async def step(self, action_text: str) -> StepResult:
            self.n += 1
            if self.n == 2:
                await asyncio.Event().wait()  # never returns
            return await super().step(action_text)

        async def close(self) -> None:
            self.closed = True

    p = pipeline
    task = p.config.tasks[0]
    env = HangsOnSecondStep()
    env.config = env.config.model_copy(update={"hole_prob": 0.0, "max_steps": 20})
    traj = Trajectory("hung-0", task.name, "frozenlake", "hung", seed=5, start_version=0)
    await asyncio.wait_for(
        run_trajectory(
            traj,
            env=env,
            generator=p.proxy,
            chat=p.chat,
            scorer=p.rewards[task.name],
            sampling=task.sampling,
            max_turns=10,
            env_timeout_s=0.5,
        ),
        60,
    )
    assert traj.fate is Fate.TIMED_OUT and "step 1 took longer than 0.5 s" in (traj.error or "")
    assert len(traj.turns) == 2 and env.closed  # the first step went through; the env is closed
    with pytest.raises(ValueError, match="env_timeout_s"):
        await run_trajectory(
            traj,
            env=env,
            generator=p.proxy,
            chat=p.chat,
            scorer=p.rewards[task.name],
            sampling=task.sampling,
            max_turns=10,
            env_timeout_s=0,
        )


async def test_engines_are_placed_through_the_resource_plane(pipeline) -> None:
    import ray

    from rollart_core.errors import ConfigError
    from rollart_core.resources import AffinitySpec, WorkerDecl

    p = pipeline
    pg, _ = p.placement.groups["gen"]  # one reserved placement group per engine group
    table = ray.util.placement_group_table(pg)
    assert table["state"] == "CREATED" and table["bundles"][0].get("CPU") == 0.25
    # the engine actor runs inside that reservation: the group's CPU is reserved and fully used
    key = f"CPU_group_{pg.id.hex()}"
    assert ray.cluster_resources().get(key) == 0.25 and ray.available_resources().get(key, 0.0) == 0.0
    # a plan the cluster cannot host fails before anything starts, naming the worker and the pool
    with pytest.raises(ConfigError, match=r"engine group 'decode'.*pool 'H20'"):
        p.resources.validate([WorkerDecl("decode", AffinitySpec(pool="H20"), "engine group")])


async def test_bad_requests_get_clear_errors(pipeline) -> None:
    p = pipeline
    with pytest.raises(EngineError, match="exceeds max_model_len"):
        await p.proxy.generate(GenerateRequest("too-long", [5] * 600, SamplingParams(max_tokens=4)))
    with pytest.raises(EngineError, match="empty prompt"):
        await p.proxy.generate(GenerateRequest("empty", [], SamplingParams(max_tokens=4)))
    with pytest.raises(EngineError):
        await p.proxy.generate(
            GenerateRequest("oov", [5, 6], SamplingParams(max_tokens=2, allowed_token_ids=(10**6,)))
        )
    # the engine still serves after rejecting bad requests
    out = await p.proxy.generate(GenerateRequest("ok", [5, 6, 7], SamplingParams(max_tokens=3)))
    assert len(out.token_ids) == 3


async def test_train_step_updates_engine_weights_and_versions(pipeline) -> None:
    import torch

    p = pipeline
    assert p.trainer.version == 0 and await p.proxy.weight_versions() == {"gen-0": 0}
    # engine and trainer start from the same checkpoint
    trainer_params = dict(p.trainer.model.named_parameters())
    for name in COMPARED:
        assert torch.equal(await _engine_tensor(p, name), _trainer_view(trainer_params, name))

    state = RunState(p.config.loop.alpha, p.trainer.version)
    trajs = await rollout_step(p, step=1, state=state)
    assert {t.fate for t in trajs} == {Fate.FINISHED}
    batch = await state.get_batch(p.config.tasks[0].groups_per_step, version=p.trainer.version)
    assert len(batch) == len(trajs) == 8

    probe = max(batch, key=lambda t: len(t.token_ids())).token_ids()
    vllm_before = await _vllm_logprobs(p, probe)
    trainer_before = p.trainer.logprobs(probe)
    assert max(abs(a - b) for a, b in zip(vllm_before, trainer_before, strict=True)) < 1e-3

    if len({t.reward for t in batch}) == 1:  # all-equal rewards give zero advantages: force a signal
        batch[0].reward = 1.0 - batch[0].reward
    metrics = p.trainer.train_step(batch)
    assert p.trainer.version == 1 and all(math.isfinite(v) for v in metrics.values())

    await asyncio.wrap_future(p.store.push(1, dict(p.trainer.named_weights())))
    assert p.store.latest_version() == 1
    pauses = await p.proxy.update_weights(1)
    assert await p.proxy.weight_versions() == {"gen-0": 1}
    assert all(v >= 0 for v in pauses.values())

    # the engine now holds exactly the trainer's weights
    trainer_params = dict(p.trainer.model.named_parameters())
    for name in COMPARED:
        assert torch.equal(await _engine_tensor(p, name), _trainer_view(trainer_params, name)), name

    # the logprobs of a fixed sampled sequence moved the way the trainer's own forward says
    vllm_after = await _vllm_logprobs(p, probe)
    trainer_after = p.trainer.logprobs(probe)
    d_vllm = [a - b for a, b in zip(vllm_after, vllm_before, strict=True)]
    d_trainer = [a - b for a, b in zip(trainer_after, trainer_before, strict=True)]
    assert max(abs(x) for x in d_trainer) > 1e-2  # the update really changed the policy
    assert max(abs(a - b) for a, b in zip(d_vllm, d_trainer, strict=True)) < 2e-3

    # the next trajectories are generated by policy version 1, token by token
    nxt = await rollout_step(p, step=2, state=state)
    assert all(t.fate is Fate.FINISHED for t in nxt)
    assert {v for t in nxt for turn in t.turns for v in turn.output_versions} == {1}
    await state.get_batch(p.config.tasks[0].groups_per_step, version=1)


async def test_redundant_rollouts_cancel_exactly_the_surplus(pipeline) -> None:
    from rollart_core.control.rollout import Rollout

    p = pipeline
    task = p.config.tasks[0]
    old = task.redundancy, task.max_turns
    task.redundancy, task.max_turns = 3, 6
    try:
        ro = Rollout(p, RunState(p.config.loop.alpha, max((await p.proxy.weight_versions()).values())))
        gid = ro.launch_group(0, tag="red")
        await ro.wait_all()
        mine = [t for t in ro.drain_finished() if t.group_id == gid]
        assert len(mine) == task.group_size + 3  # every launched trajectory is accounted for
        fates = [t.fate for t in mine]
        assert fates.count(Fate.FINISHED) == task.group_size
        assert fates.count(Fate.CANCELLED_REDUNDANT) == 3 == ro.fates["cancelled_redundant"]
        batch = await ro.state.get_batch(1, version=ro.state.clock.served)
        assert len(batch) == task.group_size and {t.group_id for t in batch} == {gid}
        # the cancelled requests are gone from the inference worker, not just from our side (the
        # abort reaches the engine's actor after the trajectory's cancellation returned)
        engine = next(iter(p.proxy.workers.values())).engine
        deadline = asyncio.get_running_loop().time() + 10.0
        while (inflight := (await engine.get_stats())["inflight"]) and (
            asyncio.get_running_loop().time() < deadline
        ):
            await asyncio.sleep(0.05)
        assert inflight == 0
    finally:
        task.redundancy, task.max_turns = old


async def test_a_group_admitted_ahead_generates_only_on_the_coming_version(pipeline) -> None:
    """Async admission ahead of a weight update: the group's environments reset at once, its first
    generation waits until the engines serve the coming version, and every token is of that version
    (the group is not stale by the time it is trained)."""
    from rollart_core.control.rollout import Rollout

    p = pipeline
    task = p.config.tasks[0]
    v = p.trainer.version
    assert set((await p.proxy.weight_versions()).values()) == {v}
    ro = Rollout(p)  # its state: trained and served version v
    gid = ro.launch_group(0, tag="ahead", start_version=v + 1)
    mine = [t for t, _ in ro.inflight.values() if t.group_id == gid]
    assert mine and all(t.start_version == v + 1 for t in mine)

    async def reset_done() -> None:
        while not all("env" in t.timings for t in mine):
            await asyncio.sleep(0.01)

    await asyncio.wait_for(reset_done(), 60)
    assert all(not t.turns and t.fate is None for t in mine)  # reset, holding before the first turn

    # meanwhile a step is trained on a batch of version v and its weights are served
    trajs = await rollout_step(p, step=90, state=ro.state)
    batch = await ro.state.get_batch(task.groups_per_step, version=v)
    assert {t.group_id for t in batch} == {t.group_id for t in trajs} and gid not in {
        t.group_id for t in batch
    }
    assert all(not t.turns for t in mine)  # still waiting: the engines serve v
    p.trainer.train_step(batch)
    await asyncio.wrap_future(p.store.push(v + 1, dict(p.trainer.named_weights())))
    await p.proxy.update_weights(v + 1)
    ro.state.trained_to(v + 1)
    ro.state.serve(v + 1)  # wakes the group waiting for it
    await asyncio.wait_for(ro.wait_all(), 120)
    assert all(t.fate is Fate.FINISHED for t in mine), [t.error for t in mine]
    assert {x for t in mine for turn in t.turns for x in turn.output_versions} == {v + 1}
    assert len(await ro.state.get_batch(1, version=v + 1 + ro.state.alpha)) == len(mine)  # fresh at the bound
