"""The ``megatron`` rank kind of RayTrainerGroup: config validation and pipeline wiring (fast, no Ray),
and — where megatron-core is installed — a real 2-rank tensor-parallel group on CPU over gloo against a
world of one (real Ray on 127.0.0.1, real megatron-core GPTModel and tensor-parallel layers).

On CPU the trainer runs ``device: cpu``: Megatron's DDP, optimizer and schedule need CUDA and are
replaced by the stand-ins of ``rollart_train._megatron_cpu``; their CUDA path is checked by
``integration/gpu/megatron_check.py`` on a GPU machine."""

from __future__ import annotations

import importlib.util
import math
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from rollart_core.config import RunConfig
from rollart_core.errors import ConfigError
from rollart_core.resources import LOOPBACK_ENV
from rollart_core.types import Trajectory, Turn
from rollart_train import RayTrainerGroup, RayTrainerGroupConfig
from rollart_train.megatron_config import MegatronTrainerConfig
from rollart_train.tiny import create_tiny_model

HAS_MCORE = importlib.util.find_spec("megatron") is not None and (
    importlib.util.find_spec("megatron.core") is not None
)
POOL = "H800"
CPU_OPTS: dict[str, Any] = {"device": "cpu", "bf16": False, "lr": 1e-3, "micro_batch_size": 2}


# config and wiring (no Ray, no model) ----------------------------------------------------------


def test_megatron_group_config_validates_layout_and_device() -> None:
    cfg = RayTrainerGroupConfig(
        worker="megatron",
        ranks=4,
        num_gpus_per_rank=1,
        options={"tensor_parallel": 2, "pipeline_parallel": 2},
    )
    rank = cfg.rank_config()
    assert isinstance(rank, MegatronTrainerConfig)
    assert (rank.world_size, rank.tensor_parallel, rank.pipeline_parallel, rank.device) == (4, 2, 2, "cuda")
    with pytest.raises(
        ValueError,
        match=r"tensor_parallel \(2\) x pipeline_parallel \(1\) = 2 must divide the number of ranks \(3\)",
    ):
        RayTrainerGroupConfig(worker="megatron", ranks=3, num_gpus_per_rank=1, options={"tensor_parallel": 2})
    with pytest.raises(
        ValueError, match=r"options.device is 'cuda' \(MegatronTrainerConfig's default: 'cuda'\).*is 0"
    ):
        RayTrainerGroupConfig(worker="megatron", ranks=2, options={"tensor_parallel": 2})
    with pytest.raises(ValueError, match=r"options.device is 'cpu'.*num_gpus_per_rank is 1"):
        RayTrainerGroupConfig(worker="megatron", ranks=2, num_gpus_per_rank=1, options=CPU_OPTS)
    with pytest.raises(ValueError, match="device: cpu runs pipeline_parallel 1 only"):
        RayTrainerGroupConfig(worker="megatron", ranks=2, options={**CPU_OPTS, "pipeline_parallel": 2})
    with pytest.raises(ValueError, match="device: cpu trains in float32"):
        RayTrainerGroupConfig(worker="megatron", options={"device": "cpu"})
    with pytest.raises(ValueError, match=r"options \(MegatronTrainerConfig\): micro_batch_size"):
        RayTrainerGroupConfig(worker="megatron", num_gpus_per_rank=1, options={"micro_batch_size": 0})
    with pytest.raises(ValueError, match=r"packing: Extra inputs are not permitted"):
        RayTrainerGroupConfig(worker="megatron", num_gpus_per_rank=1, options={"packing": True})


def _run_config(trainer: dict[str, Any]) -> RunConfig:
    return RunConfig.model_validate(
        {
            "name": "megatron-wiring",
            "output_dir": "runs/megatron-wiring",
            "model": {"path": "models/tiny"},
            "engines": [{"name": "gen", "impl": "vllm", "count": 1}],
            "tasks": [
                {
                    "name": "t",
                    "env": {"impl": "frozenlake"},
                    "reward": {"impl": "success"},
                    "engine_group": "gen",
                }
            ],
            "trainer": trainer,
            "ray": {"resources": {POOL: 2}},
        }
    )


