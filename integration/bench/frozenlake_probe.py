"""Supervised probe: can the tiny policy *read* a FrozenLake map in a given prompt format and size?

    uv run --no-sync python integration/bench/frozenlake_probe.py [--quick] [--minutes 2]

No RL and no vLLM: (prompt, best actions) pairs are generated from fresh solvable random 4x4 maps
(20% holes, the task of the learning run), the label set being every action that moves the player
one step closer to G along a safe shortest path (BFS). Each (format, model size) variant trains a
randomly initialised Qwen2 (head_dim 64, as vLLM's CPU kernel needs) with cross-entropy on the
action distribution restricted to ``L D R U`` (loss ``-log sum_{a in best} p(a)``) for the same
wall-clock budget, then reports held-out accuracy (argmax is a best action, on maps never trained
on) and the success rate of rolling out the greedy and the sampled (temperature 1) policy.
It tells whether a plateau of the RL run is the model's reading of the prompt or the algorithm.

Formats (all keep the whole map in the prompt; ``P`` marks the player, ``S`` the start, ``G`` the goal):
- ``history``: what the runner builds by default, every earlier observation and action before the
  current one (states from rollouts of a noisy shortest-path policy);
- ``last``: the current observation only (Markov), with the environment's system prompt;
- ``last_coords``: ``last`` plus a line ``row r col c`` naming the player's cell;
- suffix ``_nosys``: without the system prompt (60 of the 88 tokens of a ``last`` prompt).

Writes ``probe.json`` into ``--out`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

from rollart_env.frozenlake import ACTIONS, FrozenLakeEnv, generate_map

SIZE, HOLE_PROB, MAX_STEPS = 4, 0.2, 12
ACTION_LIST = list(ACTIONS)


def distances(rows: list[str]) -> dict[tuple[int, int], int]:
    """BFS distance to G of every cell from which G is reachable without holes."""
    n = len(rows)
    goal = (n - 1, n - 1)
    dist = {goal: 0}
    frontier = [goal]
    while frontier:
        nxt = []
        for r, c in frontier:
            for dr, dc in ACTIONS.values():
                rr, cc = r + dr, c + dc
                if 0 <= rr < n and 0 <= cc < n and rows[rr][cc] != "H" and (rr, cc) not in dist:
                    dist[(rr, cc)] = dist[(r, c)] + 1
                    nxt.append((rr, cc))
        frontier = nxt
    return dist


def move(pos: tuple[int, int], a: str) -> tuple[int, int]:
    dr, dc = ACTIONS[a]
    return (min(max(pos[0] + dr, 0), SIZE - 1), min(max(pos[1] + dc, 0), SIZE - 1))


def best_actions(rows: list[str], pos: tuple[int, int]) -> list[int]:
    d = distances(rows)
    return [i for i, a in enumerate(ACTION_LIST) if d.get(move(pos, a), 99) == d[pos] - 1]


def render(rows: list[str], pos: tuple[int, int]) -> str:
    out = []
    for r, row in enumerate(rows):
        cells = list(row)
        if r == pos[0]:
            cells[pos[1]] = "P"
        out.append("".join(cells))
    return "\n".join(out)


class Prompts:
    def __init__(self, model_path: Path) -> None:
        from rollart_proxy.chat import ChatMLFormat

        self.chat = ChatMLFormat(model_path)
        self.action_ids = self.chat.action_token_ids(ACTION_LIST)
        self.vocab_size = json.loads((Path(model_path) / "config.json").read_text())["vocab_size"]

    def example(self, fmt: str, rng: random.Random) -> tuple[list[int], list[int]]:
        """One (prompt ids, best action indices) pair of format ``fmt`` on a fresh map."""
        rows = generate_map(SIZE, HOLE_PROB, rng)
        if fmt.startswith("history"):
            # a noisy shortest-path rollout; the example is a random turn of it
            d = distances(rows)
            pos, hist = (0, 0), []
            for _ in range(MAX_STEPS - 1):
                best = best_actions(rows, pos)
                a = ACTION_LIST[rng.choice(best)] if rng.random() < 0.7 else rng.choice(ACTION_LIST)
                nxt = move(pos, a)
                if rows[nxt[0]][nxt[1]] in "HG" or nxt not in d:
                    break
                hist.append((pos, a))
                pos = nxt
            k = rng.randrange(len(hist) + 1)
            cur = hist[k][0] if k < len(hist) else pos
            return self.prompt(fmt, rows, hist[:k], cur), best_actions(rows, cur)
        d = distances(rows)
        cells = [p for p in d if p != (SIZE - 1, SIZE - 1)]
        pos = rng.choice(cells)
        return self.prompt(fmt, rows, [], pos), best_actions(rows, pos)

    def prompt(
        self, fmt: str, rows: list[str], history: list[tuple[tuple[int, int], str]], pos: tuple[int, int]
    ) -> list[int]:
        """The prompt of a greedy rollout's current turn (history: earlier (pos, action) pairs)."""
        sys_prompt = None if fmt.endswith("_nosys") else FrozenLakeEnv.system_prompt
        fmt = fmt.removesuffix("_nosys")
        if fmt == "history":
            if not history:
                return self.chat.first_turn(sys_prompt, render(rows, pos))
            ids = self.chat.first_turn(sys_prompt, render(rows, history[0][0]))
            seen = [p for p, _ in history[1:]] + [pos]
            for (_, a), p in zip(history, seen, strict=True):
                out = [self.action_ids[ACTION_LIST.index(a)]]
                ids += out + self.chat.next_turn(render(rows, p), out)
            return ids
        text = render(rows, pos)
        if fmt == "last_coords":
            text += f"\nrow {pos[0]} col {pos[1]}"
        elif fmt != "last":
            raise ValueError(f"unknown format {fmt!r}")
        return self.chat.first_turn(sys_prompt, text)


