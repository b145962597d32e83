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

Pools are then sized for a GPU budget in proportion to each task's GPU-seconds (so every pool
keeps pace), environments get CPU nodes for their measured latency, rewards go serverless, and the
predicted throughput is the minimum over stages: the smallest one is the bottleneck.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

from rollart_core.errors import ConfigError
from rollart_core.plan.catalogue import HardwareClass
from rollart_core.plan.simulate import MODES, GenTime, SimResult, simulate
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
    """Hardware class → devices (GPU) or nodes (CPU)."""
    stage_traj_per_s: dict[str, float]
    bottleneck: str
    traj_per_s: float
    cost_per_hour: float
    simulated: dict[str, SimResult] = field(default_factory=dict)


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
            f"task {task.name!r}: the model ({model.params / 1e9:g}B params) fits no GPU class of the "
            f"catalogue{'' if allowed is None else f' among {allowed}'}"
        )
    best = min(ests, key=lambda e: e.cost)
    pf = min(ests, key=lambda e: e.prefill_s * e.price_per_hour)
    dc = min(ests, key=lambda e: e.decode_s * e.price_per_hour)
    split = TaskPlan(task.name, pf, dc, options=ests)
    if pf.hw != dc.hw and split.cost < best.cost * (1 - PD_MARGIN):
        return split
    return TaskPlan(task.name, best, best, options=ests)


def make_plan(
    profile: WorkloadProfile,
    catalogue: dict[str, HardwareClass],
    *,
    gpus: int = 64,
    classes: list[str] | None = None,
    env_class: str = "CPU",
    simulate_steps: int = 0,
) -> Plan:
    """Choose classes per task, size pools for ``gpus`` devices, find the bottleneck."""
    for n in classes or []:
        if n not in catalogue:
            raise ConfigError(f"unknown hardware class {n!r} (catalogue: {', '.join(sorted(catalogue))})")
    model = profile.model
    tplans = [_choose(t, model, catalogue, classes) for t in profile.tasks]
    # GPU-seconds per training step, per (task, phase): split the budget in proportion
    demand: list[tuple[TaskPlan, str, float]] = []
    for tp, t in zip(tplans, profile.tasks, strict=True):
        n = t.trajectories_per_step
        if tp.disaggregated:
            demand += [(tp, "prefill", tp.prefill.prefill_s * n), (tp, "decode", tp.decode.decode_s * n)]
        else:
            demand.append((tp, "both", tp.prefill.gpu_s * n))
    total = sum(d for _, _, d in demand) or 1.0
    if gpus < len(demand):
        raise ConfigError(f"--gpus {gpus}: need at least one GPU per pool ({len(demand)} pools)")
    shares = [max(1, math.floor(gpus * d / total)) for _, _, d in demand]
    while sum(shares) < gpus:  # hand out the rest where a GPU buys the most
        i = max(range(len(demand)), key=lambda k: demand[k][2] / shares[k])
        shares[i] += 1
    pools: dict[str, int] = {}
    stage: dict[str, float] = {}
    for (tp, phase, _), g in zip(demand, shares, strict=True):
        if phase in ("prefill", "both"):
            tp.gpus_prefill += g
        if phase in ("decode", "both"):
            tp.gpus_decode += g
        hw = tp.prefill.hw if phase == "prefill" else tp.decode.hw
        pools[hw] = pools.get(hw, 0) + g
    # stage capacities in trajectories/s of the whole mix (each task at its share of a step)
    n_total = sum(t.trajectories_per_step for t in profile.tasks)
    gen_rates = []
    for (tp, _, d), g in zip(demand, shares, strict=True):
        n = profile.task(tp.task).trajectories_per_step
        gen_rates.append(g / (d / n) * n_total / n)  # trajectories/s of the mix this pool sustains
    stage["generation"] = min(gen_rates)
    env_s = (
        sum(t.trajectories_per_step * (t.turns + 1) * t.env_latency_s.mean for t in profile.tasks) / n_total
    )
    env_node = catalogue.get(env_class)
    if env_s > 0 and (env_node is None or env_node.kind != "cpu"):
        raise ConfigError(f"env_class {env_class!r} is not a CPU class of the catalogue")
    # one environment per core; size the CPU pool so that env time never limits generation
    env_cpus = max(env_node.cpus, 1) if env_node is not None else 1
    env_nodes = max(1, math.ceil(stage["generation"] * env_s / env_cpus)) if env_s > 0 else 0
    if env_nodes:
        pools[env_class] = env_nodes
        stage["environment"] = env_nodes * env_cpus / env_s
    rw_s = sum(t.trajectories_per_step * t.reward_s.mean for t in profile.tasks) / n_total
    serverless = next((n for n, h in catalogue.items() if h.kind == "serverless"), None)
    if rw_s > 0 and serverless is not None:
        stage["reward (serverless)"] = catalogue[serverless].max_concurrency / rw_s
    step_s = profile.train.train_s + profile.train.sync_s
    if step_s > 0:
        stage["training"] = n_total / step_s
    bottleneck = min(stage, key=lambda k: stage[k])
    cost = sum(catalogue[h].price_per_hour * n for h, n in pools.items())
    if rw_s > 0 and serverless is not None:
        cost += catalogue[serverless].price_per_hour * rw_s * stage[bottleneck]
    plan = Plan(tplans, pools, stage, bottleneck, stage[bottleneck], cost)
    if simulate_steps:
        plan.simulated = simulate_plan(profile, plan, catalogue, steps=simulate_steps)
    return plan


def plan_pools(profile: WorkloadProfile, plan: Plan, catalogue: dict[str, HardwareClass]) -> dict[str, Any]:
    """The simulator's view of the planned pools: generation slots (decode devices × batch), env slots
    (CPU nodes × cores) and per-turn generation times from the roofline (keyword arguments of
    :func:`~rollart_core.plan.simulate.simulate`)."""
    gens = {
        tp.task: roofline_gen_time(profile.model, catalogue[tp.prefill.hw], catalogue[tp.decode.hw])
        for tp in plan.tasks
    }
    slots = sum(tp.gpus_decode * tp.decode.batch for tp in plan.tasks)
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
    """Replay the profile on the planned pools, Sync+, One-off and async (roofline generation times)."""
    pools = plan_pools(profile, plan, catalogue)
    return {m: simulate(profile, mode=m, alpha=alpha, steps=steps, **pools) for m in MODES}


def render_plan(plan: Plan) -> str:
    lines = ["task → pool (roofline, per trajectory)"]
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
    lines.append(
        "pools: "
        + ", ".join(f"{h} × {n}" for h, n in plan.pools.items())
        + f"   (${plan.cost_per_hour:.2f}/h)"
    )
    lines.append(
        "stage capacity (trajectories/s): "
        + ", ".join(f"{k} {v:.2f}" for k, v in plan.stage_traj_per_s.items())
    )
    lines.append(
        f"predicted bottleneck: {plan.bottleneck} → {plan.traj_per_s:.2f} trajectories/s, "
        f"{plan.traj_per_s * 3600 / max(plan.cost_per_hour, 1e-9):.0f} trajectories per $"
    )
    for mode, r in plan.simulated.items():
        lines.append(
            f"simulated {mode:<7}: {r.traj_per_s:.2f} trajectories/s, step {r.step_s:.1f} s, "
            f"aborted {r.aborted}, generation busy {r.gen_busy:.0%}"
        )
    return "\n".join(lines)
