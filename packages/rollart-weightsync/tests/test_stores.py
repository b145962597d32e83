"""Tests for the filesystem and in-memory weight stores."""

from __future__ import annotations

import json
import pickle
import threading
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

from rollart_core.errors import WeightSyncError
from rollart_weightsync import (
    FilesystemWeightStore,
    FilesystemWeightStoreConfig,
    MemoryWeightStore,
    MemoryWeightStoreConfig,
)

TIMEOUT = 30  # generous bound on waiting for a push future (only reached on a hang)


def make_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(6, 4, generator=g)
    return {
        "w.f32": torch.randn(3, 5, generator=g),
        "w.bf16": torch.randn(7, 3, generator=g).to(torch.bfloat16),
        "w.f16": torch.randn(4, generator=g).to(torch.float16),
        "w.t": base.t(),  # a non-contiguous transposed view
        "w.slice": torch.randn(8, 8, generator=g)[::2, 1::3],  # non-contiguous strided view
        "ids": torch.randint(0, 1000, (5,), generator=g, dtype=torch.int64),
        "scalar": torch.tensor(3.5),
    }


def clone_all(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in tensors.items()}


def assert_same(pulled: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert set(pulled) == set(expected)
    for k, v in expected.items():
        p = pulled[k]
        assert p.dtype == v.dtype, k
        assert p.shape == v.shape, k
        assert p.device.type == "cpu", k
        assert torch.equal(p, v), k
        # bit-identical (torch.equal would accept -0.0 == 0.0)
        assert torch.equal(
            p.reshape(-1).contiguous().view(torch.uint8), v.reshape(-1).contiguous().view(torch.uint8)
        ), k


@pytest.fixture(params=["filesystem", "memory"])
def store_factory(request, tmp_path):
    made = []

    def make(keep_last: int = 2):
        if request.param == "filesystem":
            s = FilesystemWeightStore(FilesystemWeightStoreConfig(root=tmp_path / "w", keep_last=keep_last))
        else:
            s = MemoryWeightStore(MemoryWeightStoreConfig(keep_last=keep_last))
        made.append(s)
        return s

    make.kind = request.param
    yield make
    for s in made:
        s.close()


@pytest.fixture
def store(store_factory):
    return store_factory()


@pytest.fixture
def fs_store(tmp_path):
    s = FilesystemWeightStore(FilesystemWeightStoreConfig(root=tmp_path / "w", keep_last=2))
    yield s
    s.close()


# both stores ------------------------------------------------------------------------------------


def test_empty_store_has_no_version(store) -> None:
    assert store.latest_version() is None
    with pytest.raises(WeightSyncError):
        store.pull(0)


def test_push_returns_future_and_commits(store) -> None:
    tensors = make_tensors()
    fut = store.push(0, tensors)
    assert isinstance(fut, Future)
    assert fut.result(timeout=TIMEOUT) is None
    assert store.latest_version() == 0
    fut = store.push(1, make_tensors(1))
    fut.result(timeout=TIMEOUT)
    assert store.latest_version() == 1


def test_pull_is_bit_identical(store) -> None:
    tensors = make_tensors(3)
    expected = clone_all(tensors)
    store.push(5, tensors).result(timeout=TIMEOUT)
    assert_same(store.pull(5), expected)


def test_pull_preserves_special_float_values(store) -> None:
    t = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 1e-45, 3.4e38], dtype=torch.float32)
    b = t.to(torch.bfloat16)
    store.push(0, {"t": t, "b": b}).result(timeout=TIMEOUT)
    out = store.pull(0)
    for name, src in (("t", t), ("b", b)):
        assert out[name].dtype == src.dtype
        # compare raw bits so -0.0 vs 0.0 matters
        assert torch.equal(
            out[name].view(torch.int16 if src.dtype == torch.bfloat16 else torch.int32),
            src.view(torch.int16 if src.dtype == torch.bfloat16 else torch.int32),
        )


def test_snapshot_semantics_source_mutation_after_push(store) -> None:
    tensors = make_tensors(4)
    expected = clone_all(tensors)
    param = torch.nn.Parameter(torch.randn(4, 4))
    tensors["param"] = param
    expected["param"] = param.detach().clone()
    fut = store.push(0, tensors)
    # keep "training" while the push runs: mutate every source tensor in place
    with torch.no_grad():
        for v in tensors.values():
            if v.is_floating_point():
                v.add_(1.0)
            else:
                v.add_(1)
    fut.result(timeout=TIMEOUT)
    assert_same(store.pull(0), expected)