def make_model(layers: int, hidden: int, vocab: int, seed: int) -> Any:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    heads = hidden // 64
    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(heads // 2, 1),
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        rope_theta=10000.0,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(cfg).float()


def batch_logits(model: Any, prompts: list[list[int]], action_ids: list[int]) -> Any:
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    att = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p)
        att[i, : len(p)] = 1
    hidden = model.model(input_ids=ids, attention_mask=att).last_hidden_state
    last = hidden[torch.arange(len(prompts)), torch.tensor([len(p) - 1 for p in prompts])]
    return model.lm_head(last)[:, action_ids]  # [B, 4], the restricted logits


def rollout_success(model: Any, pr: Prompts, fmt: str, seeds: list[int], greedy: bool) -> float:
    import torch

    wins = 0
    with torch.no_grad():
        for s in seeds:
            rows = generate_map(SIZE, HOLE_PROB, random.Random(s))
            pos, hist = (0, 0), []
            for _ in range(MAX_STEPS):
                logits = batch_logits(model, [pr.prompt(fmt, rows, hist, pos)], pr.action_ids)[0]
                if greedy:
                    a = ACTION_LIST[int(logits.argmax())]
                else:
                    a = ACTION_LIST[int(torch.multinomial(torch.softmax(logits, -1), 1))]
                hist.append((pos, a))
                pos = move(pos, a)
                if rows[pos[0]][pos[1]] in "HG":
                    break
            wins += rows[pos[0]][pos[1]] == "G"
    return wins / len(seeds)


