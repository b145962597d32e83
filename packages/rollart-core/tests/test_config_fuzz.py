"""The config loader on generated input (hypothesis): a valid config mutated at random places, arbitrary
YAML/JSON documents and arbitrary bytes. The only way to refuse is ``ConfigError`` (``load_config``) or
a pydantic ``ValidationError`` (``RunConfig.model_validate``): never another exception."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from rollart_core.config import RunConfig, load_config
from rollart_core.errors import ConfigError

BASE: dict[str, Any] = {
    "name": "fuzz",
    "output_dir": "runs/fuzz",
    "seed": 1,
    "model": {"path": "models/tiny", "create_tiny": True, "dtype": "float32"},
    "engines": [
        {
            "name": "gen",
            "impl": "vllm",
            "count": 1,
            "num_cpus": 0.25,
            "max_restarts": 1,
            "options": {"max_model_len": 512},
        }
    ],
    "tasks": [
        {
            "name": "frozenlake",
            "env": {"impl": "frozenlake", "options": {"size": 4}},
            "reward": {"impl": "success"},
            "reward_executor": {"impl": "inline"},
            "sampling": {"max_tokens": 1, "temperature": 1.0},
            "group_size": 4,
            "groups_per_step": 2,
            "max_turns": 6,
            "engine_group": "gen",
        }
    ],
    "trainer": {"impl": "torch", "ranks": 1, "pool": "H800", "options": {"lr": 0.01}},
    "weight_store": {"impl": "filesystem"},
    "loop": {"mode": "async", "alpha": 1, "steps": 3, "save_every": 1, "stall_timeout_s": 60},
    "ray": {"num_cpus": 2, "resources": {"H800": 1}},
    "env_manager": {"num_envs": 4, "options": {}},
}

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats()
    | st.text(max_size=30)
    | st.sampled_from(["", "\x00", "sync", "async", "one_off", "-1", "1e309", "nan", "~", "..", "/"])
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, (*prefix, i))
    return out


PATHS = _paths(BASE)[1:]


@st.composite
def mutated(draw: st.DrawFn) -> Any:
    """BASE with a few places replaced by random values, deleted, or given an extra key."""
    data = copy.deepcopy(BASE)
    for _ in range(draw(st.integers(1, 4))):
        path = draw(st.sampled_from(PATHS))
        parent: Any = data
        try:
            for key in path[:-1]:
                parent = parent[key]
            if not isinstance(parent, (dict, list)) or (isinstance(parent, list) and path[-1] >= len(parent)):
                continue
            if isinstance(parent, dict) and path[-1] not in parent:
                continue
        except (KeyError, IndexError, TypeError):
            continue  # an earlier mutation changed the shape above this place
        action = draw(st.sampled_from(["replace", "delete", "extra"]))
        if action == "replace":
            parent[path[-1]] = draw(values)
        elif action == "delete" and isinstance(parent, dict):
            del parent[path[-1]]
        elif isinstance(parent, dict):
            parent[draw(st.text(max_size=8))] = draw(values)
    return data


SETTINGS = settings(
    max_examples=200,
    deadline=5000,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def test_the_base_config_is_valid() -> None:
    RunConfig.model_validate(BASE)


@SETTINGS
@given(data=mutated())
def test_model_validate_refuses_only_with_validation_errors(data: Any) -> None:
    try:
        cfg = RunConfig.model_validate(data)
    except ValidationError:
        return
    cfg.resolve_paths(Path("/tmp"))  # what load_config does next with an accepted config
    RunConfig.model_validate(cfg.model_dump(mode="json"))  # an accepted config round-trips


@SETTINGS
@given(data=mutated() | values)
def test_load_config_refuses_only_with_config_error(
    tmp_path_factory: pytest.TempPathFactory, data: Any
) -> None:
    path = tmp_path_factory.mktemp("cfg") / "run.yaml"
    path.write_text(yaml.safe_dump(data, allow_unicode=True))
    try:
        load_config(path)
    except ConfigError as exc:
        assert str(path) in str(exc)  # the error names the file


@SETTINGS
@given(
    raw=st.binary(max_size=400)
    | st.text(max_size=400).map(str.encode)
    | st.integers(1, 300).map(lambda n: ("[" * n * 4).encode())
    | mutated().map(lambda d: json.dumps(d)[: len(json.dumps(d)) // 2].encode())
)
def test_load_config_on_arbitrary_bytes(tmp_path_factory: pytest.TempPathFactory, raw: bytes) -> None:
    path = tmp_path_factory.mktemp("cfg") / "run.yaml"
    path.write_bytes(raw)
    try:
        load_config(path)
    except ConfigError:
        pass


def test_load_config_on_a_directory_and_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        load_config(tmp_path)
    with pytest.raises(ConfigError, match="no such"):
        load_config(tmp_path / "absent.yaml")
