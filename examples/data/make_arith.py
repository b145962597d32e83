"""Generate the arithmetic data sets of the dataset examples: one-digit integer answers (no download).

    uv run --no-sync python examples/data/make_arith.py               # examples/data/arith.jsonl
    uv run --no-sync python examples/data/make_arith.py --kind sums   # examples/data/sums.jsonl

Each row: ``{"id", "prompt", "answer", "op", "a", "b"}``; the answer is an integer 0..9, so a policy
restricted to the ten digit tokens (``action_vocabulary`` + ``sampling.max_tokens: 1``) succeeds at
random one time in ten and a tiny random model has something to learn from. Every prompt is distinct;
the same ``--seed`` gives the same file.

- ``word`` (``arith.jsonl``, the hard variant): word problems of four kinds (+, -, *, /), two phrasings
  each, with names and items; the 2-layer tiny model did not learn it (``examples/dataset_math_hard.yaml``).
- ``sums`` (``sums.jsonl``, ``examples/dataset_math.yaml``): every one-digit sum ``a + b <= 9`` (55
  facts), each asked by each of eight names (``"Eve: 3 plus 4"``): 440 rows. A held-out row is a
  prompt never trained on; its fact is (almost always) trained under other names, so the held-out
  score measures reading the fact through an unseen prompt, not arithmetic on unseen numbers (the
  tiny model learns the table, it does not generalise addition: held out by fact, prototypes stayed near chance).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

NAMES = ["Ann", "Bob", "Cat", "Dan", "Eve", "Fay", "Gus", "Hal"]
ITEMS = ["apples", "pens", "cards", "coins", "books", "balls"]
TEMPLATES = {
    "+": [
        "{n} has {a} {i} and gets {b} more. How many {i} does {n} have?",
        "There are {a} {i} on a table and {b} on a chair. How many {i} are there?",
    ],
    "-": [
        "{n} has {a} {i} and gives {b} away. How many {i} are left?",
        "A box holds {a} {i}. {n} takes {b} out. How many {i} are in the box?",
    ],
    "*": [
        "{n} has {a} bags with {b} {i} in each. How many {i} does {n} have?",
        "There are {a} rows of {b} {i}. How many {i} are there?",
    ],
    "/": [
        "{n} shares {a} {i} equally among {b} friends. How many {i} does each friend get?",
        "{a} {i} are put into {b} equal piles. How many {i} are in each pile?",
    ],
}


def problem(rng: random.Random) -> dict[str, object]:
    """One problem; its answer is drawn first, uniform over 0..9, so no constant reply beats 1 in 10."""
    answer = rng.randint(0, 9)
    op = rng.choice("+-*/")
    if op == "+":
        a = rng.randint(0, answer)
        b = answer - a
    elif op == "-":
        a = rng.randint(answer, answer + 9)
        b = a - answer
    elif op == "*":
        if answer == 0:
            a, b = rng.randint(1, 9), 0
        else:
            a = rng.choice([d for d in range(1, answer + 1) if answer % d == 0])
            b = answer // a
    else:
        b = rng.randint(1, 9)
        a = answer * b
    text = rng.choice(TEMPLATES[op]).format(n=rng.choice(NAMES), i=rng.choice(ITEMS), a=a, b=b)
    return {"prompt": text, "answer": answer, "op": op, "a": a, "b": b}


def sums(rng: random.Random) -> list[dict[str, object]]:
    """Every one-digit sum, asked by every name, in a seeded order."""
    rows: list[dict[str, object]] = [
        {"prompt": f"{n}: {a} plus {b}", "answer": a + b, "op": "+", "a": a, "b": b}
        for a in range(10)
        for b in range(10 - a)
        for n in NAMES
    ]
    rng.shuffle(rows)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", choices=["word", "sums"], default="word")
    ap.add_argument("--rows", type=int, default=3000, help="rows of the word problems")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="default: arith.jsonl (word) / sums.jsonl (sums) here")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    out = args.out or Path(__file__).with_name("arith.jsonl" if args.kind == "word" else "sums.jsonl")
    if args.kind == "sums":
        rows = sums(rng)
    else:
        seen: set[object] = set()
        rows = []
        while len(rows) < args.rows:  # distinct prompts: a held-out row never repeats a training row
            row = problem(rng)
            if row["prompt"] not in seen:
                seen.add(row["prompt"])
                rows.append(row)
    prefix = "arith" if args.kind == "word" else "sums"
    with out.open("w", encoding="utf-8") as f:
        for k, row in enumerate(rows):
            f.write(json.dumps({"id": f"{prefix}-{k:05d}", **row}) + "\n")
    print(f"wrote {len(rows)} rows to {out}")


if __name__ == "__main__":
    main()
