"""The trainer pool and the split of a GPU budget between training and rollout.

Training is compute-bound, so a step's time comes from its FLOPs (the usual dense-transformer count,
forward + backward):

    train_s(T) = 6 · N · tokens_per_step / (T · peak · mfu)

for ``N`` parameters, ``tokens_per_step`` the tokens of one batch (every trajectory's prompt, later
turns' observations and generated tokens: :meth:`TaskProfile.prefill_tokens` + ``decode_tokens``),
``T`` trainer devices of one class with ``peak`` dense BF16 FLOP/s (the catalogue) and ``mfu`` the
fraction of it reached (``TrainProfile.mfu``, stated in the plan). Extra forward passes (reference or
old-policy log-probs, more PPO epochs) are not in the 6; lower the MFU to account for them.

Memory: full fine-tuning in bf16 mixed precision keeps 2 (bf16 weights) + 2 (bf16 gradients) + 4 (fp32
master weights) + 8 (fp32 Adam moments) = 16 bytes per parameter, fully sharded over the ranks
(FSDP / ZeRO-3); a rank may fill ``TRAIN_MEM_FRACTION`` of its device with them, the rest is left to
activations (with checkpointing). The trainer needs at least
``ceil(16 · N / (TRAIN_MEM_FRACTION · memory))`` devices of its class.

Splitting ``G`` devices into ``T`` trainer + ``R`` rollout devices, with ``compute_s(R)`` the seconds
the rollout devices compute one step's batch (its GPU-seconds / R), ``L`` one trajectory's latency
(turns, env calls, reward: no step's rollout is shorter), ``push_s`` / ``sync_s`` the weight push and
the engines' pause per update and ``d = alpha + 1`` the steps of groups async keeps in flight, each
mode's step is

- ``sync`` (Sync+: the stages run one after the other): ``max(compute_s, L) + train_s + push_s + sync_s``;
- ``one_off`` (the next batch's rollout overlaps training; the loop waits for the push and the
  update): ``max(compute_s, L, train_s + push_s) + sync_s``;
- ``async`` (the trainer trains beside rollout, the push lands in the background, the engines pause
  for each update): ``max(compute_s + sync_s, train_s, (L + train_s + push_s + sync_s) / d)``; the
  last term because a group admitted when a batch is taken starts on the coming version, after
  that batch's training and update, and is trained ``d`` steps later;

and the split is the ``T`` with the shortest step (ties: the fewest trainer devices, the rest to
rollout, whose queues absorb the latency tails this closed form leaves out): Sync+ minimises the sum
of the two stages, the overlapping modes balance them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from rollart_core.errors import ConfigError
from rollart_core.plan.catalogue import HardwareClass
from rollart_core.plan.workload import WorkloadProfile

__all__ = [
    "TRAIN_BYTES_PER_PARAM",
    "TRAIN_MEM_FRACTION",
    "Split",
    "TrainerSizing",
    "best_split",
    "choose_train_class",
    "min_train_gpus",
    "rollout_floor",
    "size_trainer",
    "step_seconds",
    "train_tokens_per_step",
]

TRAIN_BYTES_PER_PARAM = 16
"""bf16 weights (2) + bf16 gradients (2) + fp32 master weights (4) + fp32 Adam moments (8)."""
TRAIN_MEM_FRACTION = 0.75
"""Share of a trainer device's memory for weights, gradients and optimizer state (the rest:
activations)."""


def train_tokens_per_step(profile: WorkloadProfile) -> float:
    """Tokens the trainer sees per step: every trajectory of the batch, prompt and all turns."""
    return sum(t.trajectories_per_step * (t.prefill_tokens() + t.decode_tokens()) for t in profile.tasks)


def min_train_gpus(params: float, hw: HardwareClass) -> int:
    """Devices of class ``hw`` that hold ``params``' training state fully sharded (0: not a GPU)."""
    if hw.kind != "gpu" or hw.mem_bytes <= 0:
        return 0
    return max(1, math.ceil(TRAIN_BYTES_PER_PARAM * params / (TRAIN_MEM_FRACTION * hw.mem_bytes)))


def choose_train_class(
    params: float, catalogue: dict[str, HardwareClass], allowed: list[str] | None, train_class: str | None
) -> str:
    """The trainer's class: ``train_class`` if given, else the GPU class with the most FLOP/s per
    dollar (training is compute-bound), fewer devices needed as the tie-break."""
    if train_class is not None:
        hw = catalogue.get(train_class)
        if hw is None or hw.kind != "gpu":
            gpus = sorted(n for n, h in catalogue.items() if h.kind == "gpu")
            raise ConfigError(f"trainer class {train_class!r} is not a GPU class of the catalogue ({gpus})")
        return train_class
    gpus = [n for n, h in catalogue.items() if h.kind == "gpu" and h.flops > 0 and h.mem_bytes > 0]
    gpus = [n for n in gpus if allowed is None or n in allowed]
    if not gpus:
        raise ConfigError("no GPU class with FLOP/s and memory to train on (check --classes / --catalogue)")
    return max(
        gpus,
        key=lambda n: (
            catalogue[n].flops / catalogue[n].price_per_hour,
            -min_train_gpus(params, catalogue[n]),
        ),
    )


