"""``real_model.py``'s printed tables (the JSON it writes holds every figure)."""

from __future__ import annotations

from typing import Any

from real_model import STEP_S


def print_tables(result: dict[str, Any]) -> None:
    tr = result.get("trainer")
    if tr:
        b = tr["batch"]
        pk = tr["peak_gflops"]
        print(
            f"\n1. Trainer: {b['sequences']} sequences, {b['tokens']} tokens ({b['loss_tokens']} reply tokens) a step; "
            f"median of {tr['steps']} steps after {tr['warmup_steps']} warm-up; matmul peak fp32 {pk['float32']:.1f}, "
            f"bf16 {pk['bfloat16']:.1f} GFLOP/s"
        )
        print(
            f"{'config':<18}{'step s':>9}{'tokens/s':>10}{'TFLOP/step':>11}{'GFLOP/s':>9}{'MFU':>7}   fwd / loss / bwd / optim / other"
        )
        for name, r in tr["runs"].items():
            sh = r["phase_share"]
            print(
                f"{name:<18}{r['step_s']:>9.2f}{r['tokens_per_s']:>10.1f}{r['flops_per_step'] / 1e12:>11.3f}"
                f"{r['model_tflops'] * 1e3:>9.1f}{100 * r['mfu']:>6.1f}%   "
                + " / ".join(
                    f"{100 * sh[k]:.0f}%" for k in ("forward", "loss", "backward", "optimizer", "other")
                )
            )
        for name, r in tr["runs"].items():
            if "profile" in r and r["mfu"] < 0.40:
                p = r["profile"]
                groups = ", ".join(
                    f"{g} {100 * v['share']:.0f}%"
                    for g, v in sorted(p["groups"].items(), key=lambda x: -x[1]["share"])
                )
                top = ", ".join(f"{o['op']} {100 * o['share']:.0f}%" for o in p["top_ops"][:5])
                print(f"  profile {name} (MFU {100 * r['mfu']:.1f}%): {groups}; top ops: {top}")
        print("\n2. Loss on the same batch, step by step (behaviour logprobs from the fp32 model):")
        for c in tr["loss_compare"]:
            print(f"  {c['reference']:<10}: " + " ".join(f"{x:+.6f}" for x in c["reference_losses"]))
            print(f"  {c['other']:<10}: " + " ".join(f"{x:+.6f}" for x in c["other_losses"]))
            print(
                f"  max |diff| {c['max_abs_diff']:.2e}; change over the run {c['reference_change']:+.2e} vs {c['other_change']:+.2e}"
            )
    g = result.get("generation")
    if g:
        print(
            f"\n3. Generation, float32, {g['prompts']} prompts x {g['max_tokens']} tokens (ignore_eos, T=1), order {g['order']}: "
            f"vLLM LLM.generate {g['vllm_llm_tokens_per_s']:.1f} tok/s, rollart VllmEngine {g['rollart_engine_tokens_per_s']:.1f} "
            f"tok/s: ratio {g['ratio']:.3f} (per round: "
            + ", ".join(f"{x:.3f}" for x in g["per_round_ratios"])
            + ")"
        )
    w = result.get("weights")
    if w:
        print(
            f"\n4. Weight update: best of {w['repeats']} push/pull rounds after {w['warmup']} warm-up rounds"
        )
        print(f"{'store':<12}{'payload':<12}{'MB':>8}{'push s':>9}{'pull s':>9}{'push+pull s':>13}")
        for r in w["stores"]:
            print(
                f"{r['store']:<12}{r['payload']:<12}{r['bytes'] / 1e6:>8.1f}{r['push_s']:>9.3f}{r['pull_s']:>9.3f}{r['push_s'] + r['pull_s']:>13.3f}"
            )
    if g:
        for key, label, what in (
            ("engine_update_full_fp32", "full fp32, staged", "pause"),
            ("engine_update_lora", "LoRA adapter", "switch (generation not paused)"),
        ):
            if key in g:
                u = g[key]
                print(
                    f"  engine update ({label}, filesystem store, {u['bytes'] / 1e6:.1f} MB, 8 requests generating): "
                    f"push {u['push_s']:.3f} s, pull+prepare {u['prepare_s_hidden']:.3f} s (hidden), {what} {u['pause_s']:.4f} s "
                    f"= {100 * u['pause_share_of_step']:.3f}% of a {STEP_S:.0f} s step"
                )
