"""Workload profiles: what a run's tasks ask of the hardware, given by hand or measured from a run.

A profile (YAML/JSON) is what ``rollart plan --profile`` reads::

    model: {params: 7.0e9, num_layers: 28, num_kv_heads: 4, head_dim: 128}
    tasks:
      - name: swe
        trajectories_per_step: 256
        prompt_tokens: 4000          # first turn's context
        context_tokens_per_turn: 600 # observation tokens added by each later turn
        output_tokens_per_turn: 400
        turns: 12
        env_latency_s: {mean: 4.0, dist: lognormal, sigma: 1.2}   # per env call (reset and each step)
        reward_s: {mean: 2.0}
    train: {train_s: 60, gpus: 16, sync_s: 5}   # or {mfu: 0.4}: train_s from 6 · params · tokens

:func:`profile_from_trajectories` derives one from finished :class:`Trajectory` objects (token
counts per turn, ``timings["env"|"generate"|"reward"]``) plus a run's per-step metrics rows
(``train_s``, ``sync_s``), keeping the measured latency samples for the simulator to replay.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from statistics import fmean
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rollart_core.config import read_yaml_mapping
from rollart_core.errors import ConfigError, validation_details
from rollart_core.types import Trajectory

__all__ = [
    "LatencyDist",
    "ModelProfile",
    "TaskProfile",
    "TrainProfile",
    "WorkloadProfile",
    "load_profile",
    "profile_from_run",
    "profile_from_trajectories",
]

_MAX_SAMPLES = 4096


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class LatencyDist(_Model):
    """A latency distribution in seconds."""

    mean: float = Field(0.0, ge=0)
    dist: Literal["constant", "exponential", "lognormal", "empirical"] = "constant"
    sigma: float = Field(1.0, gt=0)
    """lognormal: shape (std of the log); the mean is kept at ``mean``."""
    samples: list[float] = Field(default_factory=list)
    """empirical: measured values, replayed uniformly at random."""

    def sample(self, rng: random.Random) -> float:
        if self.dist == "empirical" and self.samples:
            return rng.choice(self.samples)
        if self.dist == "exponential":
            return rng.expovariate(1 / self.mean) if self.mean > 0 else 0.0
        if self.dist == "lognormal" and self.mean > 0:
            return rng.lognormvariate(math.log(self.mean) - self.sigma**2 / 2, self.sigma)
        return self.mean

    @classmethod
    def of(cls, values: Sequence[float]) -> LatencyDist:
        vals = [max(0.0, float(v)) for v in values]
        if not vals:
            return cls()
        step = max(1, len(vals) // _MAX_SAMPLES)
        return cls(mean=fmean(vals), dist="empirical", samples=vals[::step])


class ModelProfile(_Model):
    params: float = Field(7e9, gt=0)
    num_layers: int = Field(28, ge=1)
    num_kv_heads: int = Field(4, ge=1)
    head_dim: int = Field(128, ge=1)
    dtype_bytes: int = Field(2, ge=1)

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> ModelProfile:
        """Shapes and parameter count of a decoder-only transformer from its Hugging Face
        ``config.json`` (Llama / Qwen2 / Mistral layout): embeddings (and an untied head), per layer
        q/k/v/o projections (biases where the family has them), a gated MLP (3 matrices) and two
        norms, plus the final norm. Served in bf16 (2 bytes) whatever the checkpoint's dtype."""
        try:
            h, layers = int(config["hidden_size"]), int(config["num_hidden_layers"])
            vocab, inter = int(config["vocab_size"]), int(config["intermediate_size"])
            heads = int(config["num_attention_heads"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"model config.json: missing or bad field {exc} to count parameters") from None
        kv = int(config.get("num_key_value_heads") or heads)
        hd = int(config.get("head_dim") or h // heads)
        bias = bool(config.get("attention_bias", config.get("model_type") == "qwen2"))
        attn = 2 * h * heads * hd + 2 * h * kv * hd + (heads * hd + 2 * kv * hd if bias else 0)
        per_layer = attn + 3 * h * inter + 2 * h
        embed = vocab * h * (1 if config.get("tie_word_embeddings", False) else 2)
        return cls(
            params=embed + layers * per_layer + h,
            num_layers=layers,
            num_kv_heads=kv,
            head_dim=hd,
        )

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> float:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


class TaskProfile(_Model):
    name: str
    trajectories_per_step: int = Field(64, ge=1)
    group_size: int = Field(8, ge=1)
    prompt_tokens: float = Field(256, ge=0)
    context_tokens_per_turn: float = Field(0, ge=0)
    output_tokens_per_turn: float = Field(256, ge=0)
    turns: float = Field(1, ge=1)
    turns_samples: list[int] = Field(default_factory=list)
    """Measured turns per trajectory (the simulator replays them; ``turns`` is their mean)."""
    env_latency_s: LatencyDist = LatencyDist()
    """Per environment call: the reset and every step."""
    env_timeout_s: float | None = Field(None, gt=0)
    """An env call longer than this ends its trajectory ``timed_out`` at the timeout (the task's
    ``env_timeout_s``)."""
    fail_prob: float = Field(0.0, ge=0, le=1)
    """Per trajectory: probability that one of its env calls fails (``env_failed``)."""
    fail_within_calls: int = Field(1, ge=1)
    """The failing call is drawn uniformly from the first this-many calls (0 = the reset)."""
    redundancy: int = Field(0, ge=0)
    """Extra trajectories launched per group, cancelled once ``group_size`` finished."""
    reward_s: LatencyDist = LatencyDist()
    reward_serverless: bool = True
    generate_s: LatencyDist | None = None
    """Measured per-turn generation latency; when set the simulator replays it instead of the roofline."""

    def prefill_tokens(self) -> float:
        """Tokens prefilled per trajectory (prefix cache hit on the history of earlier turns)."""
        return self.prompt_tokens + (self.turns - 1) * self.context_tokens_per_turn

    def decode_tokens(self) -> float:
        return self.turns * self.output_tokens_per_turn

    def mean_context(self) -> float:
        """Average sequence length while decoding (for the KV cache read per step)."""
        return (
            self.prompt_tokens
            + (self.turns - 1) / 2 * (self.context_tokens_per_turn + self.output_tokens_per_turn)
            + self.output_tokens_per_turn / 2
        )

    def sample_turns(self, rng: random.Random) -> int:
        if self.turns_samples:
            return rng.choice(self.turns_samples)
        lo = int(self.turns)
        return lo + (rng.random() < self.turns - lo)


class TrainProfile(_Model):
    train_s: float = Field(0.0, ge=0)
    """Seconds per training step (the whole batch), measured; 0: the planner computes it from the
    step's FLOPs (6 · params · tokens) on the trainer pool it sizes."""
    gpus: int | None = Field(None, ge=1)
    """Trainer devices ``train_s`` was measured on: the planner scales it to the pool it sizes
    (``train_s · gpus / T``). None with ``train_s`` > 0: the measured time is kept for any pool."""
    mfu: float = Field(0.4, gt=0, le=1)
    """Model FLOPs utilisation the trainer reaches when ``train_s`` is 0: the share of the trainer
    class's peak FLOP/s that 6 · params · tokens per step runs at."""
    sync_s: float = Field(0.0, ge=0)
    """Seconds the engines are suspended per weight update (Suspend → Update → Resume)."""
    push_s: float = Field(0.0, ge=0)
    """Seconds from the end of a train step until its weights are staged on the engines (the loop
    waits for it in Sync+ and One-off; in async it runs beside the next step)."""
    colocated_slowdown: float = Field(0.0, ge=0)
    """Generation runs this much slower (0.5 = 1.5× latency) while the trainer runs, when both share
    the same hardware (the CPU default); 0 for disaggregated clusters."""
    train_colocated_slowdown: float = Field(0.0, ge=0)
    """The trainer runs this much slower while rollout runs beside it on the same hardware (async
    modes only: in Sync+ the trainer runs alone); 0 for disaggregated clusters."""


class WorkloadProfile(_Model):
    model: ModelProfile = ModelProfile()
    tasks: list[TaskProfile] = Field(min_length=1)
    train: TrainProfile = TrainProfile()
    gen_slots: int | None = Field(None, ge=1)
    """Measured runs: concurrent generation requests the engines served (None: unbounded)."""
    measured: dict[str, Any] = Field(default_factory=dict)
    """What the run measured (mode, traj_per_s, ...), for comparison; not used by the models."""

    def task(self, name: str) -> TaskProfile:
        for t in self.tasks:
            if t.name == name:
                return t
        raise ConfigError(f"no task {name!r} in the profile ({[t.name for t in self.tasks]})")


def load_profile(path: str | Path) -> WorkloadProfile:
    p = Path(path)
    raw = read_yaml_mapping(p, "profile")
    try:
        return WorkloadProfile.model_validate(raw)
    except ValidationError as exc:
        errs = "; ".join(validation_details(exc))
        raise ConfigError(f"{p}: {errs}") from None


def profile_from_trajectories(
    trajectories: Iterable[Trajectory],
    metrics: Iterable[Mapping[str, Any]] = (),
    *,
    model: ModelProfile | None = None,
    trajectories_per_step: Mapping[str, int] | None = None,
    group_size: Mapping[str, int] | None = None,
    gen_slots: int | None = None,
    skip_steps: int = 1,
) -> WorkloadProfile:
    """Build a profile from finished trajectories and per-step metrics rows (the first
    ``skip_steps`` rows are warm-up and skipped for train/sync times)."""
    by_task: dict[str, list[Trajectory]] = {}
    for t in trajectories:
        if t.fate is not None and t.fate.value == "finished" and t.turns:
            by_task.setdefault(t.task, []).append(t)
    if not by_task:
        raise ConfigError("no finished trajectory to build a profile from")
    tasks = []
    for name, ts in by_task.items():
        turns = [len(t.turns) for t in ts]
        later = [len(u.context_ids) for t in ts for u in t.turns[1:]]
        env_calls = [t.timings.get("env", 0.0) / (len(t.turns) + 1) for t in ts]
        gen_turn = [t.timings.get("generate", 0.0) / len(t.turns) for t in ts]
        tasks.append(
            TaskProfile(
                name=name,
                trajectories_per_step=(trajectories_per_step or {}).get(name, len(ts)),
                group_size=(group_size or {}).get(name, 1),
                prompt_tokens=fmean(len(t.turns[0].context_ids) for t in ts),
                context_tokens_per_turn=fmean(later) if later else 0.0,
                output_tokens_per_turn=fmean(len(u.output_ids) for t in ts for u in t.turns),
                turns=fmean(turns),
                turns_samples=turns[:_MAX_SAMPLES],
                env_latency_s=LatencyDist.of(env_calls),
                reward_s=LatencyDist.of([t.timings.get("reward", 0.0) for t in ts]),
                generate_s=LatencyDist.of(gen_turn),
            )
        )
    rows = [m for m in metrics if "train_s" in m]
    rows = rows[skip_steps:] or rows
    train = TrainProfile(
        train_s=fmean(r["train_s"] for r in rows) if rows else 0.0,
        sync_s=fmean(r.get("sync_s", 0.0) for r in rows) if rows else 0.0,
    )
    measured: dict[str, Any] = {}
    if rows:
        measured = {
            k: fmean(r[k] for r in rows)
            for k in ("traj_per_s", "step_s", "wait_s")
            if all(k in r for r in rows)
        }
    return WorkloadProfile(
        model=model or ModelProfile(), tasks=tasks, train=train, gen_slots=gen_slots, measured=measured
    )


def profile_from_run(run_dir: str | Path, trajectories: Iterable[Trajectory], **kw: Any) -> WorkloadProfile:
    """:func:`profile_from_trajectories` with the metrics rows read from ``run_dir/metrics.jsonl``."""
    path = Path(run_dir) / "metrics.jsonl"
    try:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        raise ConfigError(f"{path}: no metrics file (is {run_dir} a rollart run directory?)") from None
    return profile_from_trajectories(trajectories, rows, **kw)
