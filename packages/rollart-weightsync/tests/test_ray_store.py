"""RayWeightStore on a real local Ray cluster (127.0.0.1)."""

from __future__ import annotations

import pickle
from collections.abc import Iterator

import pytest
import torch

from rollart_core.errors import WeightSyncError

pytestmark = pytest.mark.ray
TIMEOUT = 60


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    from rollart_core.config import RayConfig
    from rollart_core.resources import RayCluster

    with RayCluster(RayConfig(num_cpus=2)):
        yield


def test_ray_store_round_trip_retention_and_workers(ray_cluster: None) -> None:
    import ray

    from rollart_weightsync import RayWeightStore

    st = RayWeightStore(name="ws-test", bucket_bytes=16 << 10, keep_last=2)
    sd = {"a": torch.randn(100, 70), "b": torch.randn(9).bfloat16(), "i": torch.arange(3)}
    with pytest.raises(WeightSyncError, match="not committed"):
        st.pull(1)
    st.push(1, sd).result(TIMEOUT)
    got = st.pull(1)
    for k in sd:
        assert torch.equal(got[k], sd[k]) and got[k].dtype == sd[k].dtype
    into = {"a": torch.zeros(100, 70)}
    assert st.pull(1, into=into)["a"] is into["a"] and torch.equal(into["a"], sd["a"])

    @ray.remote(num_cpus=0)
    def pull_in_worker(store: RayWeightStore, version: int) -> float:
        return float(store.pull(version)["a"].sum())

    assert ray.get(pull_in_worker.remote(pickle.loads(pickle.dumps(st)), 1)) == pytest.approx(
        float(sd["a"].sum())
    )
    for v in (2, 3):
        st.push(v, {k: t + v if t.is_floating_point() else t for k, t in sd.items()})
    assert st.wait_for(3, TIMEOUT) == 3
    st.close()
    assert st.committed_versions() == [2, 3]
    with pytest.raises(WeightSyncError, match="not committed"):
        st.pull(1)
    assert torch.equal(st.pull(3)["a"], sd["a"] + 3)
