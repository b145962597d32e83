"""RayTrainerGroup on a real local Ray (127.0.0.1, custom resource H800: 2), real gloo, the tiny model."""

from __future__ import annotations

import gc
import logging
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from rollart_core.errors import ConfigError, TrainerError
from rollart_core.resources import LOOPBACK_ENV
from rollart_core.types import Trajectory, Turn
from rollart_train import RayTrainerGroup, RayTrainerGroupConfig, TorchTrainer, TorchTrainerConfig
from rollart_train.tiny import create_tiny_model

pytestmark = pytest.mark.ray
CFG = {"lr": 1e-3, "micro_batch_tokens": 48, "num_threads": 1}
POOL = "H800"


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    for k, v in LOOPBACK_ENV.items():
        os.environ.setdefault(k, v)
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(
            num_cpus=4,
            resources={POOL: 2},
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            log_to_driver=False,
        )
    yield
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_tiny_model(tmp_path_factory.mktemp("tiny-ray-group") / "m")


def make_batch(logprobs: Callable[[list[int]], list[float]] | None = None) -> list[Trajectory]:
    """Eight trajectories of different lengths in two groups; behaviour logprobs are the trainer's own
    (``logprobs``) or a constant, slightly perturbed either way."""
    g = torch.Generator().manual_seed(11)
    out = []
    for i in range(8):
        ctx = torch.randint(3, 400, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
        gen = torch.randint(3, 400, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist()
        lps = logprobs(ctx + gen)[-len(gen) :] if logprobs else [-6.0] * len(gen)
        turn = Turn(
            context_ids=ctx,
            output_ids=gen,
            output_logprobs=[x - 0.05 * (k % 3) for k, x in enumerate(lps)],
            output_versions=[0] * len(gen),
        )
        out.append(
            Trajectory(
                traj_id=f"t{i}",
                task="t",
                env_id="e",
                group_id=f"g{i % 2}",
                seed=i,
                start_version=0,
                turns=[turn],
                reward=float((i * 7) % 5),
            )
        )
    return out


def group_config(**kw: object) -> RayTrainerGroupConfig:
    return RayTrainerGroupConfig(**{"ranks": 2, "pool": POOL, "options": CFG, "call_timeout_s": 120, **kw})


def wait_until(condition: Callable[[], bool], timeout: float = 30.0) -> bool:
    """Poll ``condition`` until it holds or ``timeout`` passes (Ray kills and removals are asynchronous)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def wait_gone(pids: list[int], timeout: float = 30.0) -> list[int]:
    """Pids still alive after ``timeout``."""
    wait_until(lambda: not any(_alive(p) for p in pids), timeout)
    return [p for p in pids if _alive(p)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def named_actors() -> set[str]:
    import ray

    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}


def live_placement_groups() -> set[str]:
    import ray

    return {pg_id for pg_id, row in ray.util.placement_group_table().items() if row["state"] != "REMOVED"}


def test_two_ranks_on_pool_match_in_process_trainer(ray_session: None, tiny_model: Path) -> None:
    import ray

    local = TorchTrainer(TorchTrainerConfig(**CFG), model_path=tiny_model)
    batch = make_batch(local.logprobs)
    before = {n: w.clone() for n, w in local.named_weights()}
    m1 = local.train_step(batch)
    after = {n: w.clone() for n, w in local.named_weights()}
    del local
    pgs_before = live_placement_groups()
    group = RayTrainerGroup(group_config(), model_path=tiny_model)
    try:
        h800 = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get(POOL)]
        assert group.node_ids == [h800[0]] * 2
        assert len(set(group.pids)) == 2 and os.getpid() not in group.pids
        assert {n for n in named_actors() if n.startswith("rollart-trainer-")} >= {
            f"{group._name}-g1-rank0",
            f"{group._name}-g1-rank1",
        }
        assert len(live_placement_groups() - pgs_before) == 1
        start = dict(group.named_weights())
        for n, w in start.items():  # full tensors gathered from the shards: the same initial model
            torch.testing.assert_close(w, before[n], rtol=0, atol=0, msg=n)
        m2 = group.train_step(batch)
        assert group.version == 1 and m2["version"] == 1.0
        for k in ("loss", "clip_frac", "approx_kl", "entropy", "train_tokens"):
            assert m2[k] == pytest.approx(m1[k], rel=1e-4, abs=1e-6), k
        got = dict(group.named_weights())
        assert group.weights_to_caller == 2
        assert max(float((after[n] - before[n]).abs().max()) for n in after) > 5e-4  # the step moved them
        for n, w in got.items():
            torch.testing.assert_close(w, after[n], rtol=0, atol=2e-5, msg=n)
    finally:
        pids = group.pids
        group.close()
        group.close()  # idempotent
    assert not wait_gone(pids)
    assert wait_until(lambda: live_placement_groups() == pgs_before)
    assert wait_until(lambda: not {n for n in named_actors() if n.startswith(group._name)})


def _tensors_in_process() -> list[torch.Tensor]:
    """Real CPU tensors this process holds (fake or symbolic ones other tests left behind have no data)."""
    from torch._subclasses.fake_tensor import FakeTensor

    gc.collect()
    return [
        o
        for o in gc.get_objects()
        if isinstance(o, torch.Tensor)
        and not isinstance(o, FakeTensor)
        and o.device.type == "cpu"
        and all(type(d) is int for d in o.shape)
    ]


def test_push_from_rank0_commits_and_weights_never_reach_the_driver(
    ray_session: None, tiny_model: Path, tmp_path: Path
) -> None:
    from safetensors import safe_open

    from rollart_weightsync import FilesystemWeightStore

    with safe_open(str(tiny_model / "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    n_params = sum(torch.Size(s).numel() for s in shapes.values())
    embed = shapes["model.embed_tokens.weight"]
    store = FilesystemWeightStore(root=tmp_path / "weights")
    with RayTrainerGroup(group_config(), model_path=tiny_model, weight_store=store) as group:
        batch = make_batch(group.logprobs)
        group.train_step(batch)
        metrics = group.push_weights(group.version)
        assert store.latest_version() == 1
        assert metrics["push_s"] > 0 and metrics["push_bytes"] >= 4 * (n_params - embed[0] * embed[1])
        held = _tensors_in_process()
        assert not [t for t in held if tuple(t.shape) == embed]
        assert sum(t.numel() for t in held) < n_params // 20
        assert group.weights_to_caller == 0
        pulled = store.pull(1)
        assert [t for t in _tensors_in_process() if tuple(t.shape) == embed]  # the scan sees weights it holds
        weights = dict(group.named_weights())
        assert group.weights_to_caller == 1
    assert set(pulled) == set(weights)
    for n, w in weights.items():
        assert torch.equal(pulled[n], w), n


def test_killed_rank_restarts_from_newest_checkpoint(
    ray_session: None, tiny_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ckpts = tmp_path / "ckpt"
    cfg = group_config(max_restarts=1, checkpoint_dir=str(ckpts))
    with RayTrainerGroup(cfg, model_path=tiny_model) as group:
        batch = make_batch(group.logprobs)
        assert group.train_step(batch)["version"] == 1.0
        group.save(ckpts / "checkpoint-1")
        assert group.train_step(batch)["version"] == 2.0
        old = group.pids
        os.kill(old[1], signal.SIGKILL)
        with caplog.at_level(logging.WARNING, logger="rollart_train.ray_group"):
            metrics = group.train_step(batch)
        assert metrics["trainer_restarts"] == 1.0 and group.restarts == 1
        assert metrics["restored_version"] == 1.0 and metrics["lost_steps"] == 1.0
        assert metrics["restart_s"] > 0
        assert metrics["version"] == 3.0 and group.version == 3  # rebased: monotone
        assert (
            metrics["optimizer_steps"] == 2.0
        )  # checkpoint-1's one step + this one: weights from checkpoint-1
        assert metrics["token_lag_mean"] == 2.0  # the ranks themselves continue at version 2 (tokens are v0)
        assert not set(group.pids) & set(old)
        assert not wait_gone(old)
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any("rank 1" in w and "restart 1 of 1" in w and "1 step(s) lost" in w for w in warnings), (
            warnings
        )
        again = group.train_step(batch)
        assert again["version"] == 4.0 and "trainer_restarts" not in again


def test_killed_rank_without_restart_budget_raises(ray_session: None, tiny_model: Path) -> None:
    with RayTrainerGroup(group_config(max_restarts=0), model_path=tiny_model) as group:
        pids = group.pids
        empty = [
            Trajectory(
                traj_id=f"e{i}",
                task="t",
                env_id="e",
                group_id="g",
                seed=i,
                start_version=0,
                turns=[Turn(context_ids=[5, 6, 7])],
                reward=float(i),
            )
            for i in range(2)
        ]
        with pytest.raises(TrainerError, match="no generated tokens"):  # raised by every rank: not a failure
            group.train_step(empty)
        assert group.pids == pids and group.version == 0
        node = group.node_ids[1]
        os.kill(group.pids[1], signal.SIGKILL)
        with pytest.raises(TrainerError, match=rf"trainer rank 1 on node {node} .*restart budget is spent"):
            group.train_step(make_batch())
        assert group.restarts == 0


def test_unplaceable_pools_fail_before_any_rank_starts(ray_session: None, tiny_model: Path) -> None:
    import ray

    from rollart_core.resources import ClusterView

    actors, pgs = named_actors(), set(ray.util.placement_group_table())
    with pytest.raises(
        ConfigError, match=r"1 rank\(s\) on pool 'A100'.*which the cluster does not have.*H800"
    ):
        RayTrainerGroup(group_config(ranks=1, pool="A100"), model_path=tiny_model)
    with pytest.raises(ConfigError, match=r"3 rank\(s\) on pool 'H800'.*needs 3 H800 but the cluster has 2"):
        RayTrainerGroup(group_config(ranks=3), model_path=tiny_model)
    assert named_actors() == actors
    assert set(ray.util.placement_group_table()) == pgs
    cluster = ClusterView.from_ray()
    with pytest.raises(ConfigError, match=r"3 rank\(s\) on pool 'H800'"):
        RayTrainerGroup.validate(group_config(ranks=3), cluster)
    assert len(RayTrainerGroup.validate(group_config(), cluster)) == 2


def test_config_refuses_world_size_and_spawn(tiny_model: Path) -> None:
    with pytest.raises(ConfigError, match=r"world_size \(3\) conflicts with ranks \(2\)"):
        RayTrainerGroup({"ranks": 2, "options": {"world_size": 3}}, model_path=tiny_model)
    with pytest.raises(ConfigError, match="spawn does not apply"):
        RayTrainerGroup({"options": {"spawn": True}}, model_path=tiny_model)
    with pytest.raises(ValueError, match=r"options \(TorchTrainerConfig\): lr"):
        RayTrainerGroupConfig(options={"lr": -1})
    assert group_config().rank_config().world_size == 2