def test_pipeline_builds_a_megatron_group_config() -> None:
    from rollart_core.control.pipeline import trainer_group_config

    cfg = _run_config(
        {"impl": "megatron", "ranks": 2, "pool": POOL, "num_gpus": 1, "options": {"tensor_parallel": 2}}
    )
    group = trainer_group_config(cfg)
    assert isinstance(group, RayTrainerGroupConfig)
    assert (group.worker, group.ranks, group.pool, group.num_gpus_per_rank) == ("megatron", 2, POOL, 1.0)
    assert group.rank_config().tensor_parallel == 2 and group.rank_config().world_size == 2
    decl = RayTrainerGroup.worker_decl(group)
    assert (decl.spec.count, decl.spec.pool, decl.spec.num_gpus) == (2, POOL, 1.0)
    bad = _run_config({"impl": "megatron", "ranks": 3, "num_gpus": 1, "options": {"tensor_parallel": 2}})
    with pytest.raises(ConfigError, match=r"= 2 must divide the number of ranks \(3\)"):
        trainer_group_config(bad)
    no_gpu = _run_config({"impl": "megatron", "ranks": 2, "options": {"tensor_parallel": 2}})
    with pytest.raises(ConfigError, match="num_gpus_per_rank is 0"):
        trainer_group_config(no_gpu)


# a real 2-rank tensor-parallel group on CPU ----------------------------------------------------


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    for k, v in LOOPBACK_ENV.items():
        os.environ.setdefault(k, v)
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(
            num_cpus=4,
            resources={POOL: 2},
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            log_to_driver=False,
        )
    yield
    if started:
        ray.shutdown()