def run_variant(
    pr: Prompts,
    fmt: str,
    layers: int,
    hidden: int,
    seconds: float,
    batch: int,
    lr: float,
    n_test: int,
    n_rollouts: int,
    max_steps: int | None = None,
) -> dict[str, Any]:
    import torch

    model = make_model(layers, hidden, pr.vocab_size, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    rng = random.Random(1)
    test_rng = random.Random(10_000_019)
    test = [pr.example(fmt, test_rng) for _ in range(n_test)]
    t0, steps, losses = time.perf_counter(), 0, []
    model.train()
    while (steps < max_steps) if max_steps else (time.perf_counter() - t0 < seconds):
        data = [pr.example(fmt, rng) for _ in range(batch)]
        logits = batch_logits(model, [p for p, _ in data], pr.action_ids)
        logp = torch.log_softmax(logits, -1)
        target = torch.zeros_like(logp, dtype=torch.bool)
        for i, (_, best) in enumerate(data):
            target[i, best] = True
        loss = -torch.logsumexp(logp.masked_fill(~target, float("-inf")), -1).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        steps += 1
        losses.append(loss.item())
    train_s = time.perf_counter() - t0
    model.eval()
    with torch.no_grad():
        correct = 0
        for i in range(0, len(test), 64):
            chunk = test[i : i + 64]
            pred = batch_logits(model, [p for p, _ in chunk], pr.action_ids).argmax(-1).tolist()
            correct += sum(p in best for p, (_, best) in zip(pred, chunk, strict=True))
    seeds = list(range(900_000, 900_000 + n_rollouts))
    return {
        "format": fmt,
        "layers": layers,
        "hidden": hidden,
        "train_s": train_s,
        "steps": steps,
        "examples": steps * batch,
        "final_loss": sum(losses[-20:]) / max(len(losses[-20:]), 1),
        "heldout_accuracy": correct / len(test),
        "greedy_success": rollout_success(model, pr, fmt, seeds, greedy=True),
        "sampled_success": rollout_success(model, pr, fmt, seeds, greedy=False),
        "prompt_tokens": sum(len(p) for p, _ in test) / len(test),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=".rollart/models/tiny-qwen2-cells", help="only its tokenizer is used")
    ap.add_argument("--variants", default="last:2x256,last_coords:2x256,history:2x256,last:4x256,last:2x512")
    ap.add_argument("--minutes", type=float, default=2.0, help="training budget per variant")
    ap.add_argument(
        "--steps",
        type=int,
        default=None,
        help="train exactly this many steps per variant instead (robust on a busy machine)",
    )
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="runs/probe")
    ap.add_argument("--quick", action="store_true", help="20 s per variant, two variants")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    model_path = Path(args.model)
    if not model_path.exists():
        from rollart_train.tiny import create_tiny_model

        create_tiny_model(model_path)
    if args.quick:
        args.minutes, args.variants = 1 / 3, "last:2x256,history:2x256"
    pr = Prompts(model_path)
    rows = []
    for v in args.variants.split(","):
        fmt, size = v.split(":")
        layers, hidden = (int(x) for x in size.split("x"))
        r = run_variant(
            pr,
            fmt,
            layers,
            hidden,
            args.minutes * 60,
            args.batch,
            args.lr,
            n_test=256 if args.quick else 1024,
            n_rollouts=50 if args.quick else 200,
            max_steps=args.steps,
        )
        rows.append(r)
        print(
            f"{fmt:<12} {layers}x{hidden:<4} steps={r['steps']:>5} loss={r['final_loss']:.3f} "
            f"acc={r['heldout_accuracy']:.3f} greedy={r['greedy_success']:.3f} "
            f"sampled={r['sampled_success']:.3f} tokens={r['prompt_tokens']:.0f}",
            flush=True,
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "probe.json").write_text(
        json.dumps({"minutes_per_variant": args.minutes, "variants": rows}, indent=2)
    )
    print(f"\n{'format':<12} {'size':<6} {'steps':>6} {'accuracy':>9} {'greedy':>7} {'sampled':>8}")
    for r in rows:
        print(
            f"{r['format']:<12} {r['layers']}x{r['hidden']:<4} {r['steps']:>6} {r['heldout_accuracy']:>9.3f} "
            f"{r['greedy_success']:>7.3f} {r['sampled_success']:>8.3f}"
        )
    print(f"wrote {out / 'probe.json'}")


if __name__ == "__main__":
    main()
