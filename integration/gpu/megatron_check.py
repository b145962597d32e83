"""GPU check: one (two) MegatronTrainer training steps on a tiny Qwen2-architecture model.

Needs one CUDA GPU, torch, megatron-core (a wheel that can travel), pydantic and safetensors; no
transformers and no network. Run from the repository root:

    python integration/gpu/megatron_check.py              # TP=1, PP=1, one process
    torchrun --nproc-per-node 2 integration/gpu/megatron_check.py --tp 2

It writes a random tiny Qwen2 checkpoint (config.json + safetensors, head_dim 64), builds the trainer
from it, checks that named_weights() gives back the HF names and shapes it was loaded from (and the
same values before training), takes a PPO-clip step and a decoupled-PPO step on stale tokens, and
checks that the loss is finite, the version advances and the weights move. With transformers
installed it also compares Megatron's logprobs with the Hugging Face model's. Prints a JSON summary
(also to $OUT/megatron_check.json when $OUT is set); exit status 0 = passed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for pkg in ("rollart-core", "rollart-train"):
    sys.path.insert(0, str(ROOT / "packages" / pkg / "src"))


def write_tiny_qwen2(
    path: Path,
    *,
    vocab: int = 512,
    hidden: int = 256,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    ffn: int = 512,
    seed: int = 0,
) -> dict[str, torch.Tensor]:  # noqa: F821
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    hd = hidden // heads

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.02

    t = {
        "model.embed_tokens.weight": w(vocab, hidden),
        "model.norm.weight": torch.ones(hidden),
        "lm_head.weight": w(vocab, hidden),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        t |= {
            p + "input_layernorm.weight": 1 + w(hidden),
            p + "post_attention_layernorm.weight": 1 + w(hidden),
            p + "self_attn.q_proj.weight": w(heads * hd, hidden),
            p + "self_attn.q_proj.bias": w(heads * hd),
            p + "self_attn.k_proj.weight": w(kv_heads * hd, hidden),
            p + "self_attn.k_proj.bias": w(kv_heads * hd),
            p + "self_attn.v_proj.weight": w(kv_heads * hd, hidden),
            p + "self_attn.v_proj.bias": w(kv_heads * hd),
            p + "self_attn.o_proj.weight": w(hidden, heads * hd),
            p + "mlp.gate_proj.weight": w(ffn, hidden),
            p + "mlp.up_proj.weight": w(ffn, hidden),
            p + "mlp.down_proj.weight": w(hidden, ffn),
        }
    path.mkdir(parents=True, exist_ok=True)
    save_file(t, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "pad_token_id": 0,
        "torch_dtype": "float32",
    }
    (path / "config.json").write_text(json.dumps(cfg))
    return t


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    args = ap.parse_args()
    missing = [m for m in ("torch", "megatron.core", "pydantic", "safetensors") if not _importable(m)]
    if missing:
        print(
            f"missing modules {missing}: pip install megatron-core==0.16.1 pydantic safetensors",
            file=sys.stderr,
        )
        return 2
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        print("no CUDA GPU", file=sys.stderr)
        return 2
    from rollart_core.types import Trajectory, Turn
    from rollart_train.megatron_trainer import MegatronTrainer, MegatronTrainerConfig

    result: dict[str, object] = {
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0),
        "tp": args.tp,
        "pp": args.pp,
    }
    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="rollart-mcore-"))
    hf = write_tiny_qwen2(tmp / "tiny")
    trainer = MegatronTrainer(
        MegatronTrainerConfig(
            tensor_parallel=args.tp, pipeline_parallel=args.pp, lr=1e-4, micro_batch_size=2, bf16=True
        ),
        model_path=tmp / "tiny",
    )
    result["build_s"] = time.perf_counter() - t0
    rank0 = dist.get_rank() == 0
    before = dict(trainer.named_weights())
    checks: dict[str, bool] = {}
    if rank0:
        checks["names"] = set(before) == set(hf)
        checks["shapes"] = all(before[k].shape == hf[k].shape for k in hf)
        checks["values_bf16"] = all(
            torch.allclose(before[k].float(), hf[k], atol=1e-2, rtol=1e-2) for k in hf
        )

    g = torch.Generator().manual_seed(1)

    def batch(version: int, shift: float) -> list[Trajectory]:
        out = []
        for i in range(8):
            ctx = torch.randint(1, 500, (6 + i,), generator=g).tolist()
            gen = torch.randint(1, 500, (4 + i % 3,), generator=g).tolist()
            lps = trainer.logprobs(ctx + gen)[-len(gen) :] if args.pp == 1 else [-6.0] * len(gen)
            out.append(
                Trajectory(
                    traj_id=f"t{i}",
                    task="t",
                    env_id="e",
                    group_id=f"g{i % 2}",
                    seed=i,
                    start_version=version,
                    reward=float(i % 3),
                    turns=[
                        Turn(
                            context_ids=ctx,
                            output_ids=gen,
                            output_logprobs=[x - shift for x in lps],
                            output_versions=[version] * len(gen),
                        )
                    ],
                )
            )
        return out

    if "transformers" in sys.modules or _importable("transformers"):
        from transformers import AutoModelForCausalLM

        ref = AutoModelForCausalLM.from_pretrained(tmp / "tiny", dtype=torch.float32).cuda().eval()
        ids = torch.randint(1, 500, (1, 24), generator=g)
        with torch.no_grad():
            lp_hf = (
                torch.log_softmax(ref(input_ids=ids.cuda()).logits[0, :-1].float(), -1)
                .gather(-1, ids[0, 1:].cuda()[:, None])[:, 0]
                .cpu()
            )
        if args.pp == 1:
            lp_mc = torch.tensor(trainer.logprobs(ids[0].tolist()))
            result["hf_logprob_max_abs_diff"] = float((lp_hf - lp_mc).abs().max())
            checks["matches_hf_bf16"] = result["hf_logprob_max_abs_diff"] < 0.1

    m1 = trainer.train_step(batch(0, 0.0))
    trainer.config = trainer.config.model_copy(update={"loss": "decoupled_ppo", "tis_cap": 2.0})
    m2 = trainer.train_step(batch(0, 0.2))  # trainer now at version 1: every token is one version stale
    after = dict(trainer.named_weights())
    result["step1"], result["step2"] = m1, m2
    checks["finite"] = all(math.isfinite(v) for m in (m1, m2) for v in m.values())
    checks["version"] = trainer.version == 2
    checks["updated"] = bool(m1["update_successful"]) and bool(m2["update_successful"])
    checks["proximal_recomputed"] = m2["proximal_recomputed"] == 1.0 or not rank0
    if rank0:
        delta = max(float((after[k].float() - before[k].float()).abs().max()) for k in before)
        result["max_weight_delta"] = delta
        checks["weights_moved"] = delta > 0
    trainer.save(tmp / "ckpt")
    checks["checkpoint"] = (tmp / "ckpt" / "model.safetensors").is_file() or not rank0
    result["checks"] = checks
    result["passed"] = all(checks.values())
    result["total_s"] = time.perf_counter() - t0
    if rank0:
        text = json.dumps(result, indent=1, default=str)
        print(text)
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], "megatron_check.json").write_text(text)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if result["passed"] else 1


def _importable(mod: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(mod) is not None
    except ModuleNotFoundError:
        return False


if __name__ == "__main__":
    sys.exit(main())
