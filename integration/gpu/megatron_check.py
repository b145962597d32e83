"""GPU check: MegatronTrainer training steps on a tiny Qwen2-architecture model, in one process or as
the ranks of a worker group.

Needs torch, megatron-core (a wheel that can travel), pydantic, safetensors and PyYAML; no
transformers, no Ray (the ranks mode uses Ray only where it imports), no network. Run from the repository root:

    python integration/gpu/megatron_check.py                      # TP=1, PP=1, one process, bf16
    torchrun --nproc-per-node 2 integration/gpu/megatron_check.py --tp 2     # needs 2 GPUs
    python integration/gpu/megatron_check.py --ranks 2 --tp 2     # 2 ranks through MegatronRankWorker

In-process mode (no ``--ranks``; one CUDA GPU per process): it writes a random tiny Qwen2 checkpoint
(config.json + safetensors, head_dim 64), builds the trainer from it, checks that named_weights() gives
back the HF names and shapes it was loaded from (and the same values before training), takes a PPO-clip
step and a decoupled-PPO step on stale tokens, and checks that the loss is finite, the version advances
and the weights move. With transformers installed it also compares Megatron's logprobs with the
Hugging Face model's. Writes $OUT/megatron_check.json. ``--device cpu``: the same in float32 on CPU
(a dry run of the script).

Ranks mode (``--ranks N``): the ranks are built by ``rollart_train._rendezvous.start_rank_worker`` —
the function a RayTrainerGroup's rank actors call — as ``MegatronRankWorker``s, with the same
rendezvous (MASTER_ADDR/PORT, RANK, WORLD_SIZE). Launcher ``ray`` puts them in a RayTrainerGroup
(``worker: megatron``); ``spawn`` starts them with torch.multiprocessing and drives them over pipes
(``rollart_train._multirank.SpawnedRanks``), for machines where Ray cannot travel (the GPU machine);
``auto`` (default) takes Ray where it imports. It runs, in float32, a world of one (TP=1) and then the
N-rank group (``--tp``/``--pp``; DP = N / (TP x PP)) on the same batches, and checks: the gathered
weights are the HF weights exactly; logprobs, the two steps' loss / clip / KL and grad norm match the
world of one; the weights after two steps match it to within a tenth of the step's size; a checkpoint
after step 1 reloads (weights, version, optimizer state: ``optimizer_restored``) and gives step 2's
update again. With fewer GPUs than ranks the ranks share GPU 0 over gloo (NCCL refuses two ranks on one
device). ``--device cpu`` runs the same on CPU (gloo; Megatron's DDP / optimizer / schedule replaced by
``rollart_train._megatron_cpu``): a dry run of this script on a machine without a GPU. Writes
$OUT/megatron_check_ranks{N}_tp{T}_pp{P}.json; prints it.

Exit status 0 = passed, 1 = a check failed (the JSON says which, or the error with each rank's
traceback), 2 = missing modules or no GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from rollart_core.types import Trajectory

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
) -> dict[str, torch.Tensor]:
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


def make_batch(
    logprobs: Callable[[list[int]], list[float]] | None, g: torch.Generator, version: int, shift: float
) -> list[Trajectory]:
    """Eight trajectories in two groups whose behaviour logprobs are ``logprobs``' (shifted by
    ``shift``), or a constant where there is none (pipeline parallelism has no ``logprobs``)."""
    import torch

    from rollart_core.types import Trajectory, Turn

    out = []
    for i in range(8):
        ctx = torch.randint(1, 500, (6 + i,), generator=g).tolist()
        gen = torch.randint(1, 500, (4 + i % 3,), generator=g).tolist()
        lps = logprobs(ctx + gen)[-len(gen) :] if logprobs else [-6.0] * len(gen)
        turn = Turn(
            context_ids=ctx,
            output_ids=gen,
            output_logprobs=[x - shift for x in lps],
            output_versions=[version] * len(gen),
        )
        out.append(
            Trajectory(
                traj_id=f"t{i}",
                task="t",
                env_id="e",
                group_id=f"g{i % 2}",
                seed=i,
                start_version=version,
                reward=float(i % 3),
                turns=[turn],
            )
        )
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ranks", type=int, default=None, help="run N ranks through MegatronRankWorker")
    ap.add_argument("--launcher", choices=("auto", "ray", "spawn"), default="auto")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a dry run, float32")
    args = ap.parse_args()
    needed = ("torch", "megatron.core", "pydantic", "safetensors", "yaml")  # yaml: rollart_core's config
    missing = [m for m in needed if not _importable(m)]
    if missing:
        print(
            f"missing modules {missing}: pip install megatron-core==0.16.1 pydantic safetensors pyyaml",
            file=sys.stderr,
        )
        return 2
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU (--device cpu runs a dry run on CPU)", file=sys.stderr)
        return 2
    if args.ranks is not None:
        from megatron_ranks import run_ranks  # integration/gpu/megatron_ranks.py

        return run_ranks(args)
    return run_in_process(args)


def run_in_process(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from rollart_train.megatron_trainer import MegatronTrainer, MegatronTrainerConfig

    result: dict[str, object] = {
        "torch": torch.__version__,
        "device": args.device,
        "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
        "tp": args.tp,
        "pp": args.pp,
    }
    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="rollart-mcore-"))
    hf = write_tiny_qwen2(tmp / "tiny")
    trainer = MegatronTrainer(
        MegatronTrainerConfig(
            tensor_parallel=args.tp,
            pipeline_parallel=args.pp,
            lr=1e-4,
            micro_batch_size=2,
            device=args.device,
            bf16=args.device == "cuda",  # device: cpu trains in float32
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
        return make_batch(trainer.logprobs if args.pp == 1 else None, g, version, shift)

    if "transformers" in sys.modules or _importable("transformers"):
        from transformers import AutoModelForCausalLM

        dev = args.device
        ref = AutoModelForCausalLM.from_pretrained(tmp / "tiny", dtype=torch.float32).to(dev).eval()
        ids = torch.randint(1, 500, (1, 24), generator=g)
        with torch.no_grad():
            lp_hf = (
                torch.log_softmax(ref(input_ids=ids.to(dev)).logits[0, :-1].float(), -1)
                .gather(-1, ids[0, 1:].to(dev)[:, None])[:, 0]
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
    # a checkpoint path every rank shares (each torchrun rank made its own tmp above)
    ckpt = Path(tempfile.gettempdir(), f"rollart-mcore-ckpt-{os.environ.get('MASTER_PORT', os.getpid())}")
    trainer.save(ckpt)
    checks["checkpoint"] = (ckpt / "model.safetensors").is_file() and (ckpt / "megatron_optim").is_dir()
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
    shutil.rmtree(tmp, ignore_errors=True)
    if rank0:
        shutil.rmtree(ckpt, ignore_errors=True)
    return 0 if result["passed"] else 1


def _importable(mod: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(mod) is not None
    except ModuleNotFoundError:
        return False


if __name__ == "__main__":
    sys.exit(main())
