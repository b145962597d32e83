"""The generation part of ``real_model.py`` (its part 3, and the engine's weight update of part 4): rollart's
``VllmEngine`` against vLLM's offline ``LLM.generate`` on the same prompt ids and sampling, each side in a
child process of its own (``python real_model_gen.py --child KIND ARGS OUT``). ``real_model.py``'s
docstring says what is measured and how."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from real_model import LORA_RANK, STEP_S, encode_chats, nbytes


def gen_prompts(model_dir: Path, n: int) -> list[list[int]]:
    return [p for p, _ in encode_chats(model_dir, n, 1, seed=1)]


def _child_llm(args: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    prompts: list[list[int]] = args["prompts"]
    t0 = time.perf_counter()
    llm = LLM(
        model=args["model"],
        dtype="float32",
        max_model_len=args["max_model_len"],
        max_num_seqs=args["max_num_seqs"],
        enforce_eager=True,
        seed=0,
    )
    start_s = time.perf_counter() - t0

    def params(i: int, max_tokens: int) -> Any:
        return SamplingParams(
            max_tokens=max_tokens, temperature=1.0, seed=i, ignore_eos=True, logprobs=0, detokenize=False
        )

    def run(max_tokens: int) -> tuple[float, int]:
        t0 = time.perf_counter()
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            [params(i, max_tokens) for i in range(len(prompts))],
            use_tqdm=False,
        )
        return time.perf_counter() - t0, sum(len(o.outputs[0].token_ids) for o in outs)

    run(4)  # warm-up
    timed = [run(args["max_tokens"]) for _ in range(args["repeats"])]
    return {"start_s": start_s, "runs": [{"s": s, "tokens": n} for s, n in timed]}


async def _engine_updates(
    engine: Any, store: Any, state: dict[str, Any], updates: int, prompts: list[list[int]]
) -> dict[str, Any]:
    """``updates`` weight versions pushed to ``store`` and loaded by ``engine`` while 8 requests generate."""
    from rollart_core.types import GenerateRequest, SamplingParams

    stop = asyncio.Event()

    async def rollout(i: int) -> None:
        n = 0
        while not stop.is_set():
            await engine.generate(
                GenerateRequest(f"u{i}-{n}", prompts[i % len(prompts)], SamplingParams(max_tokens=32, seed=n))
            )
            n += 1

    workers = [asyncio.create_task(rollout(i)) for i in range(8)]
    push, prepare, pause = [], [], []
    try:
        await asyncio.sleep(1.0)
        base = await engine.weight_version()
        for v in range(base + 1, base + updates + 1):
            t0 = time.perf_counter()
            await asyncio.to_thread(lambda v=v: store.push(v, state).result(600))
            push.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            await engine.prefetch_weights(v)  # pull (+ stage / write the adapter), hidden behind generation
            prepare.append(time.perf_counter() - t0)
            pause.append(await engine.update_weights(v))
    finally:
        stop.set()
        await asyncio.gather(*workers, return_exceptions=True)
    return {
        "bytes": nbytes(state),
        "updates": updates,
        "push_s": statistics.median(push),
        "prepare_s_hidden": statistics.median(prepare),
        "pause_s": statistics.median(pause),
        "pause_s_all": pause,
        "pause_share_of_step": statistics.median(pause) / STEP_S,
    }


async def _child_engine_async(args: dict[str, Any]) -> dict[str, Any]:
    from rollart_core.types import GenerateRequest, SamplingParams
    from rollart_proxy.engines.vllm_engine import VllmEngine, VllmEngineConfig
    from rollart_proxy.engines.vllm_lora import VllmLoraConfig
    from rollart_weightsync import FilesystemWeightStore, FilesystemWeightStoreConfig

    class IgnoreEosEngine(VllmEngine):
        def _sampling(self, request: GenerateRequest) -> Any:
            sp = super()._sampling(request)
            sp.ignore_eos = True  # rollart's SamplingParams has no ignore_eos; vLLM applies it per request
            return sp

    prompts: list[list[int]] = args["prompts"]
    lora = args.get("lora_adapter")
    with tempfile.TemporaryDirectory() as d:
        store = FilesystemWeightStore(FilesystemWeightStoreConfig(root=Path(d), keep_last=1))
        engine = IgnoreEosEngine(
            VllmEngineConfig(
                dtype="float32",
                max_model_len=args["max_model_len"],
                max_num_seqs=args["max_num_seqs"],
                lora=VllmLoraConfig(max_lora_rank=LORA_RANK) if lora else None,
            ),
            model_path=args["model"],
            weight_store=store,
            name="bench",
        )
        t0 = time.perf_counter()
        await engine.start()
        start_s = time.perf_counter() - t0
        out: dict[str, Any] = {"start_s": start_s}
        try:

            async def run(max_tokens: int, tag: str) -> tuple[float, int]:
                t0 = time.perf_counter()
                outs = await asyncio.gather(
                    *(
                        engine.generate(
                            GenerateRequest(
                                f"{tag}-{i}",
                                p,
                                SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i),
                            )
                        )
                        for i, p in enumerate(prompts)
                    )
                )
                return time.perf_counter() - t0, sum(len(o.token_ids) for o in outs)

            if not lora:
                await run(4, "warm")
                timed = [await run(args["max_tokens"], f"r{k}") for k in range(args["repeats"])]
                out["runs"] = [{"s": s, "tokens": n} for s, n in timed]
            if args.get("updates"):
                from safetensors.torch import load_file

                if lora:
                    state = load_file(lora)
                else:
                    state = {
                        k: t.float()
                        for k, t in load_file(str(Path(args["model"]) / "model.safetensors")).items()
                    }
                out["update"] = await _engine_updates(engine, store, state, args["updates"], prompts)
                # a new adapter only changes what new requests carry: vLLM's scheduler never pauses
                out["update"]["generation_paused"] = not lora
        finally:
            await engine.shutdown()
            store.close()
    return out


def run_child(kind: str, args: dict[str, Any], timeout: float = 1800) -> dict[str, Any]:
    """This script in a child process (vLLM engines never share a process here); its result as JSON."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(args, f)
    result = Path(f.name + ".out")
    try:
        proc = subprocess.Popen([sys.executable, __file__, "--child", kind, f.name, str(result)], env=env)
        try:
            rc = proc.wait(timeout)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        if rc != 0 or not result.exists():
            raise RuntimeError(f"child {kind} failed with exit code {rc}")
        return dict(json.loads(result.read_text()))
    finally:
        Path(f.name).unlink(missing_ok=True)
        result.unlink(missing_ok=True)


