"""MooncakeWeightStore against a real mooncake_master + holder over TCP on 127.0.0.1."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from rollart_core.errors import ConfigError, WeightSyncError
from rollart_core.registry import build
from rollart_weightsync import MooncakeServerConfig, MooncakeStoreServer, MooncakeWeightStore
from rollart_weightsync.mooncake import MooncakeWeightStoreConfig, _client, _resolve_protocol

TIMEOUT = 60


@pytest.fixture(scope="module", params=["tcp", "shm"])
def server(request: pytest.FixtureRequest) -> Iterator[MooncakeStoreServer]:
    """tcp: the holder is a Python client, stores reach it over TCP. shm: the holder is Mooncake's
    real client and stores join it as dummy clients through shared memory."""
    cfg = MooncakeServerConfig(segment_bytes=384 << 20, shared_memory=request.param == "shm")
    with MooncakeStoreServer(cfg) as s:
        yield s
    assert s.master is None and s.holder is None


_n = iter(range(10**6))


@pytest.fixture
def make(server: MooncakeStoreServer):
    stores: list[MooncakeWeightStore] = []

    def make_store(**options: object) -> MooncakeWeightStore:
        options.setdefault("prefix", f"t{os.getpid()}/{next(_n)}")
        st = MooncakeWeightStore(server.store_config(**options))
        stores.append(st)
        return st

    yield make_store
    for st in stores:
        st.close()


def model_state(seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    layer = torch.nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=256, batch_first=True)
    sd = {k: v.detach().clone() for k, v in layer.state_dict().items()}
    sd["embed.weight"] = torch.randn(3000, 64)  # larger than a bucket: spans several
    sd["negzero"] = torch.tensor([-0.0, 0.0, float("inf"), float("nan")])
    sd["ids"] = torch.arange(7, dtype=torch.int64)
    return sd


def assert_bits_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for k, w in want.items():
        g = got[k]
        assert g.dtype == w.dtype and g.shape == w.shape, k
        assert torch.equal(
            g.reshape(-1).contiguous().view(torch.uint8), w.reshape(-1).contiguous().view(torch.uint8)
        ), k


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_round_trip_bit_exact(make, dtype: str | None) -> None:
    st = make(bucket_bytes=64 << 10, dtype=dtype)
    sd = model_state()
    st.push(1, sd).result(TIMEOUT)
    want = {k: (v.bfloat16() if dtype and v.is_floating_point() else v) for k, v in sd.items()}
    assert st.latest_version() == 1
    assert_bits_equal(st.pull(1), want)


def test_pull_into_preallocated_tensors(make) -> None:
    st = make(bucket_bytes=64 << 10, batch_buckets=2)
    sd = model_state(1)
    st.push(3, sd).result(TIMEOUT)
    into = {
        "embed.weight": torch.zeros(3000, 64),
        "linear1.weight": torch.zeros(256, 64, dtype=torch.float64),
        "ids": torch.zeros(7, dtype=torch.int64),
    }
    out = st.pull(3, into=into)
    for k, t in into.items():
        assert out[k] is t
        assert torch.equal(t, sd[k].to(t.dtype))
    assert_bits_equal(
        {k: v for k, v in out.items() if k not in into}, {k: v for k, v in sd.items() if k not in into}
    )
    with pytest.raises(WeightSyncError, match="shape"):
        st.pull(3, into={"ids": torch.zeros(8, dtype=torch.int64)})
    with pytest.raises(WeightSyncError, match="does not have"):
        st.pull(3, into={"nope": torch.zeros(1)})


def test_push_snapshots_before_returning_and_a_failed_pack_fails_its_future(make) -> None:
    st = make(bucket_bytes=64 << 10, batch_buckets=1)
    sd = model_state(2)
    want = {k: v.clone() for k, v in sd.items()}
    fut = st.push(1, sd)  # buckets are being put while push packs the rest; it returns once all is copied
    for v in sd.values():
        v.zero_()
    fut.result(TIMEOUT)
    assert_bits_equal(st.pull(1), want)
    # a tensor that cannot be copied (meta device) fails push in the caller, and the commit that
    # was already waiting for its bytes fails instead of hanging or committing a partial version
    bad = {"a": torch.ones(1 << 16), "b": torch.empty(1 << 16, device="meta"), "c": torch.ones(4)}
    with pytest.raises(NotImplementedError):
        st.push(2, bad)
    assert st.latest_version() == 1
    st.push(3, want).result(TIMEOUT)  # the store carries on
    assert st.latest_version() == 3 and 2 not in st.committed_versions()
    assert_bits_equal(st.pull(3), want)


def test_concurrent_push_while_reader_pulls_older(make) -> None:
    st = make(bucket_bytes=256 << 10, keep_last=5)
    v1 = model_state(1)
    st.push(1, v1).result(TIMEOUT)
    reader = MooncakeWeightStore(st.config)  # a second store object, as another worker would hold
    errors: list[BaseException] = []
    pulls = 0
    stop = threading.Event()

    def read() -> None:
        nonlocal pulls
        try:
            while not stop.is_set():
                assert_bits_equal(reader.pull(1), v1)
                pulls += 1
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=read)
    t.start()
    futures = [st.push(v, model_state(v)) for v in (2, 3, 4)]
    for f in futures:
        f.result(TIMEOUT)
    stop.set()
    t.join(TIMEOUT)
    assert not errors, errors
    assert pulls >= 1
    assert st.latest_version() == 4
    assert_bits_equal(reader.pull(4), model_state(4))


_PUSHER = r"""
import json, sys, torch
from rollart_weightsync.mooncake import MooncakeWeightStore, MooncakeWeightStoreConfig
st = MooncakeWeightStore(MooncakeWeightStoreConfig.model_validate_json(sys.argv[1]))
g = torch.Generator().manual_seed(2)
st.push(2, {f"w{i}": torch.randn(1 << 20, generator=g) for i in range(48)}).result()
print("DONE", flush=True)
"""


def test_killed_pusher_leaves_no_torn_version(make) -> None:
    st = make(bucket_bytes=1 << 20, batch_buckets=1, keep_last=3)
    v1 = model_state(1)
    st.push(1, v1).result(TIMEOUT)
    c = _client(st.config)
    child = subprocess.Popen(
        [sys.executable, "-c", _PUSHER, st.config.model_dump_json()],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + TIMEOUT
        while c.is_exist(st.bucket_key(2, 2)) != 1:  # a few buckets of version 2 are in
            assert child.poll() is None, "pusher exited before it was killed"
            assert time.monotonic() < deadline
            time.sleep(0.005)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait(TIMEOUT)
        child.stdout.close()  # type: ignore[union-attr]
    assert c.is_exist(st.manifest_key(2)) != 1, "the pusher finished before it was killed"
    assert st.latest_version() == 1
    with pytest.raises(WeightSyncError, match="not committed"):
        st.pull(2)
    assert_bits_equal(st.pull(1), v1)
    # a new push of the same version overwrites the partial buckets and commits
    v2 = {f"w{i}": torch.full((1 << 16,), float(i)) for i in range(4)}
    st.push(2, v2).result(TIMEOUT)
    assert st.latest_version() == 2
    assert_bits_equal(st.pull(2), v2)


def test_uncommitted_version_raises_or_waits(make) -> None:
    st = make()
    with pytest.raises(WeightSyncError, match="not committed"):
        st.pull(7)
    assert st.latest_version() is None
    with pytest.raises(WeightSyncError, match="not committed within"):
        st.wait_for(7, timeout=0.2)
    fut = st.push(7, {"x": torch.ones(3)})
    assert st.wait_for(7, timeout=TIMEOUT) == 7
    fut.result(TIMEOUT)
    with pytest.raises(WeightSyncError, match="version must be"):
        st.push(-1, {"x": torch.ones(1)})


def test_checksum_mismatch_refetches_then_raises(make) -> None:
    st = make(bucket_bytes=64 << 10)
    sd = model_state(5)
    st.push(1, sd).result(TIMEOUT)
    c = _client(st.config)
    key = st.bucket_key(1, 1)
    size = c.get_size(key)
    assert size > 0
    assert c.upsert(key, b"\x01" * size) == 0  # same size, wrong bytes
    with pytest.raises(WeightSyncError, match="checksum mismatch"):
        st.pull(1)
    assert st.stats["refetches"] == 1


def test_retention_deletes_old_versions(make) -> None:
    st = make(bucket_bytes=64 << 10, keep_last=2)
    for v in range(1, 5):
        st.push(v, model_state(v))
    st.wait_for(4, TIMEOUT)
    st.close()  # all pushes done
    assert st.committed_versions() == [3, 4]
    c = _client(st.config)
    for v in (1, 2):
        with pytest.raises(WeightSyncError, match="not committed"):
            st.pull(v)
        assert c.is_exist(st.bucket_key(v, 0)) != 1
    assert c.is_exist(st.bucket_key(3, 0)) == 1
    assert_bits_equal(st.pull(3), model_state(3))


def test_slow_subscriber_skips_to_newest(make) -> None:
    st = make(poll_s=0.01)
    got: list[int] = []
    first = threading.Event()
    release = threading.Event()
    newest = threading.Event()

    def on_version(v: int) -> None:
        got.append(v)
        if len(got) == 1:
            first.set()
            assert release.wait(TIMEOUT)
        if v == 5:
            newest.set()

    unsubscribe = st.subscribe(on_version)
    st.push(1, {"x": torch.zeros(2)})
    assert first.wait(TIMEOUT)
    for v in range(2, 6):
        st.push(v, {"x": torch.full((2,), float(v))}).result(TIMEOUT)
    release.set()
    assert newest.wait(TIMEOUT)
    unsubscribe()
    assert got == [1, 5]
    assert st.latest_version() == 5  # a receiver that fell behind pulls the newest
    assert torch.equal(st.pull(st.latest_version())["x"], torch.full((2,), 5.0))


def test_picklable_and_registered(make, server: MooncakeStoreServer) -> None:
    st = make()
    st.push(1, {"x": torch.arange(4.0)}).result(TIMEOUT)
    copy = pickle.loads(pickle.dumps(st))
    assert torch.equal(copy.pull(1)["x"], torch.arange(4.0))
    built = build(
        "weight_store", "mooncake", {"master": server.master_address, "prefix": st.config.prefix}, "ws"
    )
    assert isinstance(built, MooncakeWeightStore) and built.latest_version() == 1
    with pytest.raises(ConfigError, match="bucket_bytes"):
        build("weight_store", "mooncake", {"master": server.master_address, "bucket_bytes": 1}, "ws")
    with pytest.raises(ConfigError, match="Extra inputs"):
        build("weight_store", "mooncake", {"master": server.master_address, "nope": 1}, "ws")


def test_shared_memory_segments_are_reused() -> None:
    from rollart_weightsync.mooncake import _SHM

    with MooncakeStoreServer(MooncakeServerConfig(segment_bytes=64 << 20, shared_memory=True)) as srv:
        st = MooncakeWeightStore(srv.store_config(bucket_bytes=64 << 10, batch_buckets=2, keep_last=1))
        shm = _SHM[id(_client(st.config))]
        sd = model_state(3)
        into = {"embed.weight": torch.zeros(3000, 64)}
        for v in range(1, 4):
            st.push(v, sd).result(TIMEOUT)
            assert_bits_equal(st.pull(v), sd)  # pulled tensors view a segment; dropped here
            st.pull(v, into=into)
        before = shm.allocated
        assert before >= 3  # the push buffer, a whole-version pull, the staging of a pull into tensors
        for v in range(4, 8):
            st.push(v, sd).result(TIMEOUT)
            assert_bits_equal(st.pull(v), sd)
            st.pull(v, into=into)
        assert shm.allocated == before  # steady state: every segment came back to the free list
        kept = st.pull(7)  # a pulled version kept alive holds its segment: the next pull gets another
        again = st.pull(7)
        assert kept["ids"].data_ptr() != again["ids"].data_ptr()
        assert_bits_equal(kept, sd)
        assert_bits_equal(again, sd)
        assert st.stats["shm_fallbacks"] == 0
        st.close()


def test_unreachable_master_is_a_clear_error() -> None:
    from rollart_weightsync.mooncake_server import free_port

    st = MooncakeWeightStore(master=f"127.0.0.1:{free_port()}")
    with pytest.raises(WeightSyncError, match="not reachable"):
        st.latest_version()


def test_mc_force_tcp_is_respected(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = MooncakeWeightStoreConfig(master="127.0.0.1:1", rdma_devices="mlx5_0")
    monkeypatch.delenv("MC_FORCE_TCP", raising=False)
    assert _resolve_protocol(cfg) == "rdma"
    monkeypatch.setenv("MC_FORCE_TCP", "1")
    assert _resolve_protocol(cfg) == "tcp"
    assert _resolve_protocol(cfg.model_copy(update={"protocol": "rdma"})) == "tcp"


@pytest.mark.parametrize("shared_memory", [False, True])
def test_holder_restart_next_push_recreates_version(shared_memory: bool) -> None:
    with MooncakeStoreServer(
        MooncakeServerConfig(segment_bytes=64 << 20, shared_memory=shared_memory)
    ) as srv:
        st = MooncakeWeightStore(srv.store_config(bucket_bytes=64 << 10))
        st.push(1, model_state(1)).result(TIMEOUT)
        old_pid = srv.holder.pid  # type: ignore[union-attr]
        srv.restart_holder()
        assert srv.holder is not None and srv.holder.pid != old_pid
        with pytest.raises(WeightSyncError):
            st.pull(1)  # its memory went with the old holder
        st.push(2, model_state(2)).result(TIMEOUT)
        assert st.latest_version() == 2
        assert_bits_equal(st.pull(2), model_state(2))
        # the restarted real client does not map this process's shared memory: the store fell back
        # to TCP (once) instead of failing
        assert st.stats["shm_fallbacks"] == int(shared_memory)
        st.close()
        pids = (srv.master.pid, srv.holder.pid)  # type: ignore[union-attr]
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.parametrize("shared_memory", [False, True])
def test_serve_cli_runs_and_stops_by_signal(shared_memory: bool) -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rollart_weightsync.cli",
            "serve",
            "--segment-gib",
            "0.05",
            *(["--shared-memory"] if shared_memory else []),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        info = json.loads(proc.stdout.readline())  # type: ignore[union-attr]
        assert (info["real_client"] is not None) == shared_memory
        st = MooncakeWeightStore(master=info["master"], real_client=info["real_client"], prefix="cli")
        st.push(1, {"x": torch.ones(5)}).result(TIMEOUT)
        assert torch.equal(st.pull(1)["x"], torch.ones(5))
        st.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(TIMEOUT) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(TIMEOUT)
        proc.stdout.close()  # type: ignore[union-attr]
    for pid in (info["master_pid"], info["holder_pid"]):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