def make_batch(logprobs: Any, perturb: bool = True) -> list[Trajectory]:
    """Eight trajectories of different lengths in two groups; behaviour logprobs are the policy's own,
    perturbed unless ``perturb`` is False (so the ratios are not all 1)."""
    g = torch.Generator().manual_seed(11)
    out = []
    for i in range(8):
        ctx = torch.randint(3, 400, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
        gen = torch.randint(3, 400, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist()
        lps = logprobs(ctx + gen)[-len(gen) :]
        turn = Turn(
            context_ids=ctx,
            output_ids=gen,
            output_logprobs=[x - 0.05 * (k % 3) * perturb for k, x in enumerate(lps)],
            output_versions=[0] * len(gen),
        )
        out.append(
            Trajectory(
                traj_id=f"t{i}",
                task="t",
                env_id="e",
                group_id=f"g{i % 2}",
                seed=i,
                start_version=0,
                turns=[turn],
                reward=float((i * 7) % 5),
            )
        )
    return out


def _config(
    ranks: int, tp: int, options_extra: dict[str, Any] | None = None, **kw: Any
) -> RayTrainerGroupConfig:
    return RayTrainerGroupConfig(
        worker="megatron",
        ranks=ranks,
        pool=POOL,
        options={**CPU_OPTS, "tensor_parallel": tp, "num_threads": 1, **(options_extra or {})},
        call_timeout_s=300,
        placement_timeout_s=300,
        **kw,
    )


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


STATS = ("loss", "clip_frac", "approx_kl", "behav_weight", "train_tokens", "grad_norm")


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.skipif(not HAS_MCORE, reason="megatron-core is not installed (extra [megatron])")
def test_two_rank_tensor_parallel_group_matches_world_of_one_and_restarts(
    ray_session: None, tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    model = create_tiny_model(tmp_path / "tiny")
    hf = load_file(str(model / "model.safetensors"))
    probe = [5, 17, 99, 3, 250, 7, 42, 8, 11, 300]

    with RayTrainerGroup(_config(1, 1), model_path=model) as one:  # the world of one, in its own actor
        assert one.resumed_state["layout"] == {
            "rank": 0, "tp_rank": 0, "pp_rank": 0, "dp_rank": 0, "tp": 1, "pp": 1, "dp": 1
        }  # fmt: skip
        start_one = dict(one.named_weights())
        lp_one = one.logprobs(probe)
        batch = make_batch(one.logprobs)
        m_one = one.train_step(batch)
        after_one = dict(one.named_weights())
    assert _max_diff(start_one, hf) == 0.0  # HF → Megatron → HF is exact in float32
    assert _max_diff(after_one, start_one) > 5e-4  # the step moved the weights

    ckpts = tmp_path / "ckpt"
    group = RayTrainerGroup(_config(2, 2, max_restarts=1, checkpoint_dir=str(ckpts)), model_path=model)
    try:
        assert group.resumed_state["layout"]["tp"] == 2 and group.resumed_state["layout"]["dp"] == 1
        assert len(set(group.pids)) == 2 and os.getpid() not in group.pids
        # the TP shards, gathered on rank 0, are the Hugging Face weights again
        assert _max_diff(dict(group.named_weights()), hf) == 0.0
        assert group.logprobs(probe) == pytest.approx(lp_one, abs=1e-5)
        m_two = group.train_step(batch)
        for k in STATS:
            assert m_two[k] == pytest.approx(m_one[k], rel=1e-4, abs=1e-6), k
        assert m_two["version"] == 1.0 and m_two["update_successful"] == 1.0
        # Adam's first step is ~lr * sign(grad): rounding in the TP reductions flips at most tiny grads
        assert _max_diff(dict(group.named_weights()), after_one) < 1e-4

        group.save(ckpts / "checkpoint-1")
        assert sorted(p.name for p in (ckpts / "checkpoint-1" / "megatron_optim").iterdir()) == [
            "rank0.pt",
            "rank1.pt",
        ]
        m_second = group.train_step(batch)  # Adam's second step: needs the moments of the first
        second = dict(group.named_weights())
        old = group.pids
        os.kill(old[1], signal.SIGKILL)
        m_again = group.train_step(batch)  # rebuilt from checkpoint-1 (weights + optimizer), retried
        assert m_again["trainer_restarts"] == 1.0 and m_again["restored_version"] == 1.0
        assert m_again["lost_steps"] == 1.0 and m_again["version"] == 3.0
        assert m_again["optimizer_steps"] == 2.0  # checkpoint-1's step + this one
        assert not set(group.pids) & set(old)
        assert m_again["loss"] == pytest.approx(m_second["loss"], rel=1e-6, abs=1e-9)
        # the same update as the step that was lost: the optimizer state came back with the weights
        assert _max_diff(dict(group.named_weights()), second) < 1e-6
    finally:
        group.close()


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.skipif(not HAS_MCORE, reason="megatron-core is not installed (extra [megatron])")
def test_trajectory_mean_weighs_every_trajectory_the_same(ray_session: None, tmp_path: Path) -> None:
    from rollart_train.losses import grpo_advantages

    model = create_tiny_model(tmp_path / "tiny")
    group = RayTrainerGroup(_config(1, 1, options_extra={"loss_agg": "trajectory_mean"}), model_path=model)
    try:
        batch = make_batch(group.logprobs, perturb=False)  # ratio 1: the loss is minus the mean advantage
        m = group.train_step(batch)
    finally:
        group.close()
    adv = grpo_advantages(batch)
    lengths = [t.num_generated() for t in batch]
    per_trajectory = -sum(adv) / len(adv)  # each trajectory once (a GRPO group's advantages sum to 0)
    per_token = -sum(a * n for a, n in zip(adv, lengths, strict=True)) / sum(lengths)
    assert abs(per_token - per_trajectory) > 0.05  # the batch tells the two apart
    assert m["loss"] == pytest.approx(per_trajectory, abs=1e-4)
    assert m["train_tokens"] == sum(lengths)


def _last_turn_batch(logprobs: Any) -> list[Trajectory]:
    """Two groups of three multi-turn episodes whose turns are sequences of their own (task
    ``context: last_turn``); members of a group revisit the same prompts (GiGPO's step groups);
    behaviour logprobs are the policy's own given each turn's prompt only, lowered by 0.05 per turn
    index (ratio ``exp(0.05 k)`` at turn ``k``, inside the clip range)."""
    states = [[5, 6, 7, 8], [5, 9, 7, 8], [5, 9, 9, 8]]
    episodes = [  # (state index, action) per turn, reward
        ([(0, 40), (1, 41), (2, 40)], 1.0),
        ([(0, 41), (0, 42)], 0.0),  # its second turn revisits the first state (a step group across turns)
        ([(0, 40), (1, 42)], 0.0),
    ]
    out = []
    for g in range(2):
        for i, (turns, reward) in enumerate(episodes):
            built = []
            for k, (s, action) in enumerate(turns):
                ctx = [x + 50 * g for x in states[s]]
                built.append(
                    Turn(
                        context_ids=ctx,
                        output_ids=[action],
                        output_logprobs=[logprobs([*ctx, action])[-1] - 0.05 * k],
                        output_versions=[0],
                        new_sequence=k > 0,
                    )
                )
            out.append(
                Trajectory(
                    f"g{g}-{i}", "t", "e", f"g{g}", seed=g, start_version=0, turns=built, reward=reward
                )
            )
    return out


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.skipif(not HAS_MCORE, reason="megatron-core is not installed (extra [megatron])")
def test_per_turn_sequences_train_with_their_gigpo_advantages(ray_session: None, tmp_path: Path) -> None:
    """Current-state-only prompts: every turn is its own sequence carrying its own step advantage."""
    from rollart_train.losses import grpo_advantages, step_advantages

    model = create_tiny_model(tmp_path / "tiny")
    opts = {"advantage": "gigpo", "gamma": 0.9}
    group = RayTrainerGroup(_config(1, 1, options_extra=opts), model_path=model)
    try:
        batch = _last_turn_batch(group.logprobs)
        before = dict(group.named_weights())
        m = group.train_step(batch)
        moved = _max_diff(dict(group.named_weights()), before)
    finally:
        group.close()
    ratio = [math.exp(0.05 * k) for t in batch for k in range(len(t.turns))]  # one token per turn
    per_turn = [a for turns in step_advantages(batch, gamma=0.9) for a in turns]
    per_episode = [a for a, t in zip(grpo_advantages(batch), batch, strict=True) for _ in t.turns]
    expected = -sum(r * a for r, a in zip(ratio, per_turn, strict=True)) / len(ratio)
    episode_only = -sum(r * a for r, a in zip(ratio, per_episode, strict=True)) / len(ratio)
    assert abs(expected - episode_only) > 1e-3  # 10x the tolerance below: the batch tells them apart
    assert m["loss"] == pytest.approx(expected, abs=1e-4)
    assert m["train_tokens"] == len(ratio) == 14
    assert moved > 5e-4


def _sampled_batch(model_dir: Path) -> list[Trajectory]:
    """Two-turn episodes sampled under a processed distribution: turn 1 restricted to four tokens at
    temperature 0.7, turn 2 any token at temperature 1.3. Behaviour logprobs are those of the
    processed distribution (vLLM ``processed_logprobs``), computed here by the Hugging Face model."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    allowed = (10, 20, 30, 40)
    g = torch.Generator().manual_seed(5)
    out = []
    for i in range(6):
        turns = []
        for allow, temp in ((allowed, 0.7), (None, 1.3)):
            ctx = torch.randint(3, 400, (int(torch.randint(2, 8, (1,), generator=g)),), generator=g).tolist()
            pool = allow or tuple(range(3, 400))
            gen = [pool[int(k)] for k in torch.randint(0, len(pool), (3,), generator=g)]
            turns.append(
                Turn(
                    context_ids=ctx,
                    output_ids=gen,
                    output_logprobs=[0.0] * len(gen),
                    output_versions=[0] * len(gen),
                    allowed_token_ids=allow,
                    temperature=temp,
                )
            )
        t = Trajectory(
            f"t{i}", "t", "e", f"g{i % 2}", seed=i, start_version=0, turns=turns, reward=float(i % 3)
        )
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([t.token_ids()])).logits[0].double()
        pos = 0
        for turn in t.turns:
            pos += len(turn.context_ids)
            for j, tok in enumerate(turn.output_ids):
                row = logits[pos + j - 1] / turn.temperature
                if turn.allowed_token_ids is not None:
                    keep = list(turn.allowed_token_ids)
                    row = torch.full_like(row, float("-inf")).index_copy(0, torch.tensor(keep), row[keep])
                turn.output_logprobs[j] = float(torch.log_softmax(row, -1)[tok])
            pos += len(turn.output_ids)
        out.append(t)
    return out


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.skipif(not HAS_MCORE, reason="megatron-core is not installed (extra [megatron])")
def test_match_sampling_trains_on_the_distribution_tokens_were_sampled_from(
    ray_session: None, tmp_path: Path
) -> None:
    model = create_tiny_model(tmp_path / "tiny")
    batch = _sampled_batch(model)
    metrics: dict[str, dict[str, float]] = {}
    for name, extra in (("matched", {"match_sampling": True, "entropy_coef": 0.01}), ("plain", {})):
        group = RayTrainerGroup(_config(1, 1, options_extra=extra), model_path=model)
        try:
            metrics[name] = group.train_step(batch)
        finally:
            group.close()
    m, plain = metrics["matched"], metrics["plain"]
    # the trainer's distribution is the sampler's: ratio 1 on every token (temperatures 0.7 and 1.3,
    # a four-token restriction), where full-vocabulary temperature-1 logprobs are far off
    assert abs(m["approx_kl"]) < 1e-5 and m["clip_frac"] == 0.0
    assert abs(plain["approx_kl"]) > 0.1 and plain["clip_frac"] > 0.3
    # the entropy bonus over the restricted logits (-inf outside the set) leaves the gradient finite
    assert math.isfinite(m["grad_norm"]) and m["grad_norm"] > 0 and m["update_successful"] == 1.0