def bench_generation(
    model_dir: Path,
    prompts: int,
    max_tokens: int,
    repeats: int,
    order: str,
    updates: int,
    lora_adapter: str | None,
) -> dict[str, Any]:
    ids = gen_prompts(model_dir, prompts)
    common = {
        "model": str(model_dir),
        "prompts": ids,
        "max_tokens": max_tokens,
        "repeats": repeats,
        "max_model_len": 512,
        "max_num_seqs": 64,
    }
    rounds: dict[str, list[dict[str, Any]]] = {"vllm_llm": [], "rollart_engine": []}
    update = None
    for k, side in enumerate(order):
        if side == "A":
            res = run_child("llm", common)
            rounds["vllm_llm"].append(res)
        else:
            last_engine = k == max(i for i, s in enumerate(order) if s == "B")
            res = run_child("engine", {**common, "updates": updates if last_engine else 0})
            update = res.pop("update", update)
            rounds["rollart_engine"].append(res)
        print(
            f"  {'vLLM LLM.generate' if side == 'A' else 'rollart VllmEngine'}: "
            + ", ".join(f"{r['tokens'] / r['s']:.1f} tok/s" for r in res["runs"]),
            flush=True,
        )
    best = {side: max(r["tokens"] / r["s"] for rr in rs for r in rr["runs"]) for side, rs in rounds.items()}
    out: dict[str, Any] = {
        "prompts": prompts,
        "max_tokens": max_tokens,
        "prompt_tokens_mean": statistics.mean(len(p) for p in ids),
        "order": order,
        "rounds": rounds,
        "vllm_llm_tokens_per_s": best["vllm_llm"],
        "rollart_engine_tokens_per_s": best["rollart_engine"],
        "ratio": best["rollart_engine"] / best["vllm_llm"],
        "per_round_ratios": [
            max(r["tokens"] / r["s"] for r in b["runs"]) / max(r["tokens"] / r["s"] for r in a["runs"])
            for a, b in zip(rounds["vllm_llm"], rounds["rollart_engine"], strict=False)
        ],
    }
    if update is not None:
        out["engine_update_full_fp32"] = update
    if lora_adapter and updates:
        res = run_child("engine", {**common, "updates": updates, "lora_adapter": lora_adapter})
        out["engine_update_lora"] = res["update"]
        out["engine_update_lora"]["start_s"] = res["start_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--child", nargs=3, required=True, metavar=("KIND", "ARGS_JSON", "OUT_JSON"))
    kind, arg_file, out_file = ap.parse_args().child
    child_args = json.loads(Path(arg_file).read_text())
    res = _child_llm(child_args) if kind == "llm" else asyncio.run(_child_engine_async(child_args))
    Path(out_file).write_text(json.dumps(res))


if __name__ == "__main__":
    main()
