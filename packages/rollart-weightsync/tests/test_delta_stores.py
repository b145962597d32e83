"""Delta weight sync through the Ray store (a real local Ray) and the Mooncake store (a real
mooncake_master + holder over TCP on 127.0.0.1): newer versions as deltas, bit-exact; a damaged,
truncated or lost delta and a modified held version each fall back to a counted full pull."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch


def weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed": torch.randn(512, 64, generator=g) * 0.02,
        "proj": torch.randn(64, 64, generator=g) * 0.02,
        "norm": torch.ones(64),
        "ids": torch.arange(7, dtype=torch.int64),
    }


def step(sd: dict[str, torch.Tensor], lr: float, seed: int) -> dict[str, torch.Tensor]:
    """An Adam-like update: every float weight moves by about ``lr``."""
    g = torch.Generator().manual_seed(seed)
    return {
        k: v - lr * torch.sign(torch.randn(v.shape, generator=g)) if v.is_floating_point() else v.clone()
        for k, v in sd.items()
    }


def bf16(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.bfloat16() if v.is_floating_point() else v for k, v in sd.items()}


def assert_bits_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for k, w in want.items():
        assert got[k].dtype == w.dtype and got[k].shape == w.shape, k
        assert torch.equal(got[k].reshape(-1).view(torch.uint8), w.reshape(-1).view(torch.uint8)), k


def fallbacks(store: Any) -> dict[str, int]:
    return {
        k.removeprefix("delta_fallback_"): n
        for k, n in store.stats.items()
        if k.startswith("delta_fallback_") and n
    }


TIMEOUT = 60
_n = iter(range(10**6))


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    from rollart_core.config import RayConfig
    from rollart_core.resources import RayCluster

    with RayCluster(RayConfig(num_cpus=2)):
        yield


@pytest.fixture(scope="module")
def mooncake_server() -> Iterator[Any]:
    from rollart_weightsync import MooncakeServerConfig, MooncakeStoreServer

    with MooncakeStoreServer(MooncakeServerConfig(segment_bytes=128 << 20)) as s:
        yield s


def _ray_damage(writer: Any, version: int, how: str) -> None:
    import numpy as np
    import ray

    holder = writer._holder()
    blob = writer.delta_blob(version)
    bad = blob[:-5] if how == "truncated" else blob[:-3] + b"\0\0\0"
    ray.get(holder.put_delta.remote(version, np.frombuffer(bad, dtype=np.uint8)))


def _mooncake_damage(writer: Any, version: int, how: str) -> None:
    c = writer._conn()
    key = writer.delta_key(version, 0)
    if how == "lost":
        assert c.remove(key, True) == 0
        return
    blob = c.get(key)
    bad = blob[:-5] if how == "truncated" else blob[:-3] + b"\0\0\0"
    assert c.upsert(key, bad, writer._rcfg()) == 0


@pytest.fixture(params=[pytest.param("ray", marks=pytest.mark.ray), "mooncake"])
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[Any, Any, Callable[[Any, int, str], None]]]:
    """A pushing and a pulling store object of one back-end (as in two processes)."""
    if request.param == "ray":
        request.getfixturevalue("ray_cluster")
        from rollart_weightsync import RayWeightStore

        name = f"delta-{os.getpid()}-{next(_n)}"
        opts: dict[str, Any] = {"name": name, "bucket_bytes": 16 << 10, "delta": True, "dtype": "bfloat16"}
        writer, reader = RayWeightStore(**opts), RayWeightStore(**opts)
        damage = _ray_damage
    else:
        from rollart_weightsync import MooncakeWeightStore

        server = request.getfixturevalue("mooncake_server")
        cfg = server.store_config(
            prefix=f"d{os.getpid()}/{next(_n)}", bucket_bytes=16 << 10, delta=True, dtype="bfloat16"
        )
        writer, reader = MooncakeWeightStore(cfg), MooncakeWeightStore(cfg)
        damage = _mooncake_damage
    yield writer, reader, damage
    writer.close()
    reader.close()


def push_steps(writer: Any, versions: range, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    for v in versions:
        sd = step(sd, 1e-5, seed=v)
        writer.push(v, sd).result(TIMEOUT)
    return sd


def test_round_trip_bit_exact_and_smaller(pair) -> None:
    writer, reader, _ = pair
    sd = weights()
    for v in range(1, 5):
        sd = push_steps(writer, range(v, v + 1), sd)
        assert_bits_equal(reader.pull(v), bf16(sd))
    assert reader.stats["delta_pulls"] == 3 and fallbacks(reader) == {"no_base": 1}
    assert reader.stats["delta_bytes"] * 5 < 3 * reader.stats["full_bytes"]
    into = {"embed": torch.zeros(512, 64, dtype=torch.bfloat16)}
    sd = push_steps(writer, range(5, 6), sd)
    assert reader.pull(5, into=into)["embed"] is into["embed"]
    assert_bits_equal({"embed": into["embed"]}, {"embed": bf16(sd)["embed"]})
    assert reader.stats["delta_pulls"] == 4


def test_gap_and_modified_base_fall_back(pair) -> None:
    writer, reader, _ = pair
    sd = push_steps(writer, range(1, 2), weights())
    held = reader.pull(1)
    sd = push_steps(writer, range(2, 5), sd)  # keep_last=2: no chain back to version 1
    assert_bits_equal(reader.pull(4), bf16(sd))
    assert fallbacks(reader) == {"no_base": 1, "gap": 1}
    reader.pull(4)["proj"][0, 0] = 7.0  # the caller modifies what it holds
    sd = push_steps(writer, range(5, 6), sd)
    assert_bits_equal(reader.pull(5), bf16(sd))
    assert fallbacks(reader) == {"no_base": 2, "gap": 1, "base_mismatch": 1}
    assert held


@pytest.mark.parametrize("how", ["truncated", "damaged", "lost"])
def test_bad_delta_falls_back_to_full(pair, how: str) -> None:
    writer, reader, damage = pair
    if how == "lost" and writer.__class__.__name__ == "RayWeightStore":
        pytest.skip("Ray has no public way to lose one object the holder owns")
    sd = push_steps(writer, range(1, 2), weights())
    reader.pull(1)
    sd = push_steps(writer, range(2, 3), sd)
    damage(writer, 2, how)
    assert_bits_equal(reader.pull(2), bf16(sd))
    assert fallbacks(reader) == {"no_base": 1, ("lost" if how == "lost" else "corrupt"): 1}
    sd = push_steps(writer, range(3, 4), sd)
    assert_bits_equal(reader.pull(3), bf16(sd))
    assert reader.stats["delta_pulls"] == 1
