"""The ranks mode of ``megatron_check.py`` (``--ranks N``): MegatronRankWorker ranks against a world of one.

Both launchers build every rank with ``rollart_train._rendezvous.start_rank_worker``, the function a
RayTrainerGroup's rank actors call: ``ray`` through a real RayTrainerGroup (``worker: megatron``),
``spawn`` through ``rollart_train._multirank.SpawnedRanks`` (torch.multiprocessing, commands over
pipes), which needs nothing but torch where Ray cannot travel. See ``megatron_check.py`` for what is
checked.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from megatron_check import make_batch, write_tiny_qwen2

from rollart_train._multirank import SpawnedRanks

WORKER = "rollart_train.megatron_rank:MegatronRankWorker"
STATS = ("loss", "clip_frac", "approx_kl", "behav_weight", "train_tokens", "grad_norm")


class SpawnedGroup:
    """The calls of RayTrainerGroup this check makes, over spawned ranks (no Ray)."""

    def __init__(self, config: Any, model_path: Path) -> None:
        self.config, self.model_path = config, model_path
        self.ranks = SpawnedRanks(config, model_path, worker=WORKER)
        self.resumed_state: dict[str, Any] = self.ranks.initial_state

    def train_step(self, batch: list[Any]) -> dict[str, float]:
        return self.ranks.train_step(batch)

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter((self.ranks.full_weights() or {}).items())

    def logprobs(self, ids: list[int]) -> list[float]:
        return self.ranks.logprobs(list(ids))

    def save(self, path: Path) -> None:
        self.ranks.save(str(path), None)

    def load(self, path: Path) -> None:
        self.ranks.close()
        cfg = self.config.model_copy(update={"resume_from": str(path)})
        self.ranks = SpawnedRanks(cfg, self.model_path, worker=WORKER)
        self.resumed_state = self.ranks.initial_state

    def close(self) -> None:
        self.ranks.close()


def _launcher(choice: str) -> str:
    if choice != "auto":
        return choice
    import importlib.util

    return "ray" if importlib.util.find_spec("ray") is not None else "spawn"


def _start_ray(device: str) -> None:
    import ray

    from rollart_core.resources import LOOPBACK_ENV

    for k, v in LOOPBACK_ENV.items():
        os.environ.setdefault(k, v)
    gpus = torch.cuda.device_count() if device == "cuda" else 0
    ray.init(num_cpus=os.cpu_count(), num_gpus=gpus, include_dashboard=False, log_to_driver=False)


def _group(launcher: str, config: Any, model_path: Path, ranks: int) -> Any:
    if launcher == "spawn":
        return SpawnedGroup(config.model_copy(update={"world_size": ranks}), model_path)
    from rollart_train import RayTrainerGroup

    gpus = 0.0
    if config.device == "cuda":  # ranks share the GPUs when there are fewer than ranks
        gpus = min(1.0, torch.cuda.device_count() / ranks)
    options = config.model_dump(exclude={"world_size"}, exclude_defaults=True)
    return RayTrainerGroup(
        {
            "worker": "megatron",
            "ranks": ranks,
            "num_gpus_per_rank": gpus,
            "options": options,
            "call_timeout_s": 600,
            "placement_timeout_s": 600,
        },
        model_path=model_path,
    )


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def _two_steps(
    group: Any, batches: list[list[Any]], probe: list[int] | None, ckpt: Path | None
) -> dict[str, Any]:
    """Weights (and ``probe``'s logprobs) before, the two steps' metrics, a checkpoint between them,
    the weights after."""
    out: dict[str, Any] = {"start": dict(group.named_weights())}
    out["lp"] = group.logprobs(probe) if probe is not None else None
    out["m1"] = group.train_step(batches[0])
    if ckpt is not None:
        group.save(ckpt)
    out["m2"] = group.train_step(batches[1])  # the group is at version 1: every token is one step stale
    out["after"] = dict(group.named_weights())
    return out


def run_ranks(args: argparse.Namespace) -> int:
    from rollart_train.megatron_config import MegatronTrainerConfig

    launcher = _launcher(args.launcher)
    cuda = args.device == "cuda"
    n_gpus = torch.cuda.device_count() if cuda else 0
    share = cuda and n_gpus < args.ranks
    result: dict[str, Any] = {
        "mode": "ranks",
        "launcher": launcher,
        "device": args.device,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "gpus": n_gpus,
        "ranks": args.ranks,
        "tp": args.tp,
        "pp": args.pp,
        "dp": args.ranks // max(args.tp * args.pp, 1),
        "backend": "gloo" if share or not cuda else "nccl",
    }
    checks: dict[str, bool] = {}
    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="rollart-mcore-ranks-"))
    hf = write_tiny_qwen2(tmp / "tiny")
    base = MegatronTrainerConfig(
        device=args.device,
        bf16=False,  # float32: the N-rank group is compared with the world of one
        lr=1e-4,
        micro_batch_size=2,
        loss="decoupled_ppo",
        tis_cap=2.0,
        dist_backend="gloo" if share else "auto",
        num_threads=max(1, (os.cpu_count() or 2) // (args.ranks + 1)),
        rank_timeout_s=600,
    )
    group: Any = None
    try:
        if launcher == "ray":
            _start_ray(args.device)
        times: dict[str, float] = {}
        t = time.perf_counter()
        group = _group(launcher, base, tmp / "tiny", 1)
        times["start_world_of_one_s"] = time.perf_counter() - t
        g = torch.Generator().manual_seed(1)
        probe = torch.randint(1, 500, (24,), generator=g).tolist()
        batches = [make_batch(group.logprobs, g, 0, 0.0), make_batch(group.logprobs, g, 0, 0.2)]
        one = _two_steps(group, batches, probe, None)
        group.close()
        group = None
        cfg = base.model_copy(update={"tensor_parallel": args.tp, "pipeline_parallel": args.pp})
        t = time.perf_counter()
        group = _group(launcher, cfg, tmp / "tiny", args.ranks)
        times["start_group_s"] = time.perf_counter() - t
        result["layout_rank0"] = group.resumed_state.get("layout")
        t = time.perf_counter()
        many = _two_steps(group, batches, probe if args.pp == 1 else None, tmp / "ckpt-1")
        times["group_two_steps_s"] = time.perf_counter() - t
        checks["names"] = set(many["start"]) == set(hf)
        checks["weights_gathered_exactly"] = checks["names"] and _max_diff(many["start"], hf) == 0.0
        if args.pp == 1:
            diff = max(abs(a - b) for a, b in zip(many["lp"], one["lp"], strict=True))
            result["logprob_max_abs_diff"] = diff
            checks["logprobs_match"] = diff < 1e-4
        for step in ("m1", "m2"):
            result[f"{step}_group"], result[f"{step}_world_of_one"] = many[step], one[step]
            checks[f"{step}_finite"] = all(math.isfinite(v) for v in many[step].values())
            checks[f"{step}_updated"] = many[step]["update_successful"] == 1.0
            checks[f"{step}_matches"] = all(
                math.isclose(many[step][k], one[step][k], rel_tol=1e-3, abs_tol=1e-6) for k in STATS
            )
        checks["proximal_recomputed"] = many["m2"]["proximal_recomputed"] == 1.0
        checks["version"] = many["m2"]["version"] == 2.0
        moved = _max_diff(one["after"], one["start"])
        result["weight_step"], result["weight_diff"] = moved, _max_diff(many["after"], one["after"])
        checks["weights_moved"] = moved > 0
        checks["weights_match"] = result["weight_diff"] < 0.1 * moved
        t = time.perf_counter()
        group.load(tmp / "ckpt-1")  # every rank rebuilt from the checkpoint taken after step 1
        times["reload_s"] = time.perf_counter() - t
        state = group.resumed_state
        checks["reload_version"] = state["version"] == 1
        checks["reload_optimizer_restored"] = bool(state.get("optimizer_restored"))
        again = group.train_step(batches[1])
        result["step2_again_weight_diff"] = _max_diff(dict(group.named_weights()), many["after"])
        checks["reload_same_update"] = (
            math.isclose(again["loss"], many["m2"]["loss"], rel_tol=1e-5, abs_tol=1e-7)
            and result["step2_again_weight_diff"] < 0.01 * moved
        )
        result["times"] = times
    except Exception as exc:  # reported in the JSON (with every rank's traceback) and the exit status
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()
        checks["ran"] = False
    finally:
        if group is not None:
            group.close()
        if launcher == "ray":
            import ray

            ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    result["checks"] = checks
    result["passed"] = bool(checks) and all(checks.values())
    result["total_s"] = time.perf_counter() - t0
    text = json.dumps(result, indent=1, default=str)
    print(text)
    if os.environ.get("OUT"):
        name = f"megatron_check_ranks{args.ranks}_tp{args.tp}_pp{args.pp}.json"
        Path(os.environ["OUT"], name).write_text(text)
    return 0 if result["passed"] else 1
