"""Pools from a node table, plan validation messages, task affinity — no Ray needed (the
multi-node placement on a real Ray cluster is integration/tests/test_multinode.py)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rollart_core.errors import ConfigError
from rollart_core.resources import (
    AffinitySpec,
    ClusterView,
    ResourceManager,
    ResourcePlanConfig,
    ServerlessPoolConfig,
    TaskAffinity,
    WorkerDecl,
    affinity,
    get_affinity,
    ray_actor_options,
    validate_plan,
)


def _row(
    nid: str, resources: dict[str, float], labels: dict[str, str] | None = None, alive: bool = True
) -> dict:
    return {
        "NodeID": nid,
        "NodeManagerAddress": "127.0.0.1",
        "Alive": alive,
        "Resources": {"node:127.0.0.1": 1.0, "memory": 8e9, **resources},
        "Labels": labels or {},
    }


@pytest.fixture
def cluster() -> ClusterView:
    return ClusterView.from_node_table(
        [
            _row("gpu-a", {"CPU": 32, "GPU": 8, "accelerator_type:H800": 1}),
            _row("gpu-b", {"CPU": 32, "GPU": 8}, {"ray.io/accelerator-type": "H20"}),
            _row("gpu-c", {"CPU": 32, "GPU": 8}, {"ray.io/accelerator-type": "H20"}),
            _row("cpu-1", {"CPU": 64}, {"rollart.io/pool": "env"}),
            _row("cpu-2", {"CPU": 64, "sandbox": 4}),
            _row("dead", {"CPU": 64, "GPU": 8, "accelerator_type:H800": 1}, alive=False),
        ],
        serverless={"reward-fn": ServerlessPoolConfig(url="http://127.0.0.1:9000")},
    )


def test_pools_are_grouped_by_gpu_model_label_and_custom_resource(cluster: ClusterView) -> None:
    p = cluster.pools
    assert (p["H800"].kind, [n.node_id for n in p["H800"].nodes]) == ("gpu", ["gpu-a"])  # dead node left out
    assert (p["H20"].kind, p["H20"].total("GPU")) == ("gpu", 16)
    assert p["env"].kind == "label" and p["env"].total("CPU") == 64
    assert p["sandbox"].kind == "resource" and p["sandbox"].total("sandbox") == 4
    assert p["reward-fn"].kind == "serverless" and len(p["cpu"].nodes) == 5


def test_gpu_demand_pins_the_model(cluster: ClusterView) -> None:
    spec = AffinitySpec(pool="H800", num_gpus=1, num_cpus=4)
    assert cluster.pools["H800"].demand(spec) == {"CPU": 4, "GPU": 1, "accelerator_type:H800": 0.001}
    assert cluster.pools["H20"].label_selector(AffinitySpec(pool="H20")) == {"ray.io/accelerator-type": "H20"}
    assert cluster.pools["env"].label_selector(AffinitySpec(pool="env")) == {"rollart.io/pool": "env"}


def test_valid_plan_packs_every_replica(cluster: ClusterView) -> None:
    packing = validate_plan(
        [
            WorkerDecl("prefill", AffinitySpec(pool="H800", num_gpus=2, count=4), "engine group"),
            WorkerDecl("decode", AffinitySpec(pool="H20", num_gpus=4, count=4), "engine group"),
            WorkerDecl("envs", AffinitySpec(pool="env", num_cpus=1, count=60)),
            ("sandbox", AffinitySpec(pool="sandbox", count=4)),
            ("reward", AffinitySpec(pool="reward-fn", serverless=True)),
        ],
        cluster,
    )
    assert set(packing["prefill"]) == {"gpu-a"} and sorted(set(packing["decode"])) == ["gpu-b", "gpu-c"]
    assert len(packing["envs"]) == 60 and packing["reward"] == []


def test_shortages_name_the_worker_and_resource(cluster: ClusterView) -> None:
    with pytest.raises(
        ConfigError,
        match=r"engine group 'gen' \(3 × \{CPU: 1, GPU: 4, accelerator_type:H800: "
        r"0.001\}\) needs 12 GPU but pool 'H800' has 8",
    ):
        validate_plan(
            [WorkerDecl("gen", AffinitySpec(pool="H800", num_gpus=4, count=3), "engine group")], cluster
        )
    with pytest.raises(ConfigError, match=r"needs 5 sandbox but the cluster has 4"):
        validate_plan([("sb", AffinitySpec(pool="sandbox", count=5))], cluster)
    with pytest.raises(
        ConfigError, match=r"'a' .* and worker 'b' .* together need 20 GPU but pool 'H20' has 16"
    ):
        validate_plan(
            [
                ("a", AffinitySpec(pool="H20", num_gpus=4, count=3)),
                ("b", AffinitySpec(pool="H20", num_gpus=8)),
            ],
            cluster,
        )
    # the totals fit (18 of 20 GPUs) but the third 6-GPU replica finds no node with 6 free
    frag = ClusterView.from_node_table(
        [_row("n1", {"CPU": 8, "GPU": 8}), _row("n2", {"CPU": 8, "GPU": 8}), _row("n3", {"CPU": 8, "GPU": 4})]
    )
    with pytest.raises(
        ConfigError,
        match=r"worker 'frag': replica 2 needs \{CPU: 1, GPU: 6\} on one node, but no "
        r"node of pool 'cpu' has that free",
    ):
        validate_plan([("frag", AffinitySpec(num_gpus=6, count=3))], frag)


def test_pool_and_serverless_mismatches(cluster: ClusterView) -> None:
    with pytest.raises(
        ConfigError, match=r"needs pool 'B200', which the cluster does not have \(pools: .*H20"
    ):
        validate_plan([("x", AffinitySpec(pool="B200"))], cluster)
    with pytest.raises(ConfigError, match=r"worker 'r' is a serverless worker but pool 'env'"):
        validate_plan([("r", AffinitySpec(pool="env", serverless=True))], cluster)
    with pytest.raises(
        ConfigError,
        match=r"worker 'e' is a placed worker but pool 'reward-fn' is reward-fn "
        r"\(serverless",
    ):
        validate_plan([("e", AffinitySpec(pool="reward-fn"))], cluster)
    with pytest.raises(ConfigError, match=r"colocated with 'ghost', which is not in the plan"):
        validate_plan([("e", AffinitySpec(colocate_with="ghost"))], cluster)
    with pytest.raises(ConfigError, match="unique"):
        validate_plan([("e", AffinitySpec()), ("e", AffinitySpec())], cluster)


def test_colocated_workers_must_share_a_node() -> None:
    view = ClusterView.from_node_table([_row("a", {"CPU": 4}), _row("b", {"CPU": 4})])
    ok = validate_plan(
        [("env", AffinitySpec(num_cpus=2)), ("side", AffinitySpec(num_cpus=2, colocate_with="env"))], view
    )
    assert ok["env"] == ok["side"]
    with pytest.raises(ConfigError, match=r"worker 'env' \+ worker 'side': replica 0 needs \{CPU: 5\}"):
        validate_plan(
            [("env", AffinitySpec(num_cpus=3)), ("side", AffinitySpec(num_cpus=2, colocate_with="env"))], view
        )


def test_affinity_labels_and_serverless_rules() -> None:
    @affinity(pool="env", labels={"zone": "a"})
    class EnvWorker:
        pass

    spec = get_affinity(EnvWorker)
    assert spec.labels == (("zone", "a"),) and ray_actor_options(spec)["label_selector"] == {"zone": "a"}
    assert get_affinity(EnvWorker, labels={"zone": "b"}).label_selector == {"zone": "b"}
    with pytest.raises(ConfigError, match="serverless"):
        affinity(serverless=True, num_gpus=1)


def test_task_affinity_and_routes(cluster: ClusterView) -> None:
    pd = TaskAffinity(prefill_engine_group="prefill", decode_engine_group="decode")
    assert pd.disaggregated and pd.engine_groups() == ["prefill", "decode"]
    with pytest.raises(ValidationError, match="go together"):
        TaskAffinity(prefill_engine_group="prefill")
    with pytest.raises(ValidationError, match="not both"):
        TaskAffinity(engine_group="gen", prefill_engine_group="p", decode_engine_group="d")
    with pytest.raises(ValidationError, match="extra"):
        ResourcePlanConfig.model_validate({"tasks": {}, "bogus": 1})
    rm = ResourceManager(cluster)
    assert rm.task_routes(
        {"swe": pd, "math": TaskAffinity(engine_group="gen")}, ["prefill", "decode", "gen"]
    ) == {"swe": "decode", "math": "gen"}
    with pytest.raises(ConfigError, match=r"task 'swe': 'decode' is not an engine group"):
        rm.task_routes({"swe": pd}, ["prefill"])
    for old, new in [
        ("generation_pool", "engine_group"),
        ("prefill_pool", "prefill_engine_group"),
        ("decode_pool", "decode_engine_group"),
    ]:
        with pytest.raises(ValidationError, match=f"'{old}' was renamed: write '{new}' instead"):
            ResourcePlanConfig.model_validate({"tasks": {"swe": {old: "g"}}})


def test_resource_plane_and_planner_import_without_ray() -> None:
    import json
    import subprocess
    import sys

    code = (
        "import rollart_core.resources, rollart_core.plan.planner, rollart_core.plan.cli, rollart_core.plan.simulate, sys, json;"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {'ray', 'torch', 'vllm'})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
