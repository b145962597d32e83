"""The ``faulty`` weight store: the first readers of a listed version get the fault, across processes;
every other pull and every push is the wrapped store's."""

from __future__ import annotations

import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from rollart_core.errors import WeightSyncError
from rollart_core.registry import build
from rollart_weightsync.faults import FaultyWeightStore, FaultyWeightStoreConfig

TIMEOUT = 30


def weights(k: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4, 4), k), "b": torch.arange(3.0) + k}


def options(tmp_path: Path, **faults: object) -> dict[str, object]:
    return {
        "store": {"impl": "filesystem", "options": {"root": str(tmp_path / "w")}},
        "claim_dir": str(tmp_path / "claims"),
        **faults,
    }


CHILD = """
import pickle, sys
from rollart_core.errors import WeightSyncError
store = pickle.load(open(sys.argv[1], "rb"))
try:
    print("ok", float(store.pull(int(sys.argv[2]))["w"][0, 0]))
except WeightSyncError as e:
    print("error", e)
"""


def test_the_first_reader_of_a_listed_version_fails_the_others_pull(tmp_path: Path) -> None:
    writer = build("weight_store", "faulty", options(tmp_path, fail_pull=[2]), "weight_store.options")
    assert isinstance(writer, FaultyWeightStore)
    for v in (1, 2, 3):
        writer.push(v, weights(float(v))).result(TIMEOUT)
    assert writer.latest_version() == 3 and writer.wait_for(3, TIMEOUT) == 3

    # readers in other processes (the store travels pickled, as to an engine actor)
    blob = tmp_path / "store.pkl"
    blob.write_bytes(pickle.dumps(writer))
    procs = [
        subprocess.Popen([sys.executable, "-c", CHILD, str(blob), "2"], stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    results = sorted(p.communicate(timeout=TIMEOUT)[0].strip() for p in procs)
    assert results == ["error injected fault: the pull of version 2 failed", "ok 2.0", "ok 2.0"]
    readers = [pickle.loads(blob.read_bytes())]
    # claimed once and for all: a retry (any reader) pulls; other versions were never faulty
    assert float(readers[0].pull(2)["w"][0, 0]) == 2.0
    assert float(readers[0].pull(3)["b"][1]) == 4.0
    writer.close()


def test_two_readers_take_a_hang_then_it_fails_naming_the_version(tmp_path: Path) -> None:
    cfg = FaultyWeightStoreConfig.model_validate(options(tmp_path, hang_pull=[1], hang_s=0.3, readers=2))
    store = FaultyWeightStore(cfg)
    store.push(1, weights(1.0)).result(TIMEOUT)
    for _ in range(2):
        t0 = time.perf_counter()
        with pytest.raises(WeightSyncError, match=r"the pull of version 1 hung for 0.3 s"):
            store.pull(1)
        assert time.perf_counter() - t0 >= 0.3
    assert store.injected == {"fail": 0, "hang": 2}
    assert torch.equal(store.pull(1)["w"], weights(1.0)["w"])  # the third reader is not faulted
    store.close()


def test_bad_fault_configs_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match=r"versions \[2\] are in both fail_pull and hang_pull"):
        FaultyWeightStoreConfig.model_validate(options(tmp_path, fail_pull=[2, 3], hang_pull=[2]))
    nested = options(tmp_path)
    nested["store"] = {"impl": "faulty", "options": options(tmp_path)}
    with pytest.raises(ValidationError, match="cannot wrap another faulty store"):
        FaultyWeightStoreConfig.model_validate(nested)
    with pytest.raises(ValidationError, match=r"Extra inputs are not permitted"):
        FaultyWeightStoreConfig.model_validate(options(tmp_path, fail_pulls=[2]))
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        FaultyWeightStoreConfig.model_validate(options(tmp_path, readers=0))
