from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rollart_core.config import RunConfig, load_config
from rollart_core.errors import ConfigError

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "frozenlake_tiny.yaml"


def _write(tmp_path: Path, data: object) -> Path:
    p = tmp_path / "cfg.yaml"
    p.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return p


def _example() -> dict:
    return yaml.safe_load(EXAMPLE.read_text())


def test_example_config_loads() -> None:
    cfg = load_config(EXAMPLE)
    assert isinstance(cfg, RunConfig)
    assert cfg.model.path.is_absolute()
    assert cfg.tasks[0].env.impl == "frozenlake"


def test_unknown_field_names_field_and_file(tmp_path: Path) -> None:
    data = _example()
    data["loop"]["stepz"] = 3
    p = _write(tmp_path, data)
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    msg = str(ei.value)
    assert str(p) in msg and "loop.stepz" in msg


def test_wrong_type_names_nested_field(tmp_path: Path) -> None:
    data = _example()
    data["tasks"][0]["group_size"] = "many"
    with pytest.raises(ConfigError, match=r"tasks\.0\.group_size"):
        load_config(_write(tmp_path, data))


def test_invalid_sampling_params_rejected(tmp_path: Path) -> None:
    data = _example()
    data["tasks"][0]["sampling"] = {"max_tokens": 0}
    with pytest.raises(ConfigError, match=r"tasks\.0\.sampling\.max_tokens"):
        load_config(_write(tmp_path, data))


def test_task_engine_group_must_name_an_engine_group(tmp_path: Path) -> None:
    data = _example()
    data["tasks"][0]["engine_group"] = "H800"
    with pytest.raises(ConfigError, match="engine_group 'H800' is not an engine group"):
        load_config(_write(tmp_path, data))


def test_a_renamed_key_is_refused_with_its_new_name(tmp_path: Path) -> None:
    data = _example()
    data["tasks"][0]["pool"] = data["engines"][0]["name"]
    with pytest.raises(ConfigError, match=r"tasks\.0.*'pool' was renamed: write 'engine_group' instead"):
        load_config(_write(tmp_path, data))


def test_the_old_train_section_is_refused_with_loop(tmp_path: Path) -> None:
    data = _example()
    data["train"] = data.pop("loop")
    with pytest.raises(ConfigError, match=r"'train' was renamed: write 'loop' instead"):
        load_config(_write(tmp_path, data))


@pytest.mark.parametrize("text", ["engines: [unclosed", "- just\n- a list\n"])
def test_bad_yaml(tmp_path: Path, text: str) -> None:
    with pytest.raises(ConfigError, match=str(tmp_path)):
        load_config(_write(tmp_path, text))


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "nope.yaml")


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rollart_core.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_cli_without_arguments_prints_help() -> None:
    r = _cli()
    assert r.returncode == 0
    assert "usage: rollart" in r.stdout and "train" in r.stdout


def test_cli_invalid_config_exits_nonzero_without_traceback(tmp_path: Path) -> None:
    data = _example()
    data["trainer"]["bogus"] = 1
    r = _cli("train", str(_write(tmp_path, data)))
    assert r.returncode == 2
    assert "trainer.bogus" in r.stderr and "cfg.yaml" in r.stderr
    assert "Traceback" not in r.stderr + r.stdout


def test_cli_invalid_component_options_exit_nonzero(tmp_path: Path) -> None:
    """Options are validated by the chosen implementation before anything starts."""
    data = _example()
    data["tasks"][0]["env"]["options"]["size"] = 1
    data["output_dir"] = str(tmp_path / "out")
    r = _cli("train", str(_write(tmp_path, data)))
    assert r.returncode == 2, r.stderr
    assert "tasks.0.env.options.size" in r.stderr
    assert "Traceback" not in r.stderr


def test_check_config_prints_resolved(tmp_path: Path) -> None:
    r = _cli("check-config", str(EXAMPLE))
    assert r.returncode == 0, r.stderr
    assert '"impl": "frozenlake"' in r.stdout


def test_overlapping_mode_with_an_in_process_trainer_is_warned() -> None:
    from rollart_core.control.pipeline import overlap_warning

    data = _example()
    data["trainer"] = {"impl": "torch", "options": {}}
    for mode, options, warned in [
        ("sync", {}, False),
        ("async", {}, True),
        ("one_off", {}, True),
        ("async", {"spawn": True, "num_threads": 1}, False),
        ("async", {"world_size": 2}, False),
    ]:
        data["loop"] = {**data.get("loop", {}), "mode": mode, "alpha": 0 if mode == "sync" else 1}
        data["trainer"]["options"] = options
        msg = overlap_warning(RunConfig.model_validate(data))
        assert (msg is not None) == warned, (mode, options)
        if warned:
            assert "spawn: true" in msg and mode in msg


def test_async_alpha_0_with_the_update_after_get_batch_is_refused(tmp_path: Path) -> None:
    data = _example()
    data["loop"].update(mode="async", alpha=0, update_on_arrival=False)
    with pytest.raises(ConfigError, match=r"update_on_arrival true or loop\.async_weight_sync false"):
        load_config(_write(tmp_path, data))
    for fix in ({"update_on_arrival": True}, {"async_weight_sync": False}, {"alpha": 1}):
        load_config(_write(tmp_path, {**data, "loop": {**data["loop"], **fix}}))
