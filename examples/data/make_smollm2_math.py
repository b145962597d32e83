"""Generate the arithmetic questions of ``examples/smollm2_math.yaml`` (no download).

    uv run --no-sync python examples/data/make_smollm2_math.py               # two-digit sums, differences
    uv run --no-sync python examples/data/make_smollm2_math.py --kind word   # multi-step word problems

Each row: ``{"id", "numbers", "prompt", "answer", "kind"}``. ``numbers`` is the sorted multiset of the
question's numbers: the example's held-out split is keyed on it (``id_key: numbers``), so every
question over the same numbers, in whatever words, falls on the same side, and a held-out question
never shares its numbers with a training one. The same ``--seed`` gives the same file.

- ``arith`` (``smollm2_math.jsonl``, the example's): one question per pair of numbers from 10 to 69
  (1,830), ``a + b`` or ``a - b`` in one of four phrasings, reply with only the number.
- ``word`` (``smollm2_word_math.jsonl``): two- and three-step word problems (``+``, ``-``, ``*``) over
  small numbers, told with names and items, solved step by step with a ``\\boxed{}`` answer. Too hard for
  SmolLM2-135M to learn from here (docs/benchmarks.md has its accuracy): kept to measure a bigger model.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path

NAMES = ["Ann", "Ben", "Cara", "Dev", "Ema", "Finn", "Gita", "Hugo", "Ines", "Jon", "Kim", "Leo"]
ITEMS = ["apples", "stickers", "marbles", "pencils", "cookies", "stamps", "shells", "cards"]

# (kind, template, answer, constraint). Names: n (the person), f (a friend), it (items).
Problem = tuple[str, str, Callable[[int, int, int], int], Callable[[int, int, int], bool]]
PROBLEMS: list[Problem] = [
    (
        "add-sub",
        "{n} has {a} {it}. {n} gets {b} more {it} and then gives {c} {it} to {f}. "
        "How many {it} does {n} have now?",
        lambda a, b, c: a + b - c,
        lambda a, b, c: c <= a + b,
    ),
    (
        "sub-add",
        "There are {a} {it} in a box. {n} takes out {b} {it} and then puts back {c} {it}. "
        "How many {it} are in the box now?",
        lambda a, b, c: a - b + c,
        lambda a, b, c: b <= a,
    ),
    (
        "mul-add",
        "{n} buys {a} packs of {it} with {b} {it} in each pack, and {f} gives {n} {c} more {it}. "
        "How many {it} does {n} have?",
        lambda a, b, c: a * b + c,
        lambda a, b, c: a <= 9 and b <= 9,
    ),
    (
        "mul-sub",
        "{n} has {a} bags with {b} {it} in each bag. {n} gives {c} {it} to {f}. "
        "How many {it} does {n} have left?",
        lambda a, b, c: a * b - c,
        lambda a, b, c: a <= 9 and b <= 9 and c <= a * b,
    ),
    (
        "add-add",
        "{n} has {a} {it}, {f} has {b} {it}, and their teacher has {c} {it}. "
        "How many {it} do they have together?",
        lambda a, b, c: a + b + c,
        lambda a, b, c: True,
    ),
    (
        "sub-sub",
        "{n} had {a} {it}. {n} gave {b} {it} to {f} and lost {c} {it}. How many {it} does {n} have now?",
        lambda a, b, c: a - b - c,
        lambda a, b, c: b + c <= a,
    ),
    (
        "double-add",
        "{f} has {a} {it}. {n} has twice as many {it} as {f}, plus {b} more. How many {it} does {n} have?",
        lambda a, b, c: 2 * a + b,
        lambda a, b, c: True,
    ),
    (
        "each-sub",
        "{n} has {a} {it} and gives {b} {it} to each of {c} friends. How many {it} does {n} have left?",
        lambda a, b, c: a - b * c,
        lambda a, b, c: b <= 9 and c <= 9 and b * c <= a,
    ),
]
INSTRUCTION = "Solve the problem step by step, then give the final answer as \\boxed{{number}}."
ARITH = {
    "+": [
        "What is {a} + {b}?",
        "Add {a} and {b}.",
        "Compute {a} plus {b}.",
        "What is the sum of {a} and {b}?",
    ],
    "-": [
        "What is {a} - {b}?",
        "Subtract {b} from {a}.",
        "Compute {a} minus {b}.",
        "What is {a} take away {b}?",
    ],
}
ARITH_INSTRUCTION = "Reply with only the number."


def arith_rows(n: int, seed: int) -> list[dict[str, object]]:
    """One question per pair of numbers (at most ``n``): its operation and phrasing drawn at random."""
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(10, 70) for b in range(a, 70)]
    rng.shuffle(pairs)
    rows: list[dict[str, object]] = []
    for small, big in pairs[:n]:
        op = rng.choice("+-")
        a, b = (big, small) if op == "-" or rng.random() < 0.5 else (small, big)
        prompt = f"{rng.choice(ARITH[op]).format(a=a, b=b)} {ARITH_INSTRUCTION}"
        answer = a + b if op == "+" else a - b
        rows.append(
            {
                "id": f"am-{len(rows):05d}",
                "numbers": f"{small}-{big}",
                "prompt": prompt,
                "answer": answer,
                "kind": op,
            }
        )
    return rows


def word_rows(n: int, seed: int) -> list[dict[str, object]]:
    rng = random.Random(seed)
    rows: list[dict[str, object]] = []
    seen: set[str] = set()
    while len(rows) < n:
        kind, template, answer, ok = rng.choice(PROBLEMS)
        a, b, c = rng.randint(2, 20), rng.randint(2, 20), rng.randint(2, 9)
        if not ok(a, b, c) or not 0 <= answer(a, b, c) <= 99:
            continue
        name, friend = rng.sample(NAMES, 2)
        text = template.format(n=name, f=friend, it=rng.choice(ITEMS), a=a, b=b, c=c)
        prompt = f"{text}\n{INSTRUCTION.format()}"
        if prompt in seen:
            continue
        seen.add(prompt)
        numbers = "-".join(str(x) for x in sorted((a, b, c)))
        rows.append(
            {
                "id": f"wm-{len(rows):05d}",
                "numbers": numbers,
                "prompt": prompt,
                "answer": answer(a, b, c),
                "kind": kind,
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kind", choices=["arith", "word"], default="arith")
    ap.add_argument("--rows", type=int, default=4000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    name = "smollm2_math.jsonl" if args.kind == "arith" else "smollm2_word_math.jsonl"
    out = args.out or Path(__file__).with_name(name)
    rows = arith_rows(args.rows, args.seed) if args.kind == "arith" else word_rows(args.rows, args.seed)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} rows to {out}")


if __name__ == "__main__":
    main()
