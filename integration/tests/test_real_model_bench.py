"""integration/bench/real_model.py: its parts at tiny size (the tiny model) give the fields the docs
table reads, with positive, finite numbers; the full ``--quick`` run on SmolLM2 is ``slow``."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "real_model.py"


def _bench() -> Any:
    spec = importlib.util.spec_from_file_location("real_model_bench", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _positive(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_flop_formulas_count_what_the_docstring_says() -> None:
    bench = _bench()
    n = {"N_body": 100, "N_head": 10, "N_lora": 2, "N_total": 110}
    assert bench.step_flops(n, tokens=8, loss_tokens=3, lora=False) == 6 * 100 * 8 + 6 * 10 * 3
    assert bench.step_flops(n, tokens=8, loss_tokens=3, lora=True) == 4 * 100 * 8 + 4 * 10 * 3 + 6 * 2 * 8


def test_trainer_part_on_the_tiny_model(tiny_model: Path) -> None:
    """Two configs, one measured step each: throughput, MFU, phases, the loss comparison, a profile."""
    bench = _bench()
    res = bench.bench_trainer(
        tiny_model,
        ["fp32 full", "bf16 full"],
        n_seqs=2,
        reply_tokens=16,
        warmup=1,
        steps=1,
        lr=1e-5,
        peak_repeats=1,
    )
    assert res["batch"]["tokens"] > res["batch"]["loss_tokens"] > 0
    assert all(_positive(v) for v in res["peak_gflops"].values())
    for name, r in res["runs"].items():
        for key in ("step_s", "tokens_per_s", "flops_per_step", "mfu", "peak_gflops"):
            assert _positive(r[key]), (name, key, r[key])
        assert r["params"]["N_lora"] == 0 and r["params"]["N_body"] > 0
        assert set(r["phases_s"]) == {"forward", "loss", "backward", "optimizer", "other"}
        assert (
            r["phases_s"]["forward"] > 0 and r["phases_s"]["backward"] > 0 and r["phases_s"]["optimizer"] > 0
        )
        assert sum(r["phases_s"].values()) <= r["step_s"] * 1.01
        # warm-up + measured steps, and bf16 full's extra profiled step
        assert len(r["losses"]) == 2 + (name == "bf16 full") and all(math.isfinite(x) for x in r["losses"])
    # the same initial weights and batch: the first losses agree to bf16's precision
    (cmp,) = res["loss_compare"]
    assert cmp["reference"] == "fp32 full" and cmp["other"] == "bf16 full"
    assert math.isfinite(cmp["max_abs_diff"]) and cmp["max_abs_diff"] < 0.1
    assert res["runs"]["fp32 full"]["losses"][0] == pytest.approx(0.0, abs=1e-6)  # ratio 1 at step 0
    # bf16 full is profiled when below the 40% goal (the tiny model always is)
    prof = res["runs"]["bf16 full"]["profile"]
    assert prof["top_ops"] and _positive(prof["self_cpu_s"])
    assert sum(g["share"] for g in prof["groups"].values()) <= 1.0 + 1e-6
    json.dumps(res)  # the result is JSON as it is


def test_store_part_on_tiny_payloads() -> None:
    import torch

    bench = _bench()
    payloads = {
        "full bf16": {"w": torch.ones(1024, dtype=torch.bfloat16)},
        "LoRA fp32": {"a": torch.ones(64)},
    }
    rows = bench.bench_stores(payloads, repeats=1, warmup=0, with_ray=False)
    assert {(r["store"], r["payload"]) for r in rows} == {
        (s, p) for s in ("filesystem", "mooncake") for p in payloads
    }
    assert all(_positive(r["push_s"]) and _positive(r["pull_s"]) and r["bytes"] > 0 for r in rows)


@pytest.mark.slow  # SmolLM2 trainer steps, two vLLM engines, three stores: minutes on 2 cores
@pytest.mark.vllm
@pytest.mark.ray
def test_quick_run_on_smollm2(tmp_path: Path) -> None:
    out = tmp_path / "real_model.json"
    r = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--configs", "fp32 full,bf16 LoRA", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    res = json.loads(out.read_text())
    assert set(res["trainer"]["runs"]) == {"fp32 full", "bf16 LoRA"}
    assert res["trainer"]["runs"]["bf16 LoRA"]["params"]["N_lora"] > 0
    assert all(_positive(r["tokens_per_s"]) and _positive(r["mfu"]) for r in res["trainer"]["runs"].values())
    g = res["generation"]
    assert (
        _positive(g["vllm_llm_tokens_per_s"])
        and _positive(g["rollart_engine_tokens_per_s"])
        and _positive(g["ratio"])
    )
    # ignore_eos: both sides generate exactly prompts x tokens
    for side in ("vllm_llm", "rollart_engine"):
        assert all(
            run["tokens"] == g["prompts"] * g["max_tokens"] for rr in g["rounds"][side] for run in rr["runs"]
        )
    stores = {(s["store"], s["payload"]) for s in res["weights"]["stores"]}
    assert stores == {
        (s, p) for s in ("filesystem", "mooncake", "ray") for p in ("full bf16", "full fp32", "LoRA fp32")
    }
    full = next(s for s in res["weights"]["stores"] if s["payload"] == "full bf16")
    assert full["bytes"] > 250e6  # the real state dict
