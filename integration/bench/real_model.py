"""Benchmark: SmolLM2-135M-Instruct (the ``smollm2-135m-instruct`` preset) — trainer, generation, weight update.

    uv run --no-sync python integration/bench/real_model.py [--quick] [--out real_model.json]
        [--parts trainer,weights,generation] [--model DIR]

1. **Trainer throughput and model FLOP utilisation** (``TorchTrainer`` in process, all cores): one fixed
   batch of real-tokenized chat sequences (arithmetic questions in the model's ChatML template, worked
   answers as the replies), trained on for ``warmup + steps`` steps from the converted checkpoint in
   each of fp32 full, bf16 full (fp32 master weights + autocast, the trainer's default for bf16), bf16
   full with pure bf16 weights, fp32 LoRA and bf16 LoRA. Tokens/s = tokens of the packed batch over the
   median measured step. MFU = model FLOPs per step / median step / peak, where the peak is the best
   matmul microbenchmark (square 1024/2048 and the model's own MLP shape) in the same dtype, measured
   before and after the trainer runs (the larger of the two):

   - full: ``6·N_body·T + 6·N_head·T_loss``
   - LoRA: ``4·N_body·T + 4·N_head·T_loss + 6·N_lora·T`` (frozen weights: forward 2·N and the backward
     through the activations 2·N, no weight gradient; adapters: 6·N)

   ``N_body``: parameters of the decoder layers (every matmul weight; norms included, negligible);
   ``N_head``: the output projection (tied to the embedding here; the embedding lookup itself costs no
   FLOPs); ``T``: every token of the packed batch; ``T_loss``: the reply tokens, the only positions the
   trainer computes logits for. Attention scores (``QKᵀ``, ``PV``) are not counted (≈4% of the FLOPs at
   these lengths), so the MFU is a slight underestimate. Every step is split into phases by torch hooks
   (model forward; loss: logits → loss and back to the logits' gradient; backward through the model;
   optimiser step; the rest: packing, grad clipping, stats), and where the MFU is below 40% one extra
   step runs under ``torch.profiler`` and the ops that take the step's time are listed.
2. **bf16 against fp32 on the same batches**: the losses of the runs above, step by step (same initial
   weights, the same batch every step, behaviour logprobs from the fp32 model), and the largest
   difference.
3. **Generation**: rollart's ``VllmEngine`` (the proxy's engine actor, driven in process as
   ``integration/tests/test_smollm2.py`` does) against vLLM's offline ``LLM.generate`` on the same
   prompt ids and sampling (float32, ``prompts × tokens``, T=1, a seed per request, ``ignore_eos``, the
   sampled token's logprob, which the engine always asks for). rollart's ``SamplingParams`` has no
   ``ignore_eos``: the engine's vLLM sampling parameters get it set, nothing else changes. Each side runs
   in its own process, in the order A B B A (full) so that drift hits both; best of the timed repeats.
4. **Weight update**: the full state dict as the trainer pushes it (``named_weights``: bf16 and fp32,
   the tied ``lm_head.weight`` included) and a LoRA adapter's tensors (rank 8, all seven projections,
   PEFT names) through the filesystem, Ray and Mooncake stores: best push and pull after warm-up rounds
   (``weightsync_bench.store_bandwidth``). With ``generation`` (full mode): the engine's own update while
   8 requests generate: pull + staging (hidden behind generation), and the pause (full weights:
   ``staged`` swap + re-prefill; LoRA: the adapter switch, no pause), also as a share of a 37 s step
   (the SmolLM2 math example's step, docs/benchmarks.md).

Prints a table and writes JSON. The machine is shared: ratios within one run are what count.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(Path(__file__).parent) not in sys.path:  # its parts beside it, also when loaded by path (tests)
    sys.path.insert(0, str(Path(__file__).parent))
STEP_S = 37.0
"""A step of examples/smollm2_math.yaml on the 2-core machine (docs/benchmarks.md): pause shares are of it."""
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_RANK = 8
TRAINER_CONFIGS: dict[str, dict[str, Any]] = {
    "bf16 pure full": {"dtype": "bfloat16", "mixed_precision": False},
    "fp32 full": {"dtype": "float32"},
    "bf16 full": {"dtype": "bfloat16"},
    "fp32 LoRA": {"dtype": "float32", "lora": True},
    "bf16 LoRA": {"dtype": "bfloat16", "lora": True},
}
DEFAULT_CONFIGS = ("fp32 full", "bf16 full", "fp32 LoRA", "bf16 LoRA")
"""``bf16 pure full`` (bf16 weights and AdamW state, no fp32 master) runs when named in --configs."""
PROFILED = ("bf16 full", "bf16 LoRA")
"""Configs that get an op-level profile when their MFU is below the goal (40%, bf16)."""


def smollm2_dir() -> Path:
    """The preset's converted directory (converted once per clone, cached under .rollart/models)."""
    from rollart_core.config import ModelConfig
    from rollart_train.gguf import convert_gguf

    m = ModelConfig(preset="smollm2-135m-instruct", dtype="bfloat16").resolved(REPO)
    assert m.gguf is not None and m.path is not None
    return Path(convert_gguf(m.gguf, m.path, dtype=m.dtype))


