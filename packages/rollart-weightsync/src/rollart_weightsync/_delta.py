"""Delta weight sync: a version sent as its difference from a version the reader already holds.

The writer (the store object in the trainer) keeps the last version it pushed and stores, next to
each new full version, a *delta* from that previous one. The reader (the store object in an
inference worker) keeps the last version it pulled; asked for a newer one, it fetches the chain of
deltas from its version to the target and rebuilds the target bit for bit. Anything else is a full
pull, counted in ``stats`` by reason:

==================  ===========================================================================
``no_base``         the reader holds no older version (first pull, or it asks for an older one)
``gap``             the store keeps no chain of deltas back to the reader's version (retention)
``larger``          the chain's bytes would not be fewer than the full version's
``base_mismatch``   the reader's copy of its version no longer matches the checksums (modified)
``lost``            the store says a delta exists but cannot hand it over (object/file gone)
``corrupt``         a delta fails its checksum, is truncated, or does not decode
==================  ===========================================================================

One delta on the wire: ``MAGIC | u32 header length | header (JSON) | payload``. The header lists
every tensor of the target: name, dtype, shape, checksum of its bytes in the base and in the target,
and a kind with its slice of the payload:

- ``same``: bits unchanged, no payload;
- ``xor``: ``zlib(bitmap of changed words ‖ byte planes of the changed words' XOR)``. At RL
  learning rates most bf16 words do not change at all, and a changed word flips low mantissa bits
  only, so the bitmap is mostly zero bytes and the planes of the high bytes nearly so;
- ``raw``: the target's bytes (a new tensor, another dtype or shape, or XOR no smaller).

The header also carries the checksum of the whole payload (a truncated or damaged delta is caught
before any byte is applied) and a checksum of each version (over its tensors' names and checksums),
which the rebuilt version must match.
"""

from __future__ import annotations

import json
import logging
import struct
import threading
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from rollart_core.errors import WeightSyncError

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    import numpy as np
    import torch

__all__ = [
    "FALLBACKS",
    "DeltaReader",
    "DeltaSource",
    "DeltaWriter",
    "decode",
    "encode",
    "tensor_sum",
    "version_sum",
]

MAGIC = b"RLDELTA1"
FALLBACKS = ("no_base", "gap", "larger", "base_mismatch", "lost", "corrupt")
_HEAD = struct.Struct("<I")
_LEVEL = 1  # zlib level: 6 saved ~5% more bytes on trained tiny-model updates at several times the time


class DeltaCorrupt(WeightSyncError):
    """A delta that cannot be applied: truncated, damaged or not a delta at all."""


class BaseMismatch(WeightSyncError):
    """The reader's copy of the base version is not what the delta was computed from."""


