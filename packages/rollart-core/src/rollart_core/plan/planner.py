"""The planner: which hardware class serves each task, how big each pool is, what limits throughput.

Roofline model per hardware class ``h`` (peak FLOP/s ``F``, bandwidth ``BW``, memory ``M``), model of
``P`` parameters (weights ``W = P·bytes``) and KV cache ``kv`` bytes per token:

- prefill: ``t = 2·P·tokens / (F·mfu)`` (compute-bound);
- decode, one step of a batch of ``B`` sequences of mean context ``c``:
  ``t_step = max((W + B·c·kv) / (BW·bw_util), 2·P·B / (F·mfu))``, i.e. ``B / t_step`` tokens/s;
  ``B`` is the largest batch that fits the memory (``M - W``) up to ``max_batch``;
- GPU-seconds per trajectory = prefill + decode time; cost = GPU-seconds × price. Each task goes to
  the class (or, PD-disaggregated, the prefill class + decode class) with the lowest cost per
  trajectory, i.e. the highest throughput per dollar.

The GPU budget is split between the trainer pool and the rollout pools (:mod:`.trainer`: the
trainer's step from 6·N·tokens FLOPs, each mode's step from its stages, Sync+ serial, One-off and
async overlapped); a rollout share is spread over the tasks' pools in proportion to their
GPU-seconds (so every pool keeps pace). A step's rollout is never shorter than its slowest group
(:func:`rollout_latency` draws it from the profile's distributions; async: plus the update a group
starts after, over the steps in flight): a batch too small for its pools is ``trajectory
latency``-bound, not generation-bound. The closed form is exact for constant latencies; with heavy
tails it is optimistic for async (queues and staleness it leaves out): ``--simulate`` replays the
split. Environments get CPU nodes for their measured
latency, rewards go serverless, and the bottleneck is the longest term of the mode's step (or an
env/reward stage slower than it).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

from rollart_core.errors import ConfigError
from rollart_core.plan.catalogue import HardwareClass
from rollart_core.plan.simulate import MODES, GenTime, SimResult, simulate
from rollart_core.plan.trainer import (
    TRAIN_BYTES_PER_PARAM,
    TRAIN_MEM_FRACTION,
    Split,
    TrainerSizing,
    best_split,
    choose_train_class,
    size_trainer,
)
from rollart_core.plan.workload import ModelProfile, TaskProfile, WorkloadProfile

__all__ = [
    "ClassEstimate",
    "Plan",
    "TaskPlan",
    "estimate",
    "make_plan",
    "plan_pools",
    "render_plan",
    "roofline_gen_time",
]

PD_MARGIN = 0.10
"""PD disaggregation must save at least this fraction of cost to be proposed (KV transfer, two pools)."""


@dataclass
class ClassEstimate:
    hw: str
    prefill_s: float
    """GPU-seconds of prefill per trajectory."""
    decode_s: float
    """GPU-seconds of decode per trajectory (at the batch below)."""
    batch: int
    decode_bound: str
    """``bandwidth`` or ``compute``: what limits a decode step."""
    price_per_hour: float

    @property
    def gpu_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def cost(self) -> float:
        return self.gpu_s * self.price_per_hour / 3600


def prefill_seconds(tokens: float, model: ModelProfile, hw: HardwareClass) -> float:
    return 2 * model.params * tokens / (hw.flops * hw.mfu)


def decode_step(batch: int, context: float, model: ModelProfile, hw: HardwareClass) -> tuple[float, str]:
    mem = (model.weight_bytes + batch * context * model.kv_bytes_per_token) / (hw.mem_bw * hw.bw_util)
    comp = 2 * model.params * batch / (hw.flops * hw.mfu)
    return (mem, "bandwidth") if mem >= comp else (comp, "compute")


def max_batch(context: float, model: ModelProfile, hw: HardwareClass, cap: int) -> int:
    free = hw.mem_bytes * 0.9 - model.weight_bytes
    if free <= 0:
        return 0
    return max(0, min(cap, int(free / max(context * model.kv_bytes_per_token, 1.0))))


def estimate(
    task: TaskProfile, model: ModelProfile, name: str, hw: HardwareClass, *, max_batch_cap: int = 256
) -> ClassEstimate | None:
    """Per-trajectory GPU time of ``task`` on one device of class ``hw`` (None: the model does not fit)."""
    if hw.kind != "gpu":
        return None
    ctx = task.mean_context()
    b = max_batch(ctx, model, hw, max_batch_cap)
    if b < 1:
        return None
    step, bound = decode_step(b, ctx, model, hw)
    return ClassEstimate(
        name,
        prefill_seconds(task.prefill_tokens(), model, hw),
        task.decode_tokens() * step / b,
        b,
        bound,
        hw.price_per_hour,
    )


def roofline_gen_time(
    model: ModelProfile,
    hw: HardwareClass,
    decode_hw: HardwareClass | None = None,
    *,
    max_batch_cap: int = 256,
) -> GenTime:
    """Per-turn latency of one request for the simulator: its prefill on ``hw``, then its decode
    steps on ``decode_hw`` (default ``hw``; PD disaggregation) in a full batch. The simulator's slots
    (devices × batch) bound decode throughput; prefill capacity is checked by the planner's stages."""
    dhw = decode_hw or hw
    known: dict[tuple[str, bool], float] = {}  # the simulator asks once per turn: millions of times

    def gen_time(task: TaskProfile, turn: int, rng: random.Random) -> float:
        key = (task.name, turn == 0)
        if key not in known:
            ctx = task.mean_context()
            b = max(1, max_batch(ctx, model, dhw, max_batch_cap))
            tokens = task.prompt_tokens if turn == 0 else task.context_tokens_per_turn
            step, _ = decode_step(b, ctx, model, dhw)
            known[key] = prefill_seconds(tokens, model, hw) + task.output_tokens_per_turn * step
        return known[key]

    return gen_time


