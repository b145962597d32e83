"""The ``node_cache`` weight store: engines of one node pull a version once from the wrapped store and
share it; a damaged cached copy is never handed out; a failed or stuck leader never blocks the rest."""

from __future__ import annotations

import fcntl
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from rollart_core.errors import WeightSyncError
from rollart_core.registry import build
from rollart_weightsync import NodeCacheWeightStore, NodeCacheWeightStoreConfig

TIMEOUT = 60


def weights(k: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(int(k))
    return {
        "w": torch.randn(64, 256, generator=g).to(torch.bfloat16),  # spans buckets of 16 KiB
        "b": torch.arange(3.0) + k,
        "step": torch.tensor([int(k)], dtype=torch.int64),
    }


def options(tmp_path: Path, inner: dict[str, object] | None = None, **extra: object) -> dict[str, object]:
    return {
        "store": inner or {"impl": "filesystem", "options": {"root": str(tmp_path / "w")}},
        "cache_dir": str(tmp_path / "shm"),
        "bucket_mb": 1,
        **extra,
    }


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


CHILD = """
import json, pickle, sys
import torch
store = pickle.load(open(sys.argv[1], "rb"))
got = store.pull(int(sys.argv[2]))
digest = {k: [str(t.dtype), t.float().sum().item()] for k, t in got.items()}
print(json.dumps({"stats": store.stats, "digest": digest}))
"""


def test_four_engines_pull_once_from_the_wrapped_store(tmp_path: Path) -> None:
    store = build("weight_store", "node_cache", options(tmp_path), "weight_store.options")
    assert isinstance(store, NodeCacheWeightStore)
    store.push(1, weights(1.0)).result(TIMEOUT)
    blob = tmp_path / "store.pkl"
    blob.write_bytes(pickle.dumps(store))  # as the pipeline hands the store to engine actors
    procs = [
        subprocess.Popen([sys.executable, "-c", CHILD, str(blob), "1"], stdout=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    outs = [json.loads(p.communicate(timeout=TIMEOUT)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    want = {k: [str(t.dtype), t.float().sum().item()] for k, t in weights(1.0).items()}
    assert all(o["digest"] == want for o in outs)
    assert sum(o["stats"]["inner_pulls"] for o in outs) == 1  # the node's one pull
    assert sum(o["stats"]["cache_hits"] for o in outs) == 3
    assert same(store.pull(1), weights(1.0)) and store.stats["cache_hits"] == 1
    # an engine's copy that closes while another process uses the cache leaves it; the builder removes it
    close = "import pickle, sys; s = pickle.load(open(sys.argv[1], 'rb')); s.close(); print(s.dir.is_dir())"
    assert (
        subprocess.run([sys.executable, "-c", close, str(blob)], capture_output=True, text=True).stdout
        == "True\n"
    )
    store.close()
    assert not store.dir.exists()


@pytest.mark.parametrize("damage", ["flip", "truncate", "manifest"])
def test_a_damaged_cached_copy_is_dropped_and_pulled_again(tmp_path: Path, damage: str) -> None:
    store = NodeCacheWeightStore(NodeCacheWeightStoreConfig.model_validate(options(tmp_path)))
    store.push(2, weights(2.0)).result(TIMEOUT)
    assert same(store.pull(2), weights(2.0)) and store.stats["inner_pulls"] == 1
    data, meta, _ = store._paths(2)
    raw = bytearray(data.read_bytes())
    if damage == "flip":
        raw[len(raw) // 3] ^= 0x01
        data.write_bytes(bytes(raw))
    elif damage == "truncate":
        data.write_bytes(bytes(raw[: len(raw) // 2]))
    else:
        meta.write_text("{not json")
    into = {"w": torch.zeros(64, 256, dtype=torch.bfloat16)}
    got = store.pull(2, into=into)
    assert got["w"] is into["w"] and same(got, weights(2.0))
    assert store.stats == {"inner_pulls": 2, "cache_hits": 0, "cache_rejected": 1}
    assert same(store.pull(2), weights(2.0)) and store.stats["cache_hits"] == 1  # cached afresh
    store.close()


def test_a_failed_leader_leaves_the_pull_to_the_next_engine(tmp_path: Path) -> None:
    inner = {
        "impl": "faulty",
        "options": {
            "store": {"impl": "filesystem", "options": {"root": str(tmp_path / "w")}},
            "claim_dir": str(tmp_path / "claims"),
            "fail_pull": [3],
        },
    }
    store = NodeCacheWeightStore(NodeCacheWeightStoreConfig.model_validate(options(tmp_path, inner)))
    store.push(3, weights(3.0)).result(TIMEOUT)
    with pytest.raises(WeightSyncError, match="injected fault: the pull of version 3 failed"):
        store.pull(3)
    assert not store._paths(3)[1].exists()  # nothing cached, the lock released
    assert same(store.pull(3), weights(3.0)) and store.stats["inner_pulls"] == 1
    store.close()


def test_a_full_shared_memory_leaves_the_pull_to_each_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = NodeCacheWeightStore(NodeCacheWeightStoreConfig.model_validate(options(tmp_path)))
    store.push(1, weights(1.0)).result(TIMEOUT)

    def no_space(fd: int, offset: int, length: int) -> None:  # a fake: a full /dev/shm cannot be made here
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    assert same(store.pull(1), weights(1.0)) and same(store.pull(1), weights(1.0))
    assert store.stats["inner_pulls"] == 2 and list(store.dir.glob("v*")) == [store._paths(1)[2]]
    store.close()


def test_a_cache_dir_that_cannot_be_made_leaves_the_pull_to_the_engine(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    opts = {**options(tmp_path), "cache_dir": str(tmp_path / "file" / "shm")}
    store = NodeCacheWeightStore(NodeCacheWeightStoreConfig.model_validate(opts))
    store.push(1, weights(1.0)).result(TIMEOUT)
    into = {"b": torch.zeros(3)}
    got = store.pull(1, into=into)
    assert got["b"] is into["b"] and same(got, weights(1.0)) and store.stats["inner_pulls"] == 1
    store.close()


def test_waiting_for_another_engines_pull_is_bounded(tmp_path: Path) -> None:
    store = NodeCacheWeightStore(
        NodeCacheWeightStoreConfig.model_validate(options(tmp_path, lock_timeout_s=0.2))
    )
    store.push(1, weights(1.0)).result(TIMEOUT)
    store.dir.mkdir(parents=True)
    fd = os.open(store._paths(1)[2], os.O_CREAT | os.O_RDWR)  # another engine's pull in progress
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with pytest.raises(
            WeightSyncError, match=r"pull of version 1 held its lock for over lock_timeout_s=0.2"
        ):
            store.pull(1)
    finally:
        os.close(fd)
    assert same(store.pull(1), weights(1.0))
    store.close()


def test_stores_share_a_cache_only_by_key_and_keep_the_newest(tmp_path: Path) -> None:
    a = NodeCacheWeightStore(NodeCacheWeightStoreConfig.model_validate(options(tmp_path)))
    b = NodeCacheWeightStore(NodeCacheWeightStoreConfig.model_validate(options(tmp_path)))
    assert a.dir != b.dir  # two runs with the same version numbers never read each other's weights
    keyed = [
        NodeCacheWeightStore(
            NodeCacheWeightStoreConfig.model_validate(options(tmp_path, cache_key="run7", keep_last=2))
        )
        for _ in range(2)
    ]
    for v in (1, 2, 3):
        keyed[0].push(v, weights(float(v))).result(TIMEOUT)
        assert same(keyed[0].pull(v), weights(float(v)))
        assert same(keyed[1].pull(v), weights(float(v)))
    assert keyed[1].stats == {"inner_pulls": 0, "cache_hits": 3, "cache_rejected": 0}
    assert sorted(p.name for p in keyed[0].dir.glob("*.json")) == ["v0000000002.json", "v0000000003.json"]
    for s in (a, b, keyed[0]):
        s.close()
    assert keyed[0].dir.is_dir()  # keyed[1] still uses it
    keyed[1].close()
    assert not keyed[0].dir.exists()


def test_a_cache_left_by_a_dead_run_is_removed_by_the_next(tmp_path: Path) -> None:
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead, live = (
        tmp_path / "shm" / f"{int(child.stdout)}-0123456789ab",
        tmp_path / "shm" / f"{os.getpid()}-0a",
    )
    for d in (dead, live):
        d.mkdir(parents=True)
        (d / "v0000000001.bin").write_bytes(b"x" * 64)
    store = NodeCacheWeightStore(NodeCacheWeightStoreConfig.model_validate(options(tmp_path)))
    assert not dead.exists() and live.is_dir()  # a running builder's cache is left alone
    store.close()


def test_bad_configs_are_refused(tmp_path: Path) -> None:
    nested = options(tmp_path)
    nested["store"] = {"impl": "node_cache", "options": options(tmp_path)}
    with pytest.raises(ValidationError, match="cannot wrap another node_cache store"):
        NodeCacheWeightStoreConfig.model_validate(nested)
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        NodeCacheWeightStoreConfig.model_validate({**options(tmp_path), "cache": "/tmp"})
    with pytest.raises(ValidationError, match="greater than 0"):
        NodeCacheWeightStoreConfig.model_validate(options(tmp_path, lock_timeout_s=0))
