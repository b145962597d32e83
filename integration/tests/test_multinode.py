"""A real three-node Ray cluster on this machine (``ray start`` head + two workers, each its own
raylet with its own resources): an ``H800`` node, an ``H20`` node and a CPU-only ``env`` node
(node label ``rollart.io/pool=env``). Decorated workers are placed by the resource plane and must
land on their pool's node; plan validation names the worker and the missing resource; a task routed
to the H20 pool through the real LLMProxy is served only by the H20 worker.

The nodes use a private ``--temp-dir`` and their own ports. Each is a ``ray start --block`` child of
the test; teardown ends exactly those processes and their recorded descendants, by PID (nothing
cluster-wide), and checks that none is left.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rollart_core.config import RayConfig
from rollart_core.errors import ConfigError
from rollart_core.resources import (
    LOOPBACK_ENV,
    AffinitySpec,
    ClusterView,
    WorkerDecl,
    affinity,
    get_affinity,
    place,
    validate_plan,
)
from rollart_core.types import GenerateOutput, GenerateRequest, SamplingParams

pytestmark = [pytest.mark.ray]

# The ``ray`` CLI (its console-script entry point), with one patch for worker nodes: under
# RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (our loopback setting) ``ray start --address`` refuses to join a
# cluster, and under =1 it rewrites 127.0.0.1 (head address and --node-ip-address) to the machine's
# public address. Keeping 127.0.0.1 as given keeps every node on loopback.
RAY_CLI = [
    sys.executable,
    "-c",
    "import sys, ray._private.services as s; s.resolve_ip_for_localhost = lambda h: h; "
    "from ray.scripts.scripts import main; sys.exit(main())",
]


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _descendants(pid: int) -> list[int]:
    """The process tree under ``pid`` (children first seen through /proc/<pid>/task/*/children)."""
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def _alive(pids: list[int]) -> list[int]:
    left = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
        except OSError:
            continue
        if state != "Z":
            left.append(pid)
    return left


class LocalCluster:
    """Head + worker nodes, each a ``ray start --block`` child of this process with its own
    resources and labels. Teardown ends exactly those processes and their descendants, by PID."""

    def __init__(self) -> None:
        self.temp_dir = tempfile.mkdtemp(prefix="rmn", dir="/tmp")  # short: Ray's socket paths have a limit
        niceness = str(RayConfig().worker_niceness)  # as RayCluster starts a local cluster's workers
        self.env = {**os.environ, **LOOPBACK_ENV, "RAY_worker_niceness": niceness}
        self.port = _free_ports(1)[0]
        self.address = f"127.0.0.1:{self.port}"
        self.nodes: list[subprocess.Popen[str]] = []

    def _start(self, *args: str, head: bool = False) -> None:
        agent, grpc, metrics, rt_env = _free_ports(4)
        cmd = [
            *RAY_CLI,
            "start",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--temp-dir={self.temp_dir}",
            "--disable-usage-stats",
            "--object-store-memory=80000000",
            f"--dashboard-agent-listen-port={agent}",
            f"--dashboard-agent-grpc-port={grpc}",
            f"--metrics-export-port={metrics}",
            f"--runtime-env-agent-port={rt_env}",
            *args,
        ]
        env = dict(self.env)
        if head:
            cmd += [
                "--head",
                f"--port={self.port}",
                "--include-dashboard=false",
                f"--ray-client-server-port={_free_ports(1)[0]}",
            ]  # head: loopback setting as is
        else:
            env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "1"
            cmd += [f"--address={self.address}"]
        log = open(Path(self.temp_dir) / f"node{len(self.nodes)}.log", "w+")
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        self.nodes.append(proc)
        deadline = time.monotonic() + 120
        while "Ray runtime started" not in Path(log.name).read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"ray start failed ({proc.returncode}): {Path(log.name).read_text()[-2000:]}"
                )
            time.sleep(0.2)

    def start(self) -> None:
        self._start("--num-cpus=1", '--resources={"H800": 1}', head=True)
        self._start("--num-cpus=1", '--resources={"H20": 1}')
        self._start("--num-cpus=2", "--labels=rollart.io/pool=env", '--resources={"env_cpu": 8}')

    def stop(self, deadline_s: float = 20.0) -> list[int]:
        """SIGTERM each node's ``ray start --block`` (it stops what it started), workers before the
        head; then SIGKILL whatever of their recorded process trees is still alive. Returns leftovers."""
        tree = [pid for proc in self.nodes for pid in (proc.pid, *_descendants(proc.pid))]
        for proc in reversed(self.nodes):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        end = time.monotonic() + deadline_s
        while time.monotonic() < end and _alive(tree):
            time.sleep(0.2)
        for pid in _alive(tree):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for proc in self.nodes:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        end = time.monotonic() + 5
        while time.monotonic() < end and _alive(tree):
            time.sleep(0.2)
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        return _alive(tree)


_ADDRESS: list[str] = []


def cluster_address() -> str:
    return _ADDRESS[0]


@pytest.fixture(scope="module")
def cluster() -> Iterator[ClusterView]:
    c = LocalCluster()
    _ADDRESS[:] = [c.address]
    try:
        with pytest.MonkeyPatch.context() as mp:
            for k, v in LOOPBACK_ENV.items():
                mp.setenv(k, v)
            import ray
            import ray._private.ray_constants as ray_constants
            import ray._private.services as services

            if ray.is_initialized():
                pytest.fail(
                    "a Ray session is already open in this process; this module needs its own cluster"
                )
            # read at Ray's import, which may predate this fixture: workers must not be run by `uv run`
            mp.setattr(ray_constants, "RAY_ENABLE_UV_RUN_RUNTIME_ENV", False)
            # the driver, too, must keep 127.0.0.1 as given (see RAY_CLI)
            mp.setattr(services, "resolve_ip_for_localhost", lambda host: host)
            c.start()
            # the worker classes live in this test module, which Ray's workers cannot import: ship them by value
            ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
            ray.init(address=c.address, _node_ip_address="127.0.0.1", log_to_driver=True)
            deadline = time.monotonic() + 60
            while len([n for n in ray.nodes() if n["Alive"]]) < 3:
                if time.monotonic() > deadline:
                    pytest.fail(f"only {ray.nodes()} joined")
                time.sleep(0.2)
            view = ClusterView.from_ray()
            if any(n.address != "127.0.0.1" for n in view.nodes):
                pytest.fail(f"a node left loopback: {[n.address for n in view.nodes]}")
            yield view
    finally:
        import ray

        ray.shutdown()
        left = c.stop()
    assert not left, f"processes of our Ray nodes still alive: {left}"


@affinity(pool="H800", num_cpus=0.25)
class PrefillWorker:
    def node(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()


@affinity(pool="H20", num_cpus=0.25)
class DecodeWorker(PrefillWorker):
    pass


@affinity(pool="env", num_cpus=0.5, count=2, labels={"rollart.io/pool": "env"})
class EnvWorker(PrefillWorker):
    pass


@affinity(pool="env", num_cpus=0.25)
class RewardSidecar(PrefillWorker):
    """Colocated with the env workers (same node)."""


class NodeEchoEngine:
    """Stand-in for an inference engine (this test is about placement, not generation): answers
    every request with one token and names the node it runs on as its worker."""

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        import ray

        return GenerateOutput(
            request.request_id, [7], [-0.1], [0], "length", worker=ray.get_runtime_context().get_node_id()
        )

    async def abort(self, request_id: str) -> None:
        return None

    async def weight_version(self) -> int:
        return 0

    def node(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()


def _get(refs: list[Any], timeout: float = 120) -> list[Any]:
    import ray
    from ray.exceptions import GetTimeoutError

    try:
        return ray.get(refs, timeout=timeout)
    except GetTimeoutError:
        from ray.util.state import list_actors

        pytest.fail(
            f"actors not ready after {timeout}s: {[(a.class_name, a.state, a.node_id) for a in list_actors()]}"
        )


def _node_of_pool(cluster: ClusterView, pool: str) -> str:
    nodes = cluster.pools[pool].nodes
    assert len(nodes) == 1, cluster.describe()
    return nodes[0].node_id


def test_pools_are_read_from_the_cluster(cluster: ClusterView) -> None:
    assert {"H800", "H20", "env", "cpu"} <= set(cluster.pools)
    assert cluster.pools["H800"].kind == "resource" and cluster.pools["env"].kind == "label"
    assert len({_node_of_pool(cluster, p) for p in ("H800", "H20", "env")}) == 3
    assert len(cluster.pools["cpu"].nodes) == 3


def test_workers_land_on_their_pool_nodes(cluster: ClusterView) -> None:
    import ray

    plan = [
        WorkerDecl("prefill", get_affinity(PrefillWorker), "engine group"),
        WorkerDecl("decode", get_affinity(DecodeWorker), "engine group"),
        WorkerDecl("env", get_affinity(EnvWorker), "env workers"),
        WorkerDecl("reward", get_affinity(RewardSidecar, colocate_with="env"), "reward sidecar"),
    ]
    classes = {"prefill": PrefillWorker, "decode": DecodeWorker, "env": EnvWorker, "reward": RewardSidecar}
    with place(plan, cluster, timeout_s=60) as placement:
        actors = {
            (w.name, i): ray.remote(classes[w.name]).options(**placement.actor_options(w.name, i)).remote()
            for w in plan
            for i in range(w.spec.count)
        }
        nodes = dict(zip(actors, _get([a.node.remote() for a in actors.values()]), strict=True))
        for a in actors.values():
            ray.kill(a)
    assert nodes[("prefill", 0)] == _node_of_pool(cluster, "H800")
    assert nodes[("decode", 0)] == _node_of_pool(cluster, "H20")
    env_node = _node_of_pool(cluster, "env")
    assert nodes[("env", 0)] == nodes[("env", 1)] == nodes[("reward", 0)] == env_node


def test_plan_validation_names_worker_and_resource(cluster: ClusterView) -> None:
    gen = WorkerDecl("gen", AffinitySpec(pool="H800", num_cpus=1, count=2), "engine group")
    with pytest.raises(
        ConfigError,
        match=r"engine group 'gen' \(2 × \{CPU: 1, H800: 1\}\) needs 2 H800 but "
        r"the cluster has 1",
    ):
        validate_plan([gen], cluster)
    with pytest.raises(ConfigError, match=r"engine group 'big' .* needs 3 CPU but pool 'env' has 2"):
        validate_plan([WorkerDecl("big", AffinitySpec(pool="env", num_cpus=3), "engine group")], cluster)
    with pytest.raises(ConfigError, match=r"worker 'x' needs pool 'A100', which the cluster does not have"):
        validate_plan([("x", AffinitySpec(pool="A100"))], cluster)
    with pytest.raises(ConfigError, match=r"needs 1 GPU but the cluster has 0"):
        validate_plan([("g", AffinitySpec(num_gpus=1))], cluster)
    with pytest.raises(
        ConfigError,
        match=r"worker 'e' \(2 × \{CPU: 1\}\) and worker 'r' \(1 × \{CPU: 0.5\}\) "
        r"together need 2.5 CPU but pool 'env' has 2",
    ):
        validate_plan(
            [
                ("e", AffinitySpec(pool="env", num_cpus=1, count=2)),
                ("r", AffinitySpec(pool="env", num_cpus=0.5, colocate_with="e")),
            ],
            cluster,
        )
    # the totals fit (3 of 4 CPUs) but no node has 1.5 CPUs left for the second replica
    with pytest.raises(
        ConfigError,
        match=r"env workers 'w': replica 1 needs \{CPU: 1.5\} on one node, but no node "
        r"of pool 'cpu' has that free",
    ):
        validate_plan([WorkerDecl("w", AffinitySpec(num_cpus=1.5, count=2), "env workers")], cluster)


async def test_task_routed_to_h20_is_served_only_by_h20(cluster: ClusterView) -> None:
    import ray

    from rollart_proxy import LLMProxy

    plan = [
        WorkerDecl("h800-0", get_affinity(PrefillWorker)),
        WorkerDecl("h20-0", get_affinity(DecodeWorker)),
    ]
    with place(plan, cluster, timeout_s=60) as placement:
        engines = {
            w.name: ray.remote(NodeEchoEngine)
            .options(**placement.actor_options(w.name), max_concurrency=64)
            .remote()
            for w in plan
        }
        try:
            proxy = LLMProxy.from_ray_actors(
                [("h800-0", engines["h800-0"], "H800"), ("h20-0", engines["h20-0"], "H20")],
                task_pools={"decode_heavy": "H20", "prefill_heavy": "H800"},
            )
            sp = SamplingParams(max_tokens=1)
            outs = await asyncio.gather(
                *(
                    proxy.generate(
                        GenerateRequest(
                            f"r{i}", [1, 2, 3], sp, f"s{i}", "decode_heavy" if i % 2 else "prefill_heavy"
                        )
                    )
                    for i in range(24)
                )
            )
        finally:
            for e in engines.values():
                ray.kill(e)
    h20, h800 = _node_of_pool(cluster, "H20"), _node_of_pool(cluster, "H800")
    served = [(o.request_id, o.worker) for o in outs]
    decode_nodes = {w for rid, w in served if int(rid[1:]) % 2}
    prefill_nodes = {w for rid, w in served if not int(rid[1:]) % 2}
    assert decode_nodes == {h20}, json.dumps(served)
    assert prefill_nodes == {h800}


async def test_async_training_run_places_every_stage_on_its_node(
    cluster: ClusterView, tiny_model: Path, tmp_path: Path
) -> None:
    """The whole pipeline across the three nodes: the trainer's rank on H800, the engine on H20,
    the environment workers and the reward runtime on the CPU node, weights through the Ray object
    store (every node reaches it). A local filesystem store is refused on this cluster."""
    import ray._private.state as ray_state  # the GCS's actor table (this cluster runs no dashboard)

    from rollart_core.config import RunConfig
    from rollart_core.control.pipeline import Pipeline
    from rollart_core.control.train import train
    from rollart_core.metrics import MemorySink

    from .conftest import slice_config

    data = slice_config(tmp_path, model_path=tiny_model, steps=3).model_dump(mode="json")
    data["engines"][0].update(pool="H20", num_cpus=0.25)
    data["trainer"] = {
        "impl": "torch",
        "ranks": 1,
        "pool": "H800",
        "num_cpus": 0.5,
        "options": {"lr": 0.01, "num_threads": 1},
    }
    data["tasks"][0]["reward_executor"] = {
        "impl": "serverless",
        "options": {
            "pool": "env_cpu",
            "num_cpus": 0.25,
            "http": {"fallback": "none"},
            "runtime": {"max_workers": 1},
        },
    }
    data["env_manager"] = {"num_envs": 4, "options": {"pool": "env_cpu", "envs_per_actor": 2}}
    data["loop"] = {"mode": "async", "alpha": 1, "steps": 3}
    data["ray"] = {"address": cluster_address()}

    local = RunConfig.model_validate(data)  # the default filesystem store: a local directory
    with pytest.raises(ConfigError, match=r"filesystem .* local directory, but the cluster has 3 nodes"):
        async with Pipeline(local):
            pass
    wrapped = {"store": {"impl": "filesystem", "options": {"root": str(tmp_path / "w")}}}
    data["weight_store"] = {"impl": "node_cache", "options": wrapped}  # the wrapper does not hide it
    with pytest.raises(ConfigError, match=r"filesystem .* local directory, but the cluster has 3 nodes"):
        async with Pipeline(RunConfig.model_validate(data)):
            pass
    data["weight_store"] = {"impl": "ray", "options": {"name": f"mn-weights-{os.getpid()}"}}
    cfg = RunConfig.model_validate(data)
    async with Pipeline(cfg) as p:
        summary = await asyncio.wait_for(train(cfg, sink=MemorySink(), pipeline=p), 600)
        served = await p.proxy.weight_versions()
        trainer_nodes = set(p.trainer.node_ids)
        alive = [a for a in ray_state.actors().values() if a["State"] == "ALIVE"]
        # the runtime's counters read now: stats() holds the last periodic poll, which a short run can finish before
        runtime_stats = await p.rewards[cfg.tasks[0].name].astats()
    nodes_of = {}
    for a in alive:
        nodes_of.setdefault(a["ActorClassName"], set()).add(a["Address"]["NodeID"])
    assert trainer_nodes == {_node_of_pool(cluster, "H800")}
    assert nodes_of["VllmEngine"] == {_node_of_pool(cluster, "H20")}
    env_node = _node_of_pool(cluster, "env")
    assert nodes_of["EnvWorker"] == {env_node}
    assert nodes_of["RuntimeHost"] == {env_node}, nodes_of
    assert summary["steps"] == 3 and summary["final_version"] == 3
    assert set(served.values()) == {3}
    assert runtime_stats["runtime_calls"] > 0, runtime_stats
    assert summary["launched"] == sum(summary["fates"].values())
