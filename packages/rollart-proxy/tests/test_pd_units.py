"""Fast checks of the PD router's pure parts: configs, the per-turn cost rule, ``auto`` from a task
profile, version-mix reporting. Routing over real vLLM producer/consumer engines is in
integration/tests/test_pd.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from rollart_core.config import RunConfig, TaskConfig
from rollart_core.errors import ConfigError
from rollart_core.plan.workload import TaskProfile
from rollart_proxy import LLMProxy, WorkerHandle
from rollart_proxy.pd import PDConfig, PDOutput, PDRouter, choose_path, resolve_policy, shared_storage_kv_args


class _Unused:
    """Stands for an engine in constructor checks that never call it."""


def _proxy(**task_pools: str) -> LLMProxy:
    ws = [WorkerHandle("p0", _Unused(), pool="H800"), WorkerHandle("d0", _Unused(), pool="H20")]  # type: ignore[arg-type]
    return LLMProxy(ws, task_pools=task_pools)


def test_cost_rule_per_turn() -> None:
    rule = {"min_suffix": 256, "auto_min_ratio": 1.0}
    assert choose_path("on", uncached_tokens=2000, max_tokens=64, **rule) == "pd"
    # multi-turn: the decode worker holds the history, the new suffix is short → stay there
    assert choose_path("on", uncached_tokens=40, max_tokens=64, **rule) == "decode_only"
    assert choose_path("off", uncached_tokens=5000, max_tokens=64, **rule) == "decode_only"
    assert choose_path("on", uncached_tokens=5000, max_tokens=1, **rule) == "decode_only"  # nothing to decode
    # auto without a profile: prompt vs output length of the turn itself
    assert choose_path("auto", uncached_tokens=300, max_tokens=1000, **rule) == "decode_only"
    assert choose_path("auto", uncached_tokens=3000, max_tokens=1000, **rule) == "pd"


def test_auto_resolves_from_the_task_profile() -> None:
    swe = TaskProfile(
        name="swe", prompt_tokens=4000, context_tokens_per_turn=600, output_tokens_per_turn=300, turns=10
    )
    math = TaskProfile(name="math", prompt_tokens=300, output_tokens_per_turn=4000)
    assert resolve_policy("auto", swe, 1.0) == "on"
    assert resolve_policy("auto", math, 1.0) == "off"
    assert resolve_policy("auto", None, 1.0) == "auto"
    assert resolve_policy("off", swe, 1.0) == "off"
    router = PDRouter(
        _proxy(swe="H20", math="H20"),
        PDConfig(pools={"H20": "H800"}, task_policy={"swe": "auto", "math": "auto"}),
        profiles={"swe": swe, "math": math},
    )
    assert (router.policy_of("swe"), router.policy_of("math"), router.policy_of(None)) == ("on", "off", "off")


def test_configs_reject_bad_pairs() -> None:
    with pytest.raises(ValidationError, match="own prefill pool"):
        PDConfig(pools={"a": "a"})
    with pytest.raises(ValidationError, match="also a decode pool"):
        PDConfig(pools={"a": "b", "b": "c"})
    with pytest.raises(ValidationError, match="extra"):
        PDConfig.model_validate({"pools": {}, "bogus": 1})
    with pytest.raises(ConfigError, match="without workers"):
        PDRouter(_proxy(), PDConfig(pools={"H20": "A100"}))
    with pytest.raises(ConfigError, match="prefill pool"):
        PDRouter(_proxy(swe="H800"), PDConfig(pools={"H20": "H800"}))


def test_task_config_pd_fields(tmp_path: Path) -> None:
    base = {"model": {"path": str(tmp_path)}, "engines": [{"name": "pre"}, {"name": "dec"}]}
    task = {"name": "t", "env": {"impl": "x"}, "reward": {"impl": "y"}}
    assert TaskConfig.model_validate(task).pd == "off"
    ok = RunConfig.model_validate(
        {**base, "tasks": [{**task, "pd": "auto", "engine_group": "dec", "prefill_engine_group": "pre"}]}
    )
    cfg = PDConfig.from_tasks(ok.tasks, min_pd_suffix_tokens=64)
    assert cfg.pools == {"dec": "pre"} and cfg.task_policy == {"t": "auto"} and cfg.min_pd_suffix_tokens == 64
    for bad, msg in [
        ({"pd": "on", "engine_group": "dec"}, "needs both"),
        ({"pd": "on", "engine_group": "dec", "prefill_engine_group": "dec"}, "other than its engine_group"),
        ({"pd": "on", "engine_group": "dec", "prefill_engine_group": "nope"}, "must be an engine group"),
        ({"engine_group": "nope"}, "is not an engine group"),
        ({"pd": "sometimes"}, "pd"),
        ({"pool": "dec"}, "'pool' was renamed: write 'engine_group' instead"),
        ({"prefill_pool": "pre"}, "'prefill_pool' was renamed: write 'prefill_engine_group' instead"),
    ]:
        with pytest.raises(ValidationError, match=msg):
            RunConfig.model_validate({**base, "tasks": [{**task, **bad}]})
    two = [
        TaskConfig.model_validate(
            {**task, "name": n, "engine_group": "dec", "prefill_engine_group": p, "pd": "on"}
        )
        for n, p in (("a", "pre"), ("b", "other"))
    ]
    with pytest.raises(ConfigError, match="paired with prefill engine group"):
        PDConfig.from_tasks(two)


def test_output_reports_mixed_versions() -> None:
    same = PDOutput("r", [1, 2, 3], [0.0] * 3, [4, 4, 4], "length", "d0", None, "pd", "p0", 4)
    mixed = PDOutput("r", [1, 2, 3], [0.0] * 3, [4, 5, 5], "length", "d0", None, "pd", "p0", 4)
    local = PDOutput("r", [1, 2], [0.0] * 2, [5, 5], "length", "d0", None, "local_fallback")
    assert not same.mixed_versions and mixed.mixed_versions and not local.mixed_versions
    assert mixed.start_version == 4 and mixed.end_version == 5  # still a GenerateOutput


def test_shared_storage_args(tmp_path: Path) -> None:
    from rollart_proxy.engines.vllm_engine import VllmEngineConfig

    args = shared_storage_kv_args("kv_producer", tmp_path)
    cfg = VllmEngineConfig(engine_args=args)
    kv = cfg.engine_args["kv_transfer_config"]
    assert kv["kv_role"] == "kv_producer" and kv["kv_connector_extra_config"]["shared_storage_path"] == str(
        tmp_path
    )
