"""Delta weight sync: the codec, and the filesystem store pulling newer versions as deltas, with
every fault falling back to a full pull that is counted (never wrong weights)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from rollart_weightsync import FilesystemWeightStore, FilesystemWeightStoreConfig
from rollart_weightsync._delta import BaseMismatch, DeltaCorrupt, decode, encode, tensor_sum, version_sum

TIMEOUT = 30


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed": torch.randn(512, 64, generator=g) * 0.02,
        "proj": torch.randn(64, 64, generator=g) * 0.02,
        "norm": torch.ones(64),
        "special": torch.tensor([-0.0, 0.0, float("inf"), float("nan")]),
        "ids": torch.arange(7, dtype=torch.int64),
    }


def step(sd: dict[str, torch.Tensor], lr: float, seed: int) -> dict[str, torch.Tensor]:
    """An Adam-like update: every float weight moves by about ``lr`` (sign of a random gradient)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in sd.items():
        if v.is_floating_point() and k != "special":
            v = v - lr * torch.sign(torch.randn(v.shape, generator=g))
        out[k] = v.clone()
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).contiguous().view(torch.uint8)


def assert_bits_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for k, w in want.items():
        assert got[k].dtype == w.dtype and got[k].shape == w.shape, k
        assert torch.equal(bits(got[k]), bits(w)), k


def sums(sd: dict[str, torch.Tensor]) -> dict[str, str]:
    return {k: tensor_sum(v) for k, v in sd.items()}


def bf16(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.bfloat16() if v.is_floating_point() else v for k, v in sd.items()}


# the codec --------------------------------------------------------------------------------------


def test_codec_round_trip_bit_exact_and_compact() -> None:
    base = bf16(weights())
    target = bf16(step(weights(), 1e-5, seed=1))
    target["new"] = torch.randn(5)  # a tensor the base does not have
    target["proj"] = target["proj"].float()  # another dtype: sent raw
    del target["ids"]  # a tensor that went away
    blob = encode(1, base, sums(base), 2, target, sums(target))
    b, v, got, got_sums = decode(blob, base, sums(base))
    assert (b, v) == (1, 2)
    assert_bits_equal(got, target)
    assert got["norm"] is base["norm"]  # unchanged tensors are shared, not copied
    assert version_sum(got_sums) == version_sum(sums(target))
    full = sum(t.numel() * t.element_size() for t in target.values())
    assert len(blob) < full / 3