@dataclass
class TaskPlan:
    task: str
    prefill: ClassEstimate
    decode: ClassEstimate
    gpus_prefill: int = 0
    gpus_decode: int = 0
    options: list[ClassEstimate] = field(default_factory=list)

    @property
    def disaggregated(self) -> bool:
        return self.prefill.hw != self.decode.hw

    @property
    def cost(self) -> float:
        return (
            self.prefill.prefill_s * self.prefill.price_per_hour
            + self.decode.decode_s * self.decode.price_per_hour
        ) / 3600


@dataclass
class Plan:
    tasks: list[TaskPlan]
    pools: dict[str, int]
    """Rollout pools: hardware class → devices (GPU) or nodes (CPU); the trainer's are apart."""
    stage_traj_per_s: dict[str, float]
    bottleneck: str
    traj_per_s: float
    cost_per_hour: float
    """All pools, the trainer's included."""
    trainer: TrainerSizing
    trainer_gpus: int
    mode: str
    """The mode whose split the pools follow (the run config's)."""
    alpha: int = 1
    """The staleness bound the async split and simulation assume (the run config's)."""
    splits: dict[str, Split] = field(default_factory=dict)
    """Each mode's own split of the budget and its predicted step."""
    enough_gpus: int | None = None
    """The smallest budget whose plan reaches 98% of this one's throughput (None: all of it helps)."""
    basis: str = ""
    """What the plan was made from (a measured profile, a written one, or defaults): its first line."""
    simulated: dict[str, SimResult] = field(default_factory=dict)

    @property
    def split(self) -> Split:
        return self.splits[self.mode]


def _choose(
    task: TaskProfile, model: ModelProfile, catalogue: dict[str, HardwareClass], allowed: list[str] | None
) -> TaskPlan:
    ests = [
        e
        for n, hw in catalogue.items()
        if (allowed is None or n in allowed)
        if (e := estimate(task, model, n, hw)) is not None
    ]
    if not ests:
        raise ConfigError(
            f"task {task.name!r}: the model fits no GPU class of the catalogue"
            f"{'' if allowed is None else f' among {allowed}'}: an engine holds its weights "
            f"({model.dtype_bytes} bytes/param × {model.params:.3g} = {model.weight_bytes / 1e9:.3g} GB) and "
            f"one sequence's KV cache ({task.mean_context():.0f} tokens × {model.kv_bytes_per_token:.0f} B) "
            "in 0.9 of one device's memory (no tensor parallelism in the plan)"
        )
    best = min(ests, key=lambda e: e.cost)
    pf = min(ests, key=lambda e: e.prefill_s * e.price_per_hour)
    dc = min(ests, key=lambda e: e.decode_s * e.price_per_hour)
    split = TaskPlan(task.name, pf, dc, options=ests)
    if pf.hw != dc.hw and split.cost < best.cost * (1 - PD_MARGIN):
        return split
    return TaskPlan(task.name, best, best, options=ests)


