"""The ``rollart bench`` workload: sizes, the faults of its environments and reward, the modes.

Two tasks on the embedded CPU default, every part built by registry name (core imports no member):

- ``calc`` — decode-heavy, short turns: the calculator tool-use env, short prompts, ``calc_tokens``
  generated tokens per turn;
- ``lake`` — prefill-heavy, long context, many turns: FrozenLake on a big map, one action token per
  turn, the whole history re-sent every turn.

Every environment call pays a log-normal latency and an episode may crash (rollart-env's
``straggler``, ``rollart_env.faults.StragglerEnv``, which numbers its instances so that the members of
one group straggle and fail independently); every reward call pays a log-normal cost (rollart-reward's
``bursty``, ``rollart_reward.faults.BurstyReward``).

Reward executors (:attr:`ModeSpec.reward`): ``elastic`` is rollart-reward's ``serverless`` executor,
which starts a function runtime (``rollart-reward serve``, a Ray actor's child on this machine) that
scales its workers with the load, from zero, up to ``elastic_max_workers``; ``inline_standin`` scores
in-process (every call at once, the stand-in the bench used before it had the runtime);
``colocated`` is a fixed pool of ``colocated_workers`` slots.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from rollart_core.config import ComponentConfig, RunConfig
from rollart_core.errors import ConfigError

__all__ = [
    "MODES",
    "SIZES",
    "BenchSize",
    "ModeSpec",
    "mode_config",
    "segment_config",
    "train_threads",
    "workload_config",
]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class BenchSize(_Model):
    rounds: int = Field(2, ge=1)
    """Rounds of A B C … (every mode once per round, same order)."""
    steps: int = Field(4, ge=1)
    """Measured training steps per mode per round. With ``warmup``, each segment first runs the
    mode's warm-up steps (:meth:`ModeSpec.warmup_steps`), which the throughput leaves out. Four: the
    simulator (``rollart_core.plan.simulate``, the loop's own admission) keeps async α=2's window
    80% full over the 2 steps after its warm-up, 90% over 4 and 97% over 17: the first waves of
    groups take several steps to spread out."""
    warmup: bool = True
    """Run each mode's warm-up steps before the measured ones. Without them throughput is taken over
    whole segments (fill-up included)."""
    groups_per_step: int = Field(2, ge=1)
    """Groups per task per step (the batch is 2 tasks x this x group_size trajectories)."""
    group_size: int = Field(4, ge=1)
    redundancy: int = Field(2, ge=0)
    """Extra trajectories per group in the modes that use redundancy."""
    calc_tokens: int = Field(24, ge=1)
    calc_turns: int = Field(3, ge=1)
    lake_size: int = Field(6, ge=2, le=12)
    lake_turns: int = Field(6, ge=1)
    env_latency_s: float = Field(0.3, ge=0)
    """Median latency of every env call (reset or step)."""
    env_sigma: float = Field(1.5, ge=0)
    """Log-normal spread of the env latency (1.5: p99 ≈ 33x the median)."""
    env_timeout_s: float | None = Field(10.0, gt=0)
    """Longest env call before its trajectory ends ``timed_out`` (``TaskConfig.env_timeout_s``), as a
    production run would set: ~1% of calls at σ 1.5; without it one 30-60 s call stalls a Sync+ step."""
    crash_prob: float = Field(0.05, ge=0, le=1)
    """Per episode: probability that the environment crashes at one of its calls."""
    reward_s: float = Field(0.2, ge=0)
    """Median cost of a reward call."""
    reward_sigma: float = Field(1.0, ge=0)
    colocated_workers: int = Field(3, ge=1)
    """Slots of the colocated (dedicated, fixed) reward worker."""
    elastic_max_workers: int = Field(16, ge=1)
    """Most workers (one call at a time each) the elastic reward's function runtime scales out to."""
    capacity_s: float = Field(1.5, gt=0)
    """Duration of each standalone env / reward capacity probe (one where nothing finished runs
    again four times as long)."""
    idle_groups: int = Field(3, ge=1)
    """Times one group of every task is launched alone on the idle pipeline, per async mode's
    setting (redundancy, envs, reward): the natural group lifetimes of the window bound."""
    lr: float = 1e-4
    seed: int = 7
    """The run's seed: round r launches episode seeds from ``seed + 1000 r`` in every mode (and every
    run), so the env latencies and crashes are the same in each run of one seed; another seed
    (``--set seed=8``) draws other tails."""


SIZES: dict[str, BenchSize] = {
    "micro": BenchSize(
        rounds=1,
        steps=1,
        warmup=False,
        groups_per_step=1,
        group_size=2,
        redundancy=1,
        calc_tokens=8,
        calc_turns=2,
        lake_size=4,
        lake_turns=3,
        env_latency_s=0.01,
        reward_s=0.01,
        capacity_s=0.5,
        elastic_max_workers=4,
        idle_groups=1,
    ),
    "quick": BenchSize(),
    "full": BenchSize(rounds=3, steps=5, groups_per_step=4),
}


class ModeSpec(_Model):
    mode: Literal["sync", "one_off", "async"]
    alpha: int = 0
    redundancy: int | None = Field(None, ge=0)
    """Extra trajectories launched per group (cancelled once the group's first ``group_size``
    finish); None: the size's ``redundancy``; 0: none."""
    reward: Literal["elastic", "inline_standin", "colocated"] = "elastic"
    """``elastic``: through a serverless function runtime the executor starts (rollart-reward's
    ``serverless``), scaled out on demand; ``inline_standin``: every call at once in-process (the
    ablation: what ``elastic`` stood in for before); ``colocated``: a fixed pool of
    ``colocated_workers`` slots (the ``pool`` executor)."""
    abort_stale: bool = True
    async_weight_sync: bool = True
    update_on_arrival: bool = True
    max_pending_steps: int | None = None
    env_replicas: int = Field(1, ge=1)
    """Copies of every environment, each call hedged across them (rollart-env's ``replicated``
    entry point): masks one copy's slow step or crash at the price of r times the env work."""
    train_cores: Literal["all", "half"] = "all"
    """Threads of the trainer (its own process in every mode: the torch trainer's ``spawn``):
    ``all`` cores time-share the machine with generation, the best for a mode that never runs them
    at once (Sync+); ``half`` partitions the cores so that training overlaps generation instead of
    starving it, the CPU counterpart of giving training and rollout their own GPUs (modes that
    overlap them)."""
    label: str = ""

    def warmup_steps(self) -> int:
        """Steps before a segment's throughput is measured: the mode's pipeline depth. A segment
        starts with an empty pipeline and async launches ``max_pending_steps`` steps of groups at
        once, so its first steps consume that burst and run faster than the steady state (measured:
        async α=2 with env replicas, steps 2-3 at 1.1 s, steps 4-8 at 1.7 s); only after the burst
        is consumed does the window start with the pipeline as full as at its end. One-off's first
        step has no rollout to overlap yet (1). Sync+ has no pipeline, every step is alike, but it
        leaves out its first step too: then it measures the very groups One-off measures, which draw
        the same env latencies (:func:`segment_config`), so that the two compare like for like."""
        if self.mode == "async":
            return self.max_pending_steps or self.alpha + 1
        return 1


MODES: dict[str, ModeSpec] = {
    "sync": ModeSpec(mode="sync", alpha=0, label="Sync+"),
    "one_off": ModeSpec(mode="one_off", alpha=1, train_cores="half", label="One-off"),
    "async_a1": ModeSpec(mode="async", alpha=1, max_pending_steps=2, train_cores="half", label="async α=1"),
    "async_a2": ModeSpec(mode="async", alpha=2, max_pending_steps=3, train_cores="half", label="async α=2"),
    # AReaL's staleness range (its paper trains well with a maximum staleness of 4-8 under decoupled PPO)
    "async_a4": ModeSpec(mode="async", alpha=4, max_pending_steps=5, train_cores="half", label="async α=4"),
    "admission": ModeSpec(
        mode="async",
        alpha=1,
        max_pending_steps=2,
        redundancy=0,
        reward="colocated",
        abort_stale=False,
        train_cores="half",
        label="admission-only α=1",
    ),
    # the env tail hedged with 3 replicas per environment, in Sync+ and async alike (like for like)
    "sync_r3": ModeSpec(mode="sync", alpha=0, env_replicas=3, label="Sync+, env replicas 3"),
    "async_a1_r3": ModeSpec(
        mode="async",
        alpha=1,
        max_pending_steps=2,
        env_replicas=3,
        train_cores="half",
        label="async α=1, env replicas 3",
    ),
    "async_a2_r3": ModeSpec(
        mode="async",
        alpha=2,
        max_pending_steps=3,
        env_replicas=3,
        train_cores="half",
        label="async α=2, env replicas 3",
    ),
    "async_a4_r3": ModeSpec(
        mode="async",
        alpha=4,
        max_pending_steps=5,
        env_replicas=3,
        train_cores="half",
        label="async α=4, env replicas 3",
    ),
    # ablations of async α=1 (full size)
    "abl_no_redundancy": ModeSpec(
        mode="async",
        alpha=1,
        max_pending_steps=2,
        redundancy=0,
        train_cores="half",
        label="async α=1, no redundancy",
    ),
    "abl_colocated_reward": ModeSpec(
        mode="async",
        alpha=1,
        max_pending_steps=2,
        reward="colocated",
        train_cores="half",
        label="async α=1, colocated reward",
    ),
    "abl_sync_weights": ModeSpec(
        mode="async",
        alpha=1,
        max_pending_steps=2,
        async_weight_sync=False,
        train_cores="half",
        label="async α=1, synchronous weight sync",
    ),
    "abl_update_at_batch": ModeSpec(
        mode="async",
        alpha=1,
        max_pending_steps=2,
        update_on_arrival=False,
        train_cores="half",
        label="async α=1, weights swapped after Get Batch",
    ),
    "abl_inline_standin": ModeSpec(
        mode="async",
        alpha=1,
        max_pending_steps=2,
        reward="inline_standin",
        train_cores="half",
        label="async α=1, in-process reward stand-in",
    ),
    "abl_trainer_all_cores": ModeSpec(
        mode="async", alpha=1, max_pending_steps=2, label="async α=1, trainer on all cores"
    ),
}
# quick stays under 5 minutes on 2 cores: async α=4 (AReaL's staleness range) is in full, or --modes
DEFAULT_MODES = {
    "micro": ["sync", "async_a1"],
    "quick": ["sync", "one_off", "async_a1", "async_a2", "admission"],
    "full": list(MODES),
}


def workload_config(size: BenchSize, out_dir: Path, model_path: Path, *, faults: bool = True) -> RunConfig:
    """The base run config (Sync+ settings); ``faults=False`` gives free envs and rewards (capacity probes)."""
    lat = size.env_latency_s if faults else 0.0
    fault_spec = {
        "step_latency_s": lat,
        "step_latency_sigma": size.env_sigma,
        "crash_prob": size.crash_prob if faults else 0.0,
        "fault_within_calls": 2,
    }
    reward = {
        "impl": "bursty",
        "options": {
            "inner": {"impl": "env_return"},
            "work_s": size.reward_s if faults else 0.0,
            "sigma": size.reward_sigma,
        },
    }
    task = {
        "reward": reward,
        "group_size": size.group_size,
        "groups_per_step": size.groups_per_step,
        "redundancy": size.redundancy,
        "env_timeout_s": size.env_timeout_s,
    }
    calc = {"impl": "calculator", "options": {"num_operands": 3, "max_turns": size.calc_turns}}
    lake = {
        "impl": "frozenlake",
        "options": {"size": size.lake_size, "hole_prob": 0.0, "max_steps": size.lake_turns},
    }
    return RunConfig.model_validate(
        {
            "name": "bench",
            "output_dir": str(out_dir / "run"),
            "seed": size.seed,
            "model": {"path": str(model_path), "create_tiny": True, "dtype": "float32"},
            "engines": [
                {
                    "name": "gen",
                    "impl": "vllm",
                    "count": 1,
                    "num_cpus": 0.25,
                    "options": {"max_model_len": 2048, "dtype": "float32", "max_num_seqs": 128},
                }
            ],
            "tasks": [
                {
                    "name": "calc",
                    **task,
                    "max_turns": size.calc_turns,
                    "env": {
                        "impl": "straggler",
                        "options": {"env": calc, "faults": fault_spec},
                    },
                    "sampling": {"max_tokens": size.calc_tokens, "temperature": 1.0},
                },
                {
                    "name": "lake",
                    **task,
                    "max_turns": size.lake_turns,
                    "env": {
                        "impl": "straggler",
                        "options": {"env": lake, "faults": fault_spec},
                    },
                    "sampling": {"max_tokens": 1, "temperature": 1.0},
                },
            ],
            "trainer": {"impl": "torch", "options": {"lr": size.lr, "spawn": True}},
            "weight_store": {"impl": "filesystem", "options": {"root": str(out_dir / "weights")}},
            "loop": {"mode": "sync", "alpha": 0, "steps": size.steps},
            "ray": {"num_cpus": 2},
        }
    )


def mode_config(base: RunConfig, spec: ModeSpec, size: BenchSize) -> RunConfig:
    cfg = base.model_copy(deep=True)
    cfg.loop.mode, cfg.loop.alpha = spec.mode, spec.alpha
    cfg.loop.abort_stale, cfg.loop.async_weight_sync = spec.abort_stale, spec.async_weight_sync
    cfg.loop.update_on_arrival = spec.update_on_arrival
    cfg.loop.max_pending_steps = spec.max_pending_steps
    cfg.loop.steps = size.steps + (spec.warmup_steps() if size.warmup else 0)
    for t in cfg.tasks:
        t.redundancy = size.redundancy if spec.redundancy is None else spec.redundancy
        t.reward_executor = reward_executor(spec.reward, size)
        if spec.env_replicas > 1:
            t.env = ComponentConfig(
                impl="replicated", options={"env": t.env.model_dump(), "replicas": spec.env_replicas}
            )
    return RunConfig.model_validate(cfg.model_dump())


def segment_config(cfg: RunConfig, round_index: int, mode: str) -> RunConfig:
    """One mode's config for round ``round_index``: every mode of a round launches the same episode
    seeds (the run's seed plus 1000 x the round) and its environments draw paired latencies and crashes
    (``straggler``'s ``paired_scope``, one scope per segment: common random numbers). The modes of a
    round then wait on the same tails and their ratio is the modes' difference, not the draws'; the
    next round draws afresh. Without it, which trajectory met a 10 s env call was chance, and one
    run's One-off over Sync+ moved by ±20%."""
    seg = cfg.model_copy(deep=True)
    seg.seed = cfg.seed + 1000 * round_index
    for t in seg.tasks:
        env = t.env.options.get("env") if t.env.impl == "replicated" else None
        straggler = env if isinstance(env, dict) and env.get("impl") == "straggler" else None
        if t.env.impl == "straggler":
            t.env.options["paired_scope"] = f"round{round_index}/{mode}"
        elif straggler is not None:  # each copy of a hedged env is its own reset: it still draws apart
            straggler.setdefault("options", {})["paired_scope"] = f"round{round_index}/{mode}"
    return RunConfig.model_validate(seg.model_dump())


def train_threads(train_cores: Literal["all", "half"]) -> int:
    """The trainer's threads for a :attr:`ModeSpec.train_cores` share of this machine's cores."""
    cores = os.cpu_count() or 1
    return cores if train_cores == "all" else max(1, cores // 2)


def reward_executor(kind: str, size: BenchSize) -> ComponentConfig:
    """The executor config of a :attr:`ModeSpec.reward` kind."""
    if kind == "colocated":
        return ComponentConfig(impl="pool", options={"workers": size.colocated_workers, "retries": 0})
    if kind == "inline_standin":
        return ComponentConfig(impl="inline")
    if kind == "elastic":
        return ComponentConfig(
            impl="serverless",
            options={
                # a Ray actor on the machine's CPU share: a quarter of a logical CPU, like the engine
                "num_cpus": 0.25,
                "runtime": {"max_workers": size.elastic_max_workers},
                # the real path or an error: no quiet fallback to in-process scoring
                "http": {"fallback": "none", "max_concurrency": 256},
            },
        )
    raise ConfigError(f"unknown bench reward kind {kind!r} (elastic, inline_standin, colocated)")
