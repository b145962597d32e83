"""Sender helpers (FSDP2/DTensor gather, name mapping) and subscribe/into= on the simple stores."""

from __future__ import annotations

import threading

import pytest
import torch

from rollart_core.errors import WeightSyncError
from rollart_weightsync import FilesystemWeightStore, MemoryWeightStore, full_state, push_model, rename

TIMEOUT = 60


def test_full_state_strips_wrappers_and_maps_names() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    compiled_like = torch.nn.Module()
    compiled_like._orig_mod = model  # what torch.compile wraps a model as
    state = full_state(compiled_like)
    assert sorted(state) == ["0.bias", "0.weight", "1.bias", "1.weight"]

    def split(name: str, t: torch.Tensor):  # a Megatron-style fused tensor split into HF names
        if name == "0.weight":
            yield "model.q.weight", t[:1]
            yield "model.kv.weight", t[1:]
        elif name.startswith("1."):
            yield f"lm_head.{name[2:]}", t

    mapped = full_state(model, name_mapper=split)
    assert sorted(mapped) == ["lm_head.bias", "lm_head.weight", "model.kv.weight", "model.q.weight"]
    assert torch.equal(torch.cat([mapped["model.q.weight"], mapped["model.kv.weight"]]), model[0].weight)
    with pytest.raises(WeightSyncError, match="two tensors"):
        full_state(model, name_mapper=rename(lambda n: "same"))
    store = MemoryWeightStore()
    push_model(
        store, 1, model, name_mapper=rename(lambda n: None if "bias" in n else f"m.{n}"), rank=0
    ).result(TIMEOUT)
    assert sorted(store.pull(1)) == ["m.0.weight", "m.1.weight"]
    assert push_model(store, 2, model, rank=1) is None
    store.close()


_FSDP_WORKER = r"""
import os, sys, torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from rollart_weightsync import MemoryWeightStore, full_state, push_model

rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 4))
reference = {k: v.clone() for k, v in model.state_dict().items()}
fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
assert type(model[0].weight).__name__ == "DTensor", type(model[0].weight)
assert model[0].weight.to_local().shape[0] == 6 // world
state = full_state(model)  # a collective: every rank gathers
store = MemoryWeightStore()
fut = push_model(store, 1, model)  # pushes from rank 0 only
if rank == 0:
    fut.result(60)
    pulled = store.pull(1)
    assert sorted(pulled) == sorted(reference), sorted(pulled)
    assert all(torch.equal(pulled[k], reference[k]) and torch.equal(state[k], reference[k]) for k in reference)
    print("GATHERED-OK", flush=True)
else:
    assert fut is None
store.close()
dist.barrier()  # no rank tears gloo down while its peer still talks to it
dist.destroy_process_group()
# gloo's worker threads can still hold work objects at interpreter finalization and abort the process
# ("terminate called without an active exception", pytorch/pytorch#190489); the checks above are done.
sys.stdout.flush()
os._exit(0)
"""


def test_fsdp2_sharded_parameters_are_gathered() -> None:
    import subprocess
    import sys

    from rollart_weightsync.mooncake_server import free_port

    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _FSDP_WORKER, str(r), "2", str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=120))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], [(o[0][-500:], o[1][-2000:]) for o in outs]
    assert "GATHERED-OK" in outs[0][0]


@pytest.fixture(params=["memory", "filesystem"])
def simple_store(request, tmp_path):
    st = MemoryWeightStore() if request.param == "memory" else FilesystemWeightStore(root=tmp_path / "w")
    yield st
    st.close()


def test_simple_stores_into_and_subscribe(simple_store) -> None:
    seen: list[int] = []
    got_two = threading.Event()

    def on_version(v: int) -> None:
        seen.append(v)
        if v == 2:
            got_two.set()

    unsubscribe = simple_store.subscribe(on_version)
    sd = {"w": torch.randn(5, 3), "b": torch.randn(3).bfloat16()}
    simple_store.push(1, sd).result(TIMEOUT)
    simple_store.push(2, {k: v * 2 for k, v in sd.items()}).result(TIMEOUT)
    assert got_two.wait(TIMEOUT)
    unsubscribe()
    assert seen[-1] == 2 and seen == sorted(set(seen))
    into = {"w": torch.zeros(5, 3)}
    out = simple_store.pull(1, into=into)
    assert out["w"] is into["w"] and torch.equal(into["w"], sd["w"]) and torch.equal(out["b"], sd["b"])
    with pytest.raises(WeightSyncError, match="shape"):
        simple_store.pull(1, into={"w": torch.zeros(3, 5)})