@dataclass
class TrainerSizing:
    """How a step's training time depends on the trainer's devices."""

    hw: str
    min_gpus: int
    """Devices that hold the training state (16 bytes/param, sharded)."""
    tokens_per_step: float
    flops_per_step: float
    """6 · N · tokens_per_step."""
    peak_flops: float
    mfu: float
    measured_s: float = 0.0
    """A measured step time from the profile (0: from FLOPs)."""
    measured_gpus: int | None = None
    """Devices it was measured on (None: unknown, the time is kept as is)."""

    @property
    def source(self) -> str:
        if not self.measured_s:
            return "flops"
        return "measured" if self.measured_gpus else "measured, fixed"

    def seconds(self, gpus: int) -> float:
        if self.measured_s:
            return self.measured_s * (self.measured_gpus or gpus) / gpus
        return self.flops_per_step / (gpus * self.peak_flops * self.mfu)


def size_trainer(profile: WorkloadProfile, hw_name: str, hw: HardwareClass) -> TrainerSizing:
    tokens = train_tokens_per_step(profile)
    train = profile.train
    return TrainerSizing(
        hw=hw_name,
        min_gpus=min_train_gpus(profile.model.params, hw),
        tokens_per_step=tokens,
        flops_per_step=6 * profile.model.params * tokens,
        peak_flops=hw.flops,
        mfu=train.mfu,
        measured_s=train.train_s,
        measured_gpus=train.gpus,
    )


def rollout_floor(
    mode: str, latency_s: float, train_s: float, push_s: float, sync_s: float, depth: int
) -> float:
    """The shortest rollout of a step however many rollout devices (the module's latency terms)."""
    if mode == "async":
        return (latency_s + train_s + push_s + sync_s) / depth
    return latency_s


def step_seconds(
    mode: str,
    compute_s: float,
    latency_s: float,
    train_s: float,
    push_s: float,
    sync_s: float,
    depth: int = 1,
) -> float:
    """One step of ``mode`` from its stages' times (the module's formulas)."""
    if mode == "sync":
        return max(compute_s, latency_s) + train_s + push_s + sync_s
    if mode == "one_off":
        return max(compute_s, latency_s, train_s + push_s) + sync_s
    return max(compute_s + sync_s, rollout_floor(mode, latency_s, train_s, push_s, sync_s, depth), train_s)


@dataclass
class Split:
    """One mode's split of the budget and what it predicts."""

    mode: str
    trainer_gpus: int
    rollout_gpus: int
    gen_s: float
    """Rollout time of one step's batch (GPU-bound or latency-bound, whichever is longer)."""
    latency_s: float
    """Of which the latency floor (:func:`rollout_floor`)."""
    gen_compute_s: float
    """Of which the rollout devices compute (GPU-seconds per step / rollout devices)."""
    train_s: float
    step_s: float
    traj_per_s: float
    bottleneck: str

    @property
    def gen_busy(self) -> float:
        """Share of the step the rollout devices compute at full batch."""
        return self.gen_compute_s / self.step_s if self.step_s > 0 else 0.0

    @property
    def train_busy(self) -> float:
        """Share of the step the trainer trains."""
        return self.train_s / self.step_s if self.step_s > 0 else 0.0


def best_split(
    mode: str,
    budget: int,
    *,
    min_trainer: int,
    min_rollout: int,
    gen_compute: Callable[[int], float],
    latency_s: float,
    depth: int,
    trainer: TrainerSizing,
    push_s: float,
    sync_s: float,
    trajectories_per_step: int,
) -> Split:
    """The split of ``budget`` devices with the shortest ``mode`` step (see the module docstring).
    ``gen_compute(R)``: seconds the rollout devices compute per step on ``R`` devices;
    ``latency_s``: one trajectory's latency; ``depth``: steps of groups in flight (async)."""
    best: tuple[float, int] | None = None
    for t in range(min_trainer, budget - min_rollout + 1):
        step = step_seconds(
            mode, gen_compute(budget - t), latency_s, trainer.seconds(t), push_s, sync_s, depth
        )
        if best is None or step < best[0] * (1 - 1e-9):
            best = (step, t)
    if best is None:
        raise ConfigError(
            f"no split of {budget} devices leaves {min_trainer} to train and {min_rollout} to roll out"
        )
    step, t = best
    r = budget - t
    compute = gen_compute(r)
    tr = trainer.seconds(t)
    floor = rollout_floor(mode, latency_s, tr, push_s, sync_s, depth)
    terms = {
        "generation": compute,
        "trajectory latency": floor if floor > compute else 0.0,
        "training": tr,
        "weight sync": push_s + sync_s,
    }
    return Split(
        mode=mode,
        trainer_gpus=t,
        rollout_gpus=r,
        gen_s=max(compute, floor),
        latency_s=floor,
        gen_compute_s=compute,
        train_s=tr,
        step_s=step,
        traj_per_s=trajectories_per_step / step if step > 0 else math.inf,
        bottleneck=max(terms, key=lambda k: terms[k]),
    )