def _raw(t: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as a flat uint8 array (a view when contiguous on the CPU)."""
    import torch

    t = t.detach()
    if t.device.type != "cpu" or not t.is_contiguous():
        t = t.to("cpu").contiguous()
    return t.reshape(-1).view(torch.uint8).numpy()


def _words(raw: np.ndarray, itemsize: int) -> np.ndarray:
    import numpy as np

    word = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}.get(itemsize)
    return raw.view(word) if word is not None else raw


def tensor_sum(t: torch.Tensor) -> str:
    """blake3 (128 bits) of a tensor's bytes."""
    import blake3

    return blake3.blake3(_raw(t).data).hexdigest(length=16)


def version_sum(sums: Mapping[str, str]) -> str:
    """A version's checksum: blake3 over its tensors' names and checksums, in name order."""
    import blake3

    h = blake3.blake3()
    for name in sorted(sums):
        h.update(f"{name}\0{sums[name]}\n".encode())
    return h.hexdigest(length=16)


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def encode(
    base_version: int,
    base: Mapping[str, torch.Tensor],
    base_sums: Mapping[str, str],
    version: int,
    target: Mapping[str, torch.Tensor],
    target_sums: Mapping[str, str],
) -> bytes:
    """The delta that turns ``base`` (checksums ``base_sums``) into ``target``."""
    import blake3
    import numpy as np

    entries: list[dict[str, Any]] = []
    parts: list[bytes] = []
    offset = 0
    for name, t in target.items():
        e: dict[str, Any] = {
            "name": name,
            "dtype": _dtype_name(t),
            "shape": list(t.shape),
            "sum": target_sums[name],
            "kind": "raw",
        }
        tb = _raw(t)
        b = base.get(name)
        payload = b""
        if b is not None and b.dtype == t.dtype and tuple(b.shape) == tuple(t.shape):
            e["base_sum"] = base_sums[name]
            if base_sums[name] == target_sums[name]:
                e["kind"] = "same"
            else:
                x = np.bitwise_xor(_words(_raw(b), t.element_size()), _words(tb, t.element_size()))
                changed = x != 0
                nnz = int(np.count_nonzero(changed))
                planes = np.ascontiguousarray(x[changed].view(np.uint8).reshape(nnz, -1).T)
                packed = zlib.compress(np.packbits(changed).tobytes() + planes.tobytes(), _LEVEL)
                if len(packed) < tb.nbytes:
                    e["kind"], e["nnz"], payload = "xor", nnz, packed
        if e["kind"] == "raw":
            payload = tb.tobytes()
        e["offset"], e["nbytes"] = offset, len(payload)
        offset += len(payload)
        parts.append(payload)
        entries.append(e)
    payload_all = b"".join(parts)
    header = {
        "format": 1,
        "base": base_version,
        "version": version,
        "base_sum": version_sum(base_sums),
        "sum": version_sum(target_sums),
        "payload_bytes": len(payload_all),
        "payload_sum": blake3.blake3(payload_all).hexdigest(length=16),
        "tensors": entries,
    }
    head = json.dumps(header, separators=(",", ":")).encode()
    return MAGIC + _HEAD.pack(len(head)) + head + payload_all


def _header(blob: bytes) -> tuple[dict[str, Any], memoryview]:
    import blake3

    view = memoryview(blob)
    start = len(MAGIC) + _HEAD.size
    if len(blob) < start or bytes(view[: len(MAGIC)]) != MAGIC:
        raise DeltaCorrupt(f"not a delta ({len(blob)} bytes, bad magic)")
    (n,) = _HEAD.unpack_from(blob, len(MAGIC))
    if start + n > len(blob):
        raise DeltaCorrupt(f"truncated delta: header of {n} bytes, {len(blob) - start} left")
    try:
        header = json.loads(bytes(view[start : start + n]))
        payload = view[start + n :]
        ok = header["format"] == 1 and len(payload) == header["payload_bytes"]
    except (ValueError, KeyError, TypeError) as exc:
        raise DeltaCorrupt(f"unreadable delta header: {exc}") from None
    if not ok:
        raise DeltaCorrupt(f"truncated delta: payload of {len(payload)} bytes, header says otherwise")
    if blake3.blake3(payload).hexdigest(length=16) != header["payload_sum"]:
        raise DeltaCorrupt("delta payload checksum mismatch")
    return header, payload


def decode(
    blob: bytes, base: Mapping[str, torch.Tensor], base_sums: Mapping[str, str]
) -> tuple[int, int, dict[str, torch.Tensor], dict[str, str]]:
    """Apply ``blob`` to ``base`` (whose tensors' checksums are ``base_sums``); returns the base and
    target version numbers, the target tensors (unchanged ones are the base's own tensors, never
    modified) and their checksums. :class:`BaseMismatch` or :class:`DeltaCorrupt` on a fault."""
    header, payload = _header(blob)
    if version_sum(base_sums) != header["base_sum"]:
        raise BaseMismatch(f"the held version {header['base']} does not match the delta's base checksum")
    out: dict[str, torch.Tensor] = {}
    sums: dict[str, str] = {}
    try:
        for e in header["tensors"]:
            name = e["name"]
            seg = payload[e["offset"] : e["offset"] + e["nbytes"]]
            if len(seg) != e["nbytes"]:
                raise DeltaCorrupt(f"tensor {name!r}: payload slice out of range")
            t = _apply(e, seg, base.get(name))
            if e["kind"] != "same" and tensor_sum(t) != e["sum"]:
                raise DeltaCorrupt(f"tensor {name!r}: checksum mismatch after applying the delta")
            out[name], sums[name] = t, e["sum"]
    except (KeyError, TypeError, ValueError, zlib.error) as exc:  # a damaged header that hashed right
        raise DeltaCorrupt(f"undecodable delta: {exc!r}") from None
    if version_sum(sums) != header["sum"]:
        raise DeltaCorrupt(f"version {header['version']}: checksum mismatch after applying the delta")
    return int(header["base"]), int(header["version"]), out, sums


def _apply(e: dict[str, Any], seg: memoryview, b: torch.Tensor | None) -> torch.Tensor:
    import numpy as np
    import torch

    dtype = getattr(torch, e["dtype"])
    if e["kind"] == "raw":
        return torch.frombuffer(bytearray(seg), dtype=torch.uint8).view(dtype).reshape(e["shape"])
    if b is None or b.dtype != dtype or list(b.shape) != e["shape"]:
        raise BaseMismatch(f"tensor {e['name']!r}: the held version has no such tensor")
    if e["kind"] == "same":
        return b
    if e["kind"] != "xor":
        raise DeltaCorrupt(f"tensor {e['name']!r}: unknown kind {e['kind']!r}")
    base_raw = _raw(b)
    itemsize = b.element_size()
    n = base_raw.nbytes // itemsize
    nnz = int(e["nnz"])
    want = (n + 7) // 8 + nnz * itemsize
    inflate = zlib.decompressobj()
    raw = inflate.decompress(seg, want)  # bounded: a damaged stream cannot inflate past what it must hold
    if len(raw) != want or not inflate.eof or inflate.unconsumed_tail:
        raise DeltaCorrupt(f"tensor {e['name']!r}: XOR stream of the wrong length")
    bits = np.frombuffer(raw, dtype=np.uint8, count=(n + 7) // 8)
    changed = np.unpackbits(bits, count=n).view(bool)
    if int(np.count_nonzero(changed)) != nnz:
        raise DeltaCorrupt(f"tensor {e['name']!r}: bitmap does not match its count")
    planes = np.frombuffer(raw, dtype=np.uint8, offset=(n + 7) // 8).reshape(itemsize, nnz)
    words = _words(base_raw, itemsize).copy()
    words[changed] ^= _words(np.ascontiguousarray(planes.T).reshape(-1), itemsize)
    return torch.from_numpy(words.view(np.uint8)).view(dtype).reshape(e["shape"])


@dataclass
class _Held:
    version: int
    tensors: dict[str, torch.Tensor]
    sums: dict[str, str]


class DeltaWriter:
    """The pushing side: keeps the last committed version and encodes the next one against it.
    The held tensors must not change while held (stores hand it their own snapshot)."""

    def __init__(self) -> None:
        self._held: _Held | None = None

    @property
    def base_version(self) -> int | None:
        return self._held.version if self._held is not None else None

    def encode(
        self, version: int, tensors: Mapping[str, torch.Tensor]
    ) -> tuple[bytes | None, dict[str, str]]:
        """The delta of ``version`` from the held one (None: nothing held, or not older), and the
        checksums of ``tensors`` for :meth:`hold`."""
        sums = {name: tensor_sum(t) for name, t in tensors.items()}
        held = self._held
        if held is None or held.version >= version:
            return None, sums
        return encode(held.version, held.tensors, held.sums, version, tensors, sums), sums

    def hold(self, version: int, tensors: Mapping[str, torch.Tensor], sums: dict[str, str]) -> None:
        """``version`` was committed: the next push is encoded against it."""
        self._held = _Held(version, dict(tensors), sums)


@dataclass
class DeltaInfo:
    """What a version's manifest says about its delta."""

    base: int
    nbytes: int


class DeltaSource(Protocol):
    """What a store gives :class:`DeltaReader`."""

    def delta_info(self, version: int) -> DeltaInfo | None:
        """The delta stored with ``version`` (None: none, or the version is not committed)."""
        ...

    def delta_blob(self, version: int) -> bytes:
        """The delta's bytes; WeightSyncError if the store lost them."""
        ...

    def full_nbytes(self, version: int) -> int: ...

    def pull_full(self, version: int) -> dict[str, torch.Tensor]: ...


def new_stats() -> dict[str, int]:
    """The counters a store with deltas keeps in its ``stats``."""
    keys = ["delta_pulls", "full_pulls", "delta_bytes", "full_bytes", "delta_pushes", "delta_push_bytes"]
    return {k: 0 for k in keys + [f"delta_fallback_{r}" for r in FALLBACKS]}


class DeltaReader:
    """The pulling side: keeps the last version pulled (the tensors it returned: callers must not
    modify them in place, or the next pull finds the mismatch and pulls in full) and pulls newer
    versions as deltas from it where the store can."""

    def __init__(self, stats: dict[str, int], name: str) -> None:
        self._stats = stats
        self._name = name
        self._held: _Held | None = None
        self._lock = threading.Lock()

    @property
    def held_version(self) -> int | None:
        return self._held.version if self._held is not None else None

    def pull(
        self,
        source: DeltaSource,
        version: int,
        into: Mapping[str, torch.Tensor] | None,
        fill: Callable[[dict[str, torch.Tensor], Mapping[str, torch.Tensor] | None], dict[str, torch.Tensor]],
    ) -> dict[str, torch.Tensor]:
        with self._lock:
            held = self._held
        got = self._try_delta(source, version, held) if held is not None else "no_base"
        if isinstance(got, str):
            tensors = source.pull_full(version)
            self._count(f"delta_fallback_{got}", 1, full_pulls=1, full_bytes=source.full_nbytes(version))
            self._hold(_Held(version, tensors, {}))
        else:
            tensors = got.tensors
            self._hold(got)
        return fill(tensors, into)

    def _try_delta(self, source: DeltaSource, version: int, held: _Held) -> _Held | str:
        """The rebuilt version, or why it was not rebuilt (a fallback reason)."""
        if held.version >= version:
            return "no_base"
        chain: list[int] = []
        nbytes = 0
        v = version
        while v != held.version:
            info = source.delta_info(v)
            if info is None or info.base < held.version:
                return "gap"
            chain.append(v)
            nbytes += info.nbytes
            v = info.base
        if nbytes >= source.full_nbytes(version):
            return "larger"
        tensors = held.tensors
        # hashed on every use, not remembered: the caller may have modified the tensors it was handed
        sums = {name: tensor_sum(t) for name, t in tensors.items()}
        fetched = 0
        for v in reversed(chain):
            try:
                blob = source.delta_blob(v)
            except WeightSyncError as exc:
                log.warning("%s: delta of version %d lost (%s); pulling it in full", self._name, v, exc)
                return "lost"
            fetched += len(blob)
            try:
                _, got_v, tensors, sums = decode(blob, tensors, sums)
            except BaseMismatch as exc:
                log.warning("%s: %s; pulling version %d in full", self._name, exc, version)
                return "base_mismatch"
            except DeltaCorrupt as exc:
                log.warning("%s: delta of version %d: %s; pulling in full", self._name, v, exc)
                return "corrupt"
            if got_v != v:
                log.warning("%s: the delta stored for version %d is version %d's", self._name, v, got_v)
                return "corrupt"
        self._count("delta_pulls", 1, delta_bytes=fetched)
        return _Held(version, tensors, sums)

    def _hold(self, held: _Held) -> None:
        with self._lock:
            if self._held is None or held.version >= self._held.version:
                self._held = held

    def _count(self, key: str, n: int, **more: int) -> None:
        with self._lock:
            self._stats[key] += n
            for k, m in more.items():
                self._stats[k] += m