def test_push_does_not_alter_source(store) -> None:
    tensors = make_tensors(5)
    before = clone_all(tensors)
    strides = {k: v.stride() for k, v in tensors.items()}
    store.push(0, tensors).result(timeout=TIMEOUT)
    for k, v in tensors.items():
        assert torch.equal(v, before[k]) and v.stride() == strides[k]


def test_pull_uncommitted_version_raises(store) -> None:
    store.push(1, make_tensors()).result(timeout=TIMEOUT)
    with pytest.raises(WeightSyncError):
        store.pull(0)
    with pytest.raises(WeightSyncError):
        store.pull(2)


def test_pushes_commit_in_order(store) -> None:
    futs = [store.push(v, make_tensors(v)) for v in range(4)]
    for f in futs:
        f.result(timeout=TIMEOUT)
    assert store.latest_version() == 3
    assert_same(store.pull(3), clone_all(make_tensors(3)))


def test_retention_keep_last_two(store_factory) -> None:
    store = store_factory(keep_last=2)
    for v in range(5):
        store.push(v, make_tensors(v)).result(timeout=TIMEOUT)
    assert store.latest_version() == 4
    for v in range(3):
        with pytest.raises(WeightSyncError):
            store.pull(v)
    for v in (3, 4):
        assert_same(store.pull(v), clone_all(make_tensors(v)))


def test_retention_keep_last_one(store_factory) -> None:
    store = store_factory(keep_last=1)
    for v in range(3):
        store.push(v, make_tensors(v)).result(timeout=TIMEOUT)
    with pytest.raises(WeightSyncError):
        store.pull(1)
    assert_same(store.pull(2), clone_all(make_tensors(2)))


def test_wait_for_returns_when_another_thread_pushes(store) -> None:
    # The pushing thread starts only once wait_for has checked the store at least once, so the
    # wait genuinely blocks on a version that does not exist yet.
    polled = threading.Event()
    original_latest = store.latest_version

    def latest_spy():
        polled.set()
        return original_latest()

    store.latest_version = latest_spy
    errors: list[BaseException] = []

    def pusher() -> None:
        try:
            assert polled.wait(TIMEOUT)
            store.push(0, make_tensors(0)).result(timeout=TIMEOUT)
            store.push(3, make_tensors(3)).result(timeout=TIMEOUT)
        except BaseException as e:
            errors.append(e)

    th = threading.Thread(target=pusher)
    th.start()
    try:
        got = store.wait_for(3, timeout=TIMEOUT)
    finally:
        th.join(TIMEOUT)
    assert not errors
    assert got >= 3
    assert original_latest() == 3
    assert_same(store.pull(3), clone_all(make_tensors(3)))


def test_wait_for_already_committed_returns_latest(store) -> None:
    store.push(4, make_tensors()).result(timeout=TIMEOUT)
    assert store.wait_for(2, timeout=0.2) == 4


def test_wait_for_timeout_raises(store) -> None:
    store.push(0, make_tensors()).result(timeout=TIMEOUT)
    with pytest.raises(WeightSyncError):
        store.wait_for(1, timeout=0.2)


def test_wait_for_timeout_on_empty_store(store) -> None:
    with pytest.raises(WeightSyncError):
        store.wait_for(0, timeout=0.1)


# filesystem only ---------------------------------------------------------------------------------


def test_fs_layout_and_manifest(fs_store) -> None:
    fs_store.push(2, make_tensors()).result(timeout=TIMEOUT)
    d = fs_store.root / "v00000002"
    assert (d / "model.safetensors").is_file()
    manifest = json.loads((d / "COMMITTED").read_text())
    assert manifest["version"] == 2
    import hashlib

    assert manifest["sha256"] == hashlib.sha256((d / "model.safetensors").read_bytes()).hexdigest()
    # no temporary directories left behind
    assert [p.name for p in fs_store.root.iterdir() if p.name.startswith(".tmp")] == []


def test_fs_retention_removes_directories(fs_store) -> None:
    for v in range(4):
        fs_store.push(v, make_tensors(v)).result(timeout=TIMEOUT)
    assert sorted(p.name for p in fs_store.root.iterdir()) == ["v00000002", "v00000003"]


