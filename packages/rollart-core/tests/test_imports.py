"""rollart-core must import without torch, vLLM, Ray or any member package."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = [
    "torch",
    "vllm",
    "ray",
    "transformers",
    "mooncake",
    "sglang",
    "wandb",
    "mlflow",
    "tensorboardX",
    "rollart_proxy",
    "rollart_env",
    "rollart_reward",
    "rollart_train",
    "rollart_weightsync",
]


def _loaded_after(code: str) -> set[str]:
    probe = f"{code}\nimport sys, json\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120
    )
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_core_import_is_light() -> None:
    mods = _loaded_after(
        "import rollart_core, rollart_core.cli, rollart_core.control.pipeline, "
        "rollart_core.trackers, rollart_core.metrics"
    )
    assert not {m for m in mods if m.split(".")[0] in HEAVY}


def test_affinity_decorator_needs_no_ray() -> None:
    mods = _loaded_after(
        "from rollart_core import affinity\n"
        "@affinity(pool='H20', num_gpus=1)\nclass W: pass\n"
        "from rollart_core.resources import get_affinity\nassert get_affinity(W).pool == 'H20'"
    )
    assert "ray" not in mods


def test_member_packages_do_not_import_backends_at_import() -> None:
    mods = _loaded_after("import rollart_proxy, rollart_env, rollart_reward, rollart_weightsync")
    assert not {m for m in mods if m.split(".")[0] in {"torch", "vllm", "ray", "mooncake", "sglang"}}, (
        json.dumps(sorted(m for m in mods if m.split(".")[0] in {"torch", "vllm", "ray"})[:5])
    )