@pytest.mark.parametrize(
    "damage",
    [
        lambda b: b[: len(b) // 2],  # truncated
        lambda b: b[:-1],  # one byte short
        lambda b: b[:-10] + bytes(x ^ 0xFF for x in b[-10:]),  # damaged payload
        lambda b: b"x" * 8 + b[8:],  # not a delta
        lambda b: b"",
    ],
    ids=["half", "short", "flipped", "magic", "empty"],
)
def test_codec_refuses_a_damaged_delta(damage) -> None:
    base = bf16(weights())
    target = bf16(step(weights(), 1e-5, seed=1))
    blob = encode(1, base, sums(base), 2, target, sums(target))
    with pytest.raises(DeltaCorrupt):
        decode(damage(blob), base, sums(base))


def test_codec_refuses_a_base_that_does_not_match() -> None:
    base = bf16(weights())
    target = bf16(step(weights(), 1e-5, seed=1))
    blob = encode(1, base, sums(base), 2, target, sums(target))
    other = dict(base, proj=base["proj"].clone())
    other["proj"][0, 0] += 1
    with pytest.raises(BaseMismatch):
        decode(blob, other, sums(other))


# the filesystem store -------------------------------------------------------------------------


@pytest.fixture
def pair(tmp_path: Path):
    """A pushing store and a pulling one (separate objects, as in two processes) on one directory."""
    made: list[FilesystemWeightStore] = []

    def make(**options: object) -> tuple[FilesystemWeightStore, FilesystemWeightStore]:
        cfg = FilesystemWeightStoreConfig(root=tmp_path / "w", delta=True, **options)  # type: ignore[arg-type]
        made.extend([FilesystemWeightStore(cfg), FilesystemWeightStore(cfg)])
        return made[-2], made[-1]

    yield make
    for s in made:
        s.close()


def pushes(writer: FilesystemWeightStore, n: int, lr: float = 1e-5, start: int = 1):
    """Push versions start..start+n-1 of a model trained with ``lr``; yields (version, expected)."""
    sd = weights()
    for v in range(start, start + n):
        sd = step(sd, lr, seed=v)
        writer.push(v, sd).result(TIMEOUT)
        yield v, sd


def fallbacks(store: FilesystemWeightStore) -> dict[str, int]:
    return {
        k.removeprefix("delta_fallback_"): n
        for k, n in store.stats.items()
        if k.startswith("delta_fallback_") and n
    }


def test_newer_versions_come_as_deltas_bit_exact(pair) -> None:
    writer, reader = pair(dtype="bfloat16")
    for v, sd in pushes(writer, 4):
        assert_bits_equal(reader.pull(v), bf16(sd))
    assert reader.stats["full_pulls"] == 1 and fallbacks(reader) == {"no_base": 1}
    assert reader.stats["delta_pulls"] == 3
    assert writer.stats["delta_pushes"] == 3
    assert reader.stats["delta_bytes"] * 5 < 3 * reader.stats["full_bytes"]


def test_pull_into_and_a_chain_of_deltas(pair) -> None:
    writer, reader = pair(keep_last=3)
    got = list(pushes(writer, 1))
    reader.pull(1)
    got += list(pushes(writer, 2, start=2))
    into = {"embed": torch.zeros(512, 64)}
    out = reader.pull(3, into=into)  # v2's delta then v3's
    assert out["embed"] is into["embed"]
    assert_bits_equal(out, got[-1][1])
    assert reader.stats["delta_pulls"] == 1 and reader.stats["full_pulls"] == 1


def test_gap_after_retention_pulls_full(pair) -> None:
    writer, reader = pair(keep_last=2)
    first = list(pushes(writer, 1))
    reader.pull(1)
    last = list(pushes(writer, 3, start=2))  # v2's delta (from v1) is retired with v2
    assert_bits_equal(reader.pull(4), last[-1][1])
    assert fallbacks(reader) == {"no_base": 1, "gap": 1}
    assert first


def test_delta_larger_than_full_is_not_used(pair) -> None:
    writer, reader = pair()
    writer.push(1, {"a": torch.zeros(4)}).result(TIMEOUT)
    reader.pull(1)
    other = {"a": torch.ones(4)}  # so small that the delta's header alone outweighs the version
    writer.push(2, other).result(TIMEOUT)
    assert_bits_equal(reader.pull(2), other)
    assert fallbacks(reader) == {"no_base": 1, "larger": 1}
    assert writer.stats["delta_pushes"] == 0
    assert not (writer.root / "v00000002" / "delta.bin").exists()


def test_modified_held_weights_are_detected(pair) -> None:
    writer, reader = pair()
    versions = dict(pushes(writer, 1))
    held = reader.pull(1)
    held["proj"][3, 3] += 1.0  # the caller changed what it was handed
    versions.update(pushes(writer, 1, start=2))
    assert_bits_equal(reader.pull(2), versions[2])
    assert fallbacks(reader) == {"no_base": 1, "base_mismatch": 1}


@pytest.mark.parametrize(
    ("fault", "reason"),
    [
        (lambda p: p.unlink(), "lost"),
        (lambda p: p.write_bytes(p.read_bytes()[:-7]), "corrupt"),
        (lambda p: p.write_bytes(p.read_bytes()[:100]), "corrupt"),
        (lambda p: p.write_bytes(p.read_bytes()[:-3] + b"\0\0\0"), "corrupt"),
    ],
    ids=["lost", "short", "truncated", "damaged"],
)
def test_store_faults_fall_back_to_full(pair, fault, reason: str) -> None:
    writer, reader = pair()
    versions = dict(pushes(writer, 1))
    reader.pull(1)
    versions.update(pushes(writer, 1, start=2))
    fault(writer.root / "v00000002" / "delta.bin")
    assert_bits_equal(reader.pull(2), versions[2])
    assert fallbacks(reader) == {"no_base": 1, reason: 1}
    versions.update(pushes(writer, 1, start=3))  # and the next update is a delta again
    assert_bits_equal(reader.pull(3), versions[3])
    assert reader.stats["delta_pulls"] == 1


def test_delta_off_by_default_and_options_checked(tmp_path: Path) -> None:
    st = FilesystemWeightStore(FilesystemWeightStoreConfig(root=tmp_path / "w"))
    st.push(1, weights()).result(TIMEOUT)
    st.push(2, step(weights(), 1e-5, 1)).result(TIMEOUT)
    st.pull(2)
    assert not (tmp_path / "w" / "v00000002" / "delta.bin").exists()
    assert st.stats["delta_pulls"] == st.stats["full_pulls"] == 0
    with pytest.raises(ValidationError):
        FilesystemWeightStoreConfig(root=tmp_path, delta="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValidationError):
        FilesystemWeightStoreConfig(root=tmp_path, deltas=True)  # type: ignore[call-arg]