def test_fs_half_written_version_is_invisible(fs_store) -> None:
    fs_store.push(3, make_tensors(3)).result(timeout=TIMEOUT)
    root = fs_store.root
    # a version directory whose commit marker was never written ...
    partial = root / "v00000009"
    partial.mkdir()
    from safetensors.torch import save_file

    save_file({"x": torch.ones(3)}, str(partial / "model.safetensors"))
    # ... and a temporary directory of an in-flight write, complete with a marker
    tmp = root / ".tmp-v00000010-12345"
    tmp.mkdir()
    save_file({"x": torch.ones(3)}, str(tmp / "model.safetensors"))
    (tmp / "COMMITTED").write_text(json.dumps({"version": 10, "sha256": "0" * 64, "tensors": 1}))
    assert fs_store.latest_version() == 3
    with pytest.raises(WeightSyncError):
        fs_store.pull(9)
    with pytest.raises(WeightSyncError):
        fs_store.pull(10)
    with pytest.raises(WeightSyncError):
        fs_store.wait_for(9, timeout=0.1)
    # a fresh store over the same root sees the same thing
    other = FilesystemWeightStore(root=root)
    assert other.latest_version() == 3


def test_fs_corrupted_bytes_fail_checksum(fs_store) -> None:
    fs_store.push(1, make_tensors(1)).result(timeout=TIMEOUT)
    f = fs_store.root / "v00000001" / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF  # flip bits in the tensor data: still a loadable safetensors file
    f.write_bytes(bytes(data))
    with pytest.raises(WeightSyncError, match="checksum"):
        fs_store.pull(1)


def test_fs_truncated_file_fails_checksum(fs_store) -> None:
    fs_store.push(1, make_tensors(1)).result(timeout=TIMEOUT)
    f = fs_store.root / "v00000001" / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-8])
    with pytest.raises(WeightSyncError):
        fs_store.pull(1)


def test_fs_weights_file_removed_under_marker_raises_weightsync_error(fs_store) -> None:
    # What a puller sees when retention's rmtree has removed the weights but not yet the marker.
    fs_store.push(1, make_tensors(1)).result(timeout=TIMEOUT)
    (fs_store.root / "v00000001" / "model.safetensors").unlink()
    with pytest.raises(WeightSyncError):
        fs_store.pull(1)


def test_fs_repush_same_version_replaces_it(fs_store) -> None:
    fs_store.push(0, make_tensors(0)).result(timeout=TIMEOUT)
    fs_store.push(0, make_tensors(7)).result(timeout=TIMEOUT)
    assert fs_store.latest_version() == 0
    assert_same(fs_store.pull(0), clone_all(make_tensors(7)))


def test_fs_negative_version_rejected(fs_store) -> None:
    with pytest.raises(WeightSyncError):
        fs_store.push(-1, make_tensors())


def test_fs_store_pickles_and_copy_pulls(fs_store) -> None:
    tensors = make_tensors(11)
    expected = clone_all(tensors)
    fs_store.push(6, tensors).result(timeout=TIMEOUT)  # the original now owns a pusher thread
    copy = pickle.loads(pickle.dumps(fs_store))
    try:
        assert copy.root == fs_store.root
        assert copy.latest_version() == 6
        assert_same(copy.pull(6), expected)
        # and it keeps seeing what the original pushes later
        fs_store.push(7, make_tensors(12)).result(timeout=TIMEOUT)
        assert copy.wait_for(7, timeout=TIMEOUT) == 7
        assert_same(copy.pull(7), clone_all(make_tensors(12)))
        # the copy can push too, and the original sees it
        copy.push(8, make_tensors(13)).result(timeout=TIMEOUT)
        assert fs_store.latest_version() == 8
        assert_same(fs_store.pull(8), clone_all(make_tensors(13)))
    finally:
        copy.close()


def test_fs_root_from_keyword(tmp_path: Path) -> None:
    s = FilesystemWeightStore(root=tmp_path / "a" / "b")
    try:
        assert (tmp_path / "a" / "b").is_dir()
        s.push(0, {"x": torch.arange(4)}).result(timeout=TIMEOUT)
        assert torch.equal(s.pull(0)["x"], torch.arange(4))
    finally:
        s.close()