def allocate(demand: list[float], gpus: int) -> list[int]:
    """``gpus`` devices over pools of the given GPU-seconds per step: one each, the rest in
    proportion, what rounding leaves where a device buys the most."""
    n = len(demand)
    total = sum(demand) or 1.0
    shares = [1 + math.floor((gpus - n) * d / total) for d in demand]
    while sum(shares) < gpus:
        i = max(range(n), key=lambda k: demand[k] / shares[k])
        shares[i] += 1
    return shares


LATENCY_SAMPLES = 200_000
"""Env/reward draws the latency estimate may take (over all its repetitions)."""


def rollout_latency(
    profile: WorkloadProfile,
    tplans: list[TaskPlan] | None = None,
    catalogue: dict[str, HardwareClass] | None = None,
    *,
    seed: int = 0,
) -> tuple[float, float]:
    """(group, step): expected seconds until a group has ``group_size`` finished members, and until
    every group of a step has, on idle pools — no step's rollout is shorter, whatever its devices.
    Drawn from the profile: each trajectory's turns (measured, or the roofline's at full batch), its
    env calls (the reset and one per turn, capped at ``env_timeout_s``) and its reward; a group of
    ``group_size + redundancy`` is done at its ``group_size``-th finisher. Heavy tails make the
    step's figure (the slowest group, what a batch barrier waits for) far above the mean.
    ``tplans`` and ``catalogue`` give the roofline's turns of a task without measured ones."""
    rng = random.Random(seed)
    turn_s: dict[str, tuple[float, float]] = {}
    for i, t in enumerate(profile.tasks):
        if t.generate_s is None:
            if tplans is None or catalogue is None:
                raise ValueError(
                    f"task {t.name!r} has no generate_s: its turns need a TaskPlan and the catalogue"
                )
            tp = tplans[i]
            gen = roofline_gen_time(profile.model, catalogue[tp.prefill.hw], catalogue[tp.decode.hw])
            turn_s[t.name] = (gen(t, 0, rng), gen(t, 1, rng))  # (the roofline draws nothing)
    calls = sum(t.trajectories_per_step * (t.turns + 2) for t in profile.tasks)
    draws = max(1, min(8, int(LATENCY_SAMPLES // max(calls, 1))))
    group_total = step_total = 0.0
    for _ in range(draws):
        step_end = group_sum = 0.0
        groups = 0
        for t in profile.tasks:
            size = t.group_size + t.redundancy
            for _ in range(max(1, t.trajectories_per_step // t.group_size)):
                ends = sorted(_one_trajectory(t, turn_s.get(t.name), rng) for _ in range(size))
                done = ends[t.group_size - 1]
                step_end, group_sum, groups = max(step_end, done), group_sum + done, groups + 1
        group_total += group_sum / groups
        step_total += step_end
    return group_total / draws, step_total / draws


def _one_trajectory(task: TaskProfile, roofline: tuple[float, float] | None, rng: random.Random) -> float:
    total = 0.0
    turns = task.sample_turns(rng)
    for call in range(turns + 1):
        env = task.env_latency_s.sample(rng)
        if task.env_timeout_s is not None and env >= task.env_timeout_s:
            return total + task.env_timeout_s  # the trajectory ends at the timeout
        total += env
        if call < turns:
            if roofline is not None:
                total += roofline[0] if call == 0 else roofline[1]
            elif task.generate_s is not None:
                total += task.generate_s.sample(rng)
    return total + task.reward_s.sample(rng)


def _demand(profile: WorkloadProfile, tplans: list[TaskPlan]) -> list[tuple[TaskPlan, str, float]]:
    """GPU-seconds per training step of each rollout pool: (task, phase, seconds), phase ``prefill``
    / ``decode`` for a disaggregated task, ``both`` otherwise."""
    demand: list[tuple[TaskPlan, str, float]] = []
    for tp in tplans:
        n = profile.task(tp.task).trajectories_per_step
        if tp.disaggregated:
            demand += [(tp, "prefill", tp.prefill.prefill_s * n), (tp, "decode", tp.decode.decode_s * n)]
        else:
            demand.append((tp, "both", tp.prefill.gpu_s * n))
    return demand


def steps_in_flight(mode: str, alpha: int) -> int:
    """Steps of groups a mode keeps in flight (the loop's default depth)."""
    return alpha + 1 if mode == "async" else 1


def make_plan(
    profile: WorkloadProfile,
    catalogue: dict[str, HardwareClass],
    *,
    gpus: int = 64,
    classes: list[str] | None = None,
    env_class: str = "CPU",
    simulate_steps: int = 0,
    mode: str = "async",
    alpha: int = 1,
    train_class: str | None = None,
) -> Plan:
    """Choose classes per task, size the trainer, split ``gpus`` devices between the trainer and the
    rollout pools for each mode, size the pools by ``mode``'s split, find the bottleneck."""
    if mode not in MODES:
        raise ConfigError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    for n in classes or []:
        if n not in catalogue:
            raise ConfigError(f"unknown hardware class {n!r} (catalogue: {', '.join(sorted(catalogue))})")
    model = profile.model
    tplans = [_choose(t, model, catalogue, classes) for t in profile.tasks]
    demand = _demand(profile, tplans)
    need = [d for _, _, d in demand]
    hw_name = choose_train_class(model.params, catalogue, classes, train_class)
    trainer = size_trainer(profile, hw_name, catalogue[hw_name])
    smallest = trainer.min_gpus + len(demand)
    if gpus < smallest:
        raise ConfigError(
            f"--gpus {gpus} is too small: training a {model.params:.3g}-parameter model needs at least "
            f"{trainer.min_gpus} {hw_name} ({TRAIN_BYTES_PER_PARAM} bytes/param of weights, gradients and "
            f"Adam state = {TRAIN_BYTES_PER_PARAM * model.params / 1e9:.3g} GB over "
            f"{TRAIN_MEM_FRACTION:g} × {catalogue[hw_name].mem_bytes / 2**30:g} GiB per device) and rollout "
            f"{len(demand)} (one engine per pool: {', '.join(f'{tp.task}/{ph}' for tp, ph, _ in demand)}): "
            f"give --gpus {smallest} or more"
        )
    n_total = sum(t.trajectories_per_step for t in profile.tasks)
    _, step_s = rollout_latency(profile, tplans, catalogue)

    def gen_compute(r: int) -> float:
        return max(d / s for d, s in zip(need, allocate(need, r), strict=True))

    def splits_for(budget: int) -> dict[str, Split]:
        return {
            m: best_split(
                m,
                budget,
                min_trainer=trainer.min_gpus,
                min_rollout=len(demand),
                gen_compute=gen_compute,
                latency_s=step_s,
                depth=steps_in_flight(m, alpha),
                trainer=trainer,
                push_s=profile.train.push_s,
                sync_s=profile.train.sync_s,
                trajectories_per_step=n_total,
            )
            for m in MODES
        }

    splits = splits_for(gpus)
    split = splits[mode]
    pools: dict[str, int] = {}
    for (tp, phase, _), g in zip(demand, allocate(need, split.rollout_gpus), strict=True):
        if phase in ("prefill", "both"):
            tp.gpus_prefill += g
        if phase in ("decode", "both"):
            tp.gpus_decode += g
        hw = tp.prefill.hw if phase == "prefill" else tp.decode.hw
        pools[hw] = pools.get(hw, 0) + g
    stage = {
        "generation": n_total / split.gen_compute_s if split.gen_compute_s > 0 else math.inf,
        "trajectory latency": n_total / split.latency_s if split.latency_s > 0 else math.inf,
        "training": n_total / split.train_s if split.train_s > 0 else math.inf,
    }
    env_s = (
        sum(t.trajectories_per_step * (t.turns + 1) * t.env_latency_s.mean for t in profile.tasks) / n_total
    )
    env_node = catalogue.get(env_class)
    if env_s > 0 and (env_node is None or env_node.kind != "cpu"):
        raise ConfigError(f"env_class {env_class!r} is not a CPU class of the catalogue")
    # one environment per core; enough cores that env calls never limit the fastest mode
    env_cpus = max(env_node.cpus, 1) if env_node is not None else 1
    fastest = max(s.traj_per_s for s in splits.values())
    env_nodes = max(1, math.ceil(fastest * env_s / env_cpus)) if env_s > 0 else 0
    if env_nodes:
        pools[env_class] = env_nodes
        stage["environment"] = env_nodes * env_cpus / env_s
    rw_s = sum(t.trajectories_per_step * t.reward_s.mean for t in profile.tasks) / n_total
    serverless = next((n for n, h in catalogue.items() if h.kind == "serverless"), None)
    if rw_s > 0 and serverless is not None:
        stage["reward (serverless)"] = catalogue[serverless].max_concurrency / rw_s
    bottleneck, rate = split.bottleneck, split.traj_per_s
    for name in ("environment", "reward (serverless)"):
        if name in stage and stage[name] < rate:
            bottleneck, rate = name, stage[name]
    cost = sum(catalogue[h].price_per_hour * n for h, n in pools.items())
    cost += catalogue[hw_name].price_per_hour * split.trainer_gpus
    if rw_s > 0 and serverless is not None:
        cost += catalogue[serverless].price_per_hour * rw_s * rate
    plan = Plan(
        tplans,
        pools,
        stage,
        bottleneck,
        rate,
        cost,
        trainer=trainer,
        trainer_gpus=split.trainer_gpus,
        mode=mode,
        alpha=alpha,
        splits=splits,
    )
    # the best split's throughput only grows with the budget: the smallest one within 2% of it
    lo, hi = smallest, gpus
    while lo < hi:
        mid = (lo + hi) // 2
        if splits_for(mid)[mode].traj_per_s >= 0.98 * split.traj_per_s:
            hi = mid
        else:
            lo = mid + 1
    plan.enough_gpus = lo if lo < gpus else None
    if simulate_steps:
        plan.simulated = simulate_plan(profile, plan, catalogue, steps=simulate_steps, alpha=alpha)
    return plan


def plan_pools(
    profile: WorkloadProfile, plan: Plan, catalogue: dict[str, HardwareClass], mode: str | None = None
) -> dict[str, Any]:
    """The simulator's view of ``mode``'s split (default: the plan's): generation slots (decode
    devices × batch), env slots (CPU nodes × cores) and per-turn generation times from the roofline
    (keyword arguments of :func:`~rollart_core.plan.simulate.simulate`)."""
    split = plan.splits[mode or plan.mode]
    demand = _demand(profile, plan.tasks)
    shares = allocate([d for _, _, d in demand], split.rollout_gpus)
    decode = {tp.task: g for (tp, phase, _), g in zip(demand, shares, strict=True) if phase != "prefill"}
    gens = {
        tp.task: roofline_gen_time(profile.model, catalogue[tp.prefill.hw], catalogue[tp.decode.hw])
        for tp in plan.tasks
    }
    slots = sum(decode[tp.task] * tp.decode.batch for tp in plan.tasks)
    env_slots = plan.pools.get("CPU", 0) * max(catalogue["CPU"].cpus if "CPU" in catalogue else 1, 1) or None

    def gen_time(task: TaskProfile, turn: int, rng: random.Random) -> float:
        return gens[task.name](task, turn, rng)

    return {"gen_slots": max(slots, 1), "env_slots": env_slots, "gen_time": gen_time}


def simulate_plan(
    profile: WorkloadProfile,
    plan: Plan,
    catalogue: dict[str, HardwareClass],
    *,
    steps: int = 6,
    alpha: int = 1,
) -> dict[str, SimResult]:
    """Replay the profile for each mode on that mode's split: its rollout pools (roofline generation
    times) and its trainer's step time."""
    out: dict[str, SimResult] = {}
    for m in MODES:
        split = plan.splits[m]
        prof = profile.model_copy(deep=True)
        prof.train.train_s, prof.train.gpus = split.train_s, None
        a = max(alpha, 1) if m == "one_off" else alpha
        out[m] = simulate(prof, mode=m, alpha=a, steps=steps, **plan_pools(profile, plan, catalogue, m))
    return out


def _pct(x: float) -> str:
    """A share as a percentage that never reads 0% for something above zero."""
    return f"{x:.0%}" if x >= 0.01 or x == 0 else f"{x:.1%}" if x >= 0.001 else "<0.1%"


def _sci(x: float) -> str:
    return f"{x:.3g}"


def render_trainer(plan: Plan) -> list[str]:
    t = plan.trainer
    lines = [
        f"training: {t.hw} × {plan.trainer_gpus} (at least {t.min_gpus} to hold {TRAIN_BYTES_PER_PARAM} bytes/param "
        f"of weights, gradients and Adam state, sharded, in {TRAIN_MEM_FRACTION:g} of each device)"
    ]
    if t.measured_s:
        on = (
            f"measured on {t.measured_gpus}" if t.measured_gpus else "measured on an unknown pool: kept fixed"
        )
        lines.append(
            f"  step {t.measured_s:.3g} s ({on}) → {plan.split.train_s:.3g} s on {plan.trainer_gpus}"
        )
    else:
        lines.append(
            f"  6 · N · tokens = 6 × {_sci(t.flops_per_step / 6 / max(t.tokens_per_step, 1))} × "
            f"{_sci(t.tokens_per_step)} = {_sci(t.flops_per_step)} FLOP/step at MFU {t.mfu:.2f} of "
            f"{t.peak_flops / 1e12:g} TFLOP/s per device → {plan.split.train_s:.3g} s/step on {plan.trainer_gpus}"
        )
    return lines


def render_plan(plan: Plan) -> str:
    lines = [plan.basis] if plan.basis else []
    lines.append("task → pool (roofline, per trajectory)")
    lines.append(
        f"  {'task':<16}{'prefill on':<12}{'decode on':<12}{'GPUs':>6}{'GPU-s/traj':>12}{'$/1k traj':>11}"
        f"  decode bound"
    )
    for tp in plan.tasks:
        g = tp.gpus_prefill + (tp.gpus_decode if tp.disaggregated else 0)
        gpu_s = tp.prefill.prefill_s + tp.decode.decode_s
        lines.append(
            f"  {tp.task:<16}{tp.prefill.hw:<12}{tp.decode.hw:<12}{g:>6}{gpu_s:>12.2f}{tp.cost * 1000:>11.3f}"
            f"  {tp.decode.decode_bound} (batch {tp.decode.batch})"
        )
        alts = sorted(tp.options, key=lambda e: e.cost)
        lines.append(
            "      alternatives $/1k traj: " + ", ".join(f"{e.hw} {e.cost * 1000:.3f}" for e in alts)
        )
    lines += render_trainer(plan)
    total = plan.trainer_gpus + plan.split.rollout_gpus
    lines.append(
        f"split of {total} GPUs per mode (the plan follows {plan.mode}; rollout s = one step's batch, "
        "busy = share of the step a stage computes):"
    )
    lines.append(
        f"  {'mode':<11}{'trainer':>8}{'rollout':>8}{'rollout s':>10}{'train s':>9}{'step s':>9}{'traj/s':>9}"
        f"{'gen busy':>10}{'train busy':>11}  bottleneck"
    )
    for m, sp in plan.splits.items():
        label = f"async α={plan.alpha}" if m == "async" else m
        lines.append(
            f"  {label:<11}{sp.trainer_gpus:>8}{sp.rollout_gpus:>8}{sp.gen_s:>10.3g}{sp.train_s:>9.3g}{sp.step_s:>9.3g}"
            f"{sp.traj_per_s:>9.2f}{_pct(sp.gen_busy):>10}{_pct(sp.train_busy):>11}  {sp.bottleneck}"
        )
    rollout = ", ".join(f"{h} × {n}" for h, n in plan.pools.items())
    lines.append(
        f"pools ({plan.mode}): rollout {rollout}; trainer {plan.trainer.hw} × {plan.trainer_gpus}"
        f"   (${plan.cost_per_hour:.2f}/h)"
    )
    lines.append(
        "stage capacity (trajectories/s): "
        + ", ".join(f"{k} {v:.2f}" for k, v in plan.stage_traj_per_s.items())
    )
    sp = plan.split
    why = {
        "generation": f"rollout devices compute {_pct(sp.gen_busy)} of the step",
        "trajectory latency": (
            f"rollout devices compute {_pct(sp.gen_busy)} of the step: the slowest group takes longer than "
            f"the batch's compute on {sp.rollout_gpus} GPUs; more trajectories per step fill them"
        ),
        "training": f"the trainer computes {_pct(sp.train_busy)} of the step",
        "weight sync": "the weight push and the engines' pause",
    }.get(plan.bottleneck, "its capacity is below the rest's")
    lines.append(
        f"predicted bottleneck ({plan.mode}): {plan.bottleneck} ({why}) → {plan.traj_per_s:.2f} "
        f"trajectories/s, {plan.traj_per_s * 3600 / max(plan.cost_per_hour, 1e-9):.0f} trajectories per $"
    )
    if plan.enough_gpus is not None:
        lines.append(f"  {plan.enough_gpus} GPUs already reach 98% of this throughput")
    for mode, r in plan.simulated.items():
        s = plan.splits[mode]
        lines.append(
            f"simulated {mode:<7} ({s.trainer_gpus} train + {s.rollout_gpus} rollout): {r.traj_per_s:.2f} "
            f"trajectories/s, step {r.step_s:.3g} s, aborted {r.aborted}, generation slots busy "
            f"{_pct(r.gen_busy)}, trainer busy {_pct(r.train_busy)}"
        )
    return "\n".join(lines)