# --- data -------------------------------------------------------------------------------------------


def chat_texts(n: int, reply_words: int, seed: int) -> list[tuple[str, str]]:
    """(question, worked answer) pairs of arithmetic in plain English; answers of about ``reply_words``."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b, c = rng.randrange(10, 90), rng.randrange(10, 90), rng.randrange(2, 9)
        question = f"A shop sells {a} apples in the morning and {b} in the afternoon. Each box holds {c} apples. How many boxes are filled?"
        parts: list[str] = []
        while sum(len(p.split()) for p in parts) < reply_words:
            x, y = rng.randrange(10, 999), rng.randrange(10, 999)
            parts.append(
                f"First we add the apples: {a} + {b} = {a + b}. Then we divide by {c}: {a + b} / {c} = "
                f"{(a + b) // c} boxes with {(a + b) % c} apples left over. To check, {(a + b) // c} x {c} + "
                f"{(a + b) % c} = {a + b}. As a second check, {x} + {y} = {x + y}, so the adding is right."
            )
        out.append((question, " ".join(parts)))
    return out


def encode_chats(model_dir: Path, n: int, reply_tokens: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids in the model's chat template, reply ids cut to ``reply_tokens``) per sequence."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    seqs = []
    for question, answer in chat_texts(n, reply_tokens, seed):
        msgs = [{"role": "user", "content": question}]
        if tok.chat_template:
            prompt = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        else:
            prompt = question + "\n"
        ids = tok(prompt, add_special_tokens=False)["input_ids"]
        reply = tok(answer, add_special_tokens=False)["input_ids"][:reply_tokens]
        seqs.append((list(ids), list(reply)))
    return seqs


def make_batch(seqs: list[tuple[list[int], list[int]]], behaviour: list[list[float]]) -> list[Any]:
    """Trajectories in groups of 4 (2 when the batch is smaller), half of each group rewarded."""
    from rollart_core.types import Trajectory, Turn

    group = 4 if len(seqs) >= 4 else max(len(seqs), 1)
    out = []
    for i, ((prompt, reply), lp) in enumerate(zip(seqs, behaviour, strict=True)):
        out.append(
            Trajectory(
                traj_id=f"t{i}",
                task="bench",
                env_id="e",
                group_id=f"g{i // group}",
                seed=i,
                start_version=0,
                reward=float(i % 2 == 0),
                turns=[Turn(prompt, reply, lp, [0] * len(reply))],
            )
        )
    return out


# --- FLOPs and the machine's peak -------------------------------------------------------------------


def matmul_peak(
    dtype: str, sizes: tuple[int, ...], model_shape: tuple[int, int, int], repeats: int
) -> dict[str, Any]:
    """Best GFLOP/s of a matmul in ``dtype`` over square sizes and the model's MLP shape (T×d, d×ff),
    each in the four layouts a linear layer's step uses: ``x@b`` (both row-major), ``linear``
    (``x @ Wᵀ``, the forward), ``gT@x`` (the weight gradient) and ``g@W`` (the input gradient). The
    layouts differ by 10x and more in bf16 on a CPU without bf16 instructions: every one is kept."""
    import torch
    import torch.nn.functional as F

    dt = getattr(torch, dtype)
    shapes = [(n, n, n) for n in sizes] + [model_shape]
    per: dict[str, float] = {}
    for m, k, n in shapes:
        x, b = torch.randn(m, k).to(dt), torch.randn(k, n).to(dt)
        w, g = torch.randn(n, k).to(dt), torch.randn(m, n).to(dt)
        layouts: dict[str, Callable[[], Any]] = {
            "x@b": lambda x=x, b=b: x @ b,
            "linear": lambda x=x, w=w: F.linear(x, w),
            "gT@x": lambda g=g, x=x: g.t() @ x,
            "g@W": lambda g=g, w=w: g @ w,
        }
        for name, fn in layouts.items():
            fn()  # warm-up (oneDNN primitive creation)
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            per[f"{m}x{k}x{n} {name}"] = 2 * m * k * n / min(times) / 1e9
    return {"dtype": dtype, "gflops": max(per.values()), "per_shape": per}


def param_counts(model: Any) -> dict[str, int]:
    """N_body (decoder layers + final norm), N_head (output projection), N_lora (adapters), N_total."""
    body = sum(
        p.numel() for n, p in model.named_parameters() if n.startswith("model.layers.") and "lora_" not in n
    )
    body += sum(p.numel() for n, p in model.named_parameters() if n.startswith("model.norm."))
    head = model.get_output_embeddings().weight.numel()
    lora = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    total = sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n)
    return {"N_body": body, "N_head": head, "N_lora": lora, "N_total": total}


def step_flops(n: dict[str, int], tokens: int, loss_tokens: int, lora: bool) -> float:
    """Model FLOPs of one train step (formulas in the module docstring)."""
    if lora:
        return 4.0 * n["N_body"] * tokens + 4.0 * n["N_head"] * loss_tokens + 6.0 * n["N_lora"] * tokens
    return 6.0 * n["N_body"] * tokens + 6.0 * n["N_head"] * loss_tokens


# --- trainer ----------------------------------------------------------------------------------------


def trainer_config(spec: dict[str, Any], lr: float) -> Any:
    from rollart_train import TorchTrainerConfig
    from rollart_train.torch_config import LoraConfig

    return TorchTrainerConfig(
        lr=lr,
        dtype=spec["dtype"],
        mixed_precision=spec.get("mixed_precision", True),
        lora=LoraConfig(rank=LORA_RANK, alpha=2.0 * LORA_RANK, target_modules=LORA_TARGETS)
        if spec.get("lora")
        else None,
    )


def bench_trainer(
    model_dir: Path,
    configs: list[str],
    n_seqs: int,
    reply_tokens: int,
    warmup: int,
    steps: int,
    lr: float,
    bf16_steps: int | None = None,
    peak_repeats: int = 3,
) -> dict[str, Any]:
    """Parts 1 and 2 (see the module docstring). ``bf16_steps``: measured steps of the bf16 configs
    (default ``steps``; torch's bf16 matmul is ~30x slower than fp32 on a CPU without bf16 instructions).
    The last measured step of the configs in ``PROFILED`` runs under torch.profiler."""
    from real_model_profile import PhaseTimer, op_profile

    from rollart_train import TorchTrainer

    seqs = encode_chats(model_dir, n_seqs, reply_tokens, seed=0)
    tokens = sum(len(p) + len(r) for p, r in seqs)
    loss_tokens = sum(len(r) for _, r in seqs)
    with open(model_dir / "config.json") as f:
        cfg = json.load(f)
    mlp_shape = (tokens, cfg["hidden_size"], cfg["intermediate_size"])
    sizes = {"float32": (1024, 2048), "bfloat16": (1024,)}

    def peak_now() -> dict[str, Any]:
        return {d: matmul_peak(d, sizes[d], mlp_shape, peak_repeats) for d in sizes}

    peaks = {d: [v] for d, v in peak_now().items()}
    behaviour: list[list[float]] | None = None
    runs: dict[str, Any] = {}
    for name in configs:
        spec = TRAINER_CONFIGS[name]
        t0 = time.perf_counter()
        trainer = TorchTrainer(trainer_config(spec, lr), model_path=model_dir)
        load_s = time.perf_counter() - t0
        if behaviour is None:  # the initial policy's logprobs in fp32: every run's behaviour policy
            ref = trainer if spec["dtype"] == "float32" and not spec.get("lora") else None
            ref = ref or TorchTrainer(trainer_config({"dtype": "float32"}, lr), model_path=model_dir)
            behaviour = [ref.logprobs(p + r)[len(p) - 1 :] for p, r in seqs]
            if ref is not trainer:
                ref.close()
        batch = make_batch(seqs, behaviour)
        counts = param_counts(trainer.model)
        flops = step_flops(counts, tokens, loss_tokens, bool(spec.get("lora")))
        timer = PhaseTimer(trainer.model)
        n_steps = bf16_steps if (bf16_steps is not None and spec["dtype"] == "bfloat16") else steps
        records = []
        for s in range(warmup + n_steps):
            with timer.step() as phases:
                metrics = trainer.train_step(batch)
            records.append({"loss": metrics["loss"], "grad_norm": metrics["grad_norm"], "phases": phases})
            print(f"  {name}: step {s} {phases['wall']:.2f} s loss {metrics['loss']:.6f}", flush=True)
        measured = records[warmup:]
        profile = None
        if name in PROFILED:  # one more step, under the profiler: not timed, its loss kept
            profile, metrics = op_profile(partial(trainer.train_step, batch))
            records.append({"loss": metrics["loss"], "grad_norm": metrics["grad_norm"]})
            print(f"  {name}: profiled step {profile['wall_s']:.2f} s loss {metrics['loss']:.6f}", flush=True)
        timer.close()
        trainer.close()
        del trainer, timer
        gc.collect()
        step_s = statistics.median(r["phases"]["wall"] for r in measured)
        phase_s = {
            k: statistics.median(r["phases"][k] for r in measured)
            for k in ("forward", "loss", "backward", "optimizer", "other")
        }
        runs[name] = {
            **spec,
            "lora": bool(spec.get("lora")),
            "load_s": load_s,
            "params": counts,
            "flops_per_step": flops,
            "step_s": step_s,
            "step_s_all": [r["phases"]["wall"] for r in measured],
            "tokens_per_s": tokens / step_s,
            "model_tflops": flops / step_s / 1e12,
            "phases_s": phase_s,
            "phase_share": {k: v / step_s for k, v in phase_s.items()},
            "losses": [r["loss"] for r in records],
            "grad_norms": [r["grad_norm"] for r in records],
            **({"profile": profile} if profile is not None else {}),
        }
    for d, v in peak_now().items():
        peaks[d].append(v)
    peak = {d: max(p["gflops"] for p in v) for d, v in peaks.items()}
    for r in runs.values():
        r["peak_gflops"] = peak[r["dtype"]]
        r["mfu"] = r["flops_per_step"] / r["step_s"] / (peak[r["dtype"]] * 1e9)
    return {
        "batch": {"sequences": n_seqs, "tokens": tokens, "loss_tokens": loss_tokens, "lr": lr},
        "warmup_steps": warmup,
        "steps": steps,
        "bf16_steps": steps if bf16_steps is None else bf16_steps,
        "peaks": peaks,
        "peak_gflops": peak,
        "runs": runs,
        "loss_compare": loss_compare(runs),
    }


def loss_compare(runs: dict[str, Any]) -> list[dict[str, Any]]:
    """bf16 against fp32, step by step, for the pairs that ran."""
    out = []
    for ref, other in (
        ("fp32 full", "bf16 full"),
        ("fp32 full", "bf16 pure full"),
        ("fp32 LoRA", "bf16 LoRA"),
    ):
        if ref in runs and other in runs:
            k = min(len(runs[ref]["losses"]), len(runs[other]["losses"]))
            a, b = runs[ref]["losses"][:k], runs[other]["losses"][:k]
            diffs = [abs(x - y) for x, y in zip(a, b, strict=True)]
            out.append(
                {
                    "reference": ref,
                    "other": other,
                    "reference_losses": a,
                    "other_losses": b,
                    "max_abs_diff": max(diffs),
                    "reference_change": a[-1] - a[0],
                    "other_change": b[-1] - b[0],
                }
            )
    return out


# --- weight update ----------------------------------------------------------------------------------


def model_payloads(model_dir: Path) -> dict[str, dict[str, Any]]:
    """What a trainer pushes: the full state dict (``named_weights``) in bf16 and fp32, and a LoRA
    adapter's tensors (``served_adapter``) in fp32."""
    import torch
    from transformers import AutoModelForCausalLM

    from rollart_train.lora import apply_lora, served_adapter
    from rollart_train.torch_config import LoraConfig

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    fp32 = {n: t.detach().clone() for n, t in model.state_dict().items()}
    bf16 = {n: t.to(torch.bfloat16) for n, t in fp32.items()}
    apply_lora(model, LoraConfig(rank=LORA_RANK, alpha=2.0 * LORA_RANK, target_modules=LORA_TARGETS))
    g = torch.Generator().manual_seed(0)
    for n, p in model.named_parameters():
        if "lora_B" in n:  # as after training (B starts at zero)
            p.data.normal_(0, 1e-3, generator=g)
    lora = {n: t.detach().clone().contiguous() for n, t in served_adapter(model)}
    del model
    return {"full bf16": bf16, "full fp32": fp32, "LoRA fp32": lora}


def nbytes(tensors: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def bench_stores(
    payloads: dict[str, dict[str, Any]], repeats: int, warmup: int, with_ray: bool
) -> list[dict[str, Any]]:
    """Push and pull of every payload through the filesystem, Mooncake and Ray stores."""
    from weightsync_bench import store_bandwidth

    from rollart_weightsync import (
        FilesystemWeightStore,
        FilesystemWeightStoreConfig,
        MooncakeServerConfig,
        MooncakeStoreServer,
        MooncakeWeightStore,
    )

    rows: list[dict[str, Any]] = []

    def record(store_name: str, payload: str, res: dict[str, Any]) -> None:
        rows.append({"store": store_name, "payload": payload, "bytes": nbytes(payloads[payload]), **res})
        print(f"  {store_name} {payload}: push {res['push_s']:.3f} s pull {res['pull_s']:.3f} s", flush=True)

    for payload, tensors in payloads.items():
        with tempfile.TemporaryDirectory() as d:
            fs = FilesystemWeightStore(FilesystemWeightStoreConfig(root=Path(d), keep_last=1))
            record(
                "filesystem",
                payload,
                store_bandwidth("filesystem", fs, tensors, nbytes(tensors), repeats, warmup),
            )
            fs.close()
    biggest = max(nbytes(t) for t in payloads.values())
    cfg = MooncakeServerConfig(segment_bytes=max(3 * biggest + (64 << 20), 256 << 20), lease_ttl_ms=200)
    with MooncakeStoreServer(cfg) as srv:  # its master and holder processes stop on exit
        for i, (payload, tensors) in enumerate(payloads.items()):
            mc = MooncakeWeightStore(srv.store_config(keep_last=1, bucket_bytes=8 << 20, prefix=f"bench/{i}"))
            record(
                "mooncake",
                payload,
                store_bandwidth("mooncake", mc, tensors, nbytes(tensors), repeats, warmup),
            )
            mc.close()
    if with_ray:
        from rollart_core.config import RayConfig
        from rollart_core.resources import RayCluster
        from rollart_weightsync import RayWeightStore

        with RayCluster(RayConfig(num_cpus=2)):
            for i, (payload, tensors) in enumerate(payloads.items()):
                rs = RayWeightStore(name=f"real-model-bench-{i}", keep_last=1)
                record("ray", payload, store_bandwidth("ray", rs, tensors, nbytes(tensors), repeats, warmup))
                rs.close()
    return rows


# --- main -------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a few minutes on SmolLM2)")
    ap.add_argument("--out", default="real_model.json")
    ap.add_argument("--parts", default="trainer,weights,generation", help="comma-separated subset")
    ap.add_argument(
        "--configs",
        default=",".join(DEFAULT_CONFIGS),
        help=f"trainer configs, of: {', '.join(TRAINER_CONFIGS)}",
    )
    ap.add_argument("--model", default=None, help="an HF model directory instead of the SmolLM2 preset")
    ap.add_argument("--no-ray", action="store_true", help="skip the Ray store")
    args = ap.parse_args()
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    parts = set(args.parts.split(","))
    model_dir = Path(args.model) if args.model else smollm2_dir()
    q = args.quick
    result: dict[str, Any] = {
        "quick": q,
        "model": str(model_dir),
        "machine": {"cpu_count": os.cpu_count(), "loadavg_start": os.getloadavg()},
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    t_start = time.perf_counter()
    if "trainer" in parts:
        print("part 1/2: trainer", flush=True)
        result["trainer"] = bench_trainer(
            model_dir,
            [c.strip() for c in args.configs.split(",") if c.strip()],
            n_seqs=2,
            reply_tokens=16 if q else 32,
            warmup=1,
            steps=1 if q else 3,
            bf16_steps=1 if q else 2,
            lr=1e-5,
            peak_repeats=2 if q else 3,
        )
    lora_file = None
    with tempfile.TemporaryDirectory() as tmp:
        if "weights" in parts or "generation" in parts:
            payloads = model_payloads(model_dir)
            from safetensors.torch import save_file

            lora_file = str(Path(tmp) / "adapter.safetensors")
            save_file(payloads["LoRA fp32"], lora_file)
        if "weights" in parts:
            print("part 4: weight stores", flush=True)
            warmup, repeats = (1, 1) if q else (1, 2)
            result["weights"] = {
                "warmup": warmup,
                "repeats": repeats,
                "payloads": {k: {"bytes": nbytes(v), "tensors": len(v)} for k, v in payloads.items()},
                "stores": bench_stores(payloads, repeats, warmup, not args.no_ray),
            }
        if "weights" in parts or "generation" in parts:
            del payloads
            gc.collect()
        if "generation" in parts:
            print("part 3: generation", flush=True)
            from real_model_gen import bench_generation

            result["generation"] = bench_generation(
                model_dir,
                prompts=4 if q else 32,
                max_tokens=8 if q else 64,
                repeats=1,
                order="AB" if q else "ABBA",
                updates=0 if q else 3,
                lora_adapter=None if q else lora_file,
            )
    result["machine"]["loadavg_end"] = os.getloadavg()
    result["wall_s"] = time.perf_counter() - t_start
    from real_model_report import print_tables

    print_tables(result)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.out} ({result['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
