"""An async RollArt run built in plain Python instead of YAML, and stepped through its recipe.

    uv run --no-sync python examples/recipes/async_frozenlake.py [--steps 6]

What it shows: the config models are the same ones YAML fills in; ``Pipeline`` builds the components
(tiny Qwen2 created in code, vLLM CPU in a Ray actor, torch trainer in its own process, filesystem
weight store); ``run_async`` is the async mode's recipe (Get Batch → Suspend/Update/Resume/Recompute
KV → Train → push), which yields after every step, so a caller can look at each step's record or
stop early. ``rollart_core.control.train.train(cfg)`` does the same plus evaluation, checkpoints and
metric files. About 1.5 minutes on a 2-core CPU machine (most of it starting Ray and the engine).
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from rollart_core.config import RunConfig
from rollart_core.control.asynchronous import run_async
from rollart_core.control.pipeline import Pipeline
from rollart_core.control.steps import Run, step_metrics


def config(steps: int, out: Path) -> RunConfig:
    return RunConfig.model_validate(
        {
            "name": "async-frozenlake",
            "output_dir": str(out),
            "seed": 0,
            "model": {"path": ".rollart/models/tiny-qwen2-cells", "create_tiny": True},
            "engines": [
                {
                    "name": "gen",
                    "impl": "vllm",
                    "num_cpus": 1,
                    "options": {"max_model_len": 1024, "max_num_seqs": 64},
                }
            ],
            "tasks": [
                {
                    "name": "frozenlake",
                    "env": {"impl": "frozenlake", "options": {"size": 4, "max_steps": 12}},
                    "reward": {"impl": "success"},
                    "sampling": {"max_tokens": 1, "temperature": 1.0},
                    "group_size": 8,
                    "groups_per_step": 4,
                    "max_turns": 12,
                }
            ],
            "trainer": {"impl": "torch", "options": {"lr": 3e-4, "spawn": True, "num_threads": 1}},
            "loop": {"mode": "async", "alpha": 1, "steps": steps},
            "ray": {"num_cpus": 2},
        }
    ).resolve_paths(Path.cwd())


async def main(steps: int, out: Path) -> None:
    async with Pipeline(config(steps, out)) as p:
        run = Run(p)
        try:
            async for rec in run_async(run):
                m = step_metrics(run, rec)
                print(
                    f"step {rec.step}: version {m['version']} reward {m['reward_mean']:.3f} "
                    f"lag_max {m['lag_max']} wait {m['wait_s']:.2f}s train {m['train_s']:.2f}s fates {m['fates']}"
                )
        finally:
            await run.stop()
        print(
            f"served version {run.clock.served}, fates {dict(run.rollout.fates)}, launched {run.rollout.launched}"
        )


if __name__ == "__main__":  # vLLM spawns processes: keep the entry point guarded
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", type=Path, default=Path("runs/recipe-async"))
    args = ap.parse_args()
    asyncio.run(main(args.steps, args.out))
