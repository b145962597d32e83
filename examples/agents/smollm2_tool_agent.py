"""A shopping agent for a real model (SmolLM2-135M-Instruct): it must write real tool calls itself.

Per episode a shop with its own prices (2..19 each) and one of three kinds of question:

- ``"How much does one lemon cost?"`` — look the price up;
- ``"What is 37 plus 58?"`` — add with the calculator;
- ``"How much do 7 lemons cost?"`` — look the price up, then multiply with the calculator.

The model has two tools, declared the usual OpenAI way and written into its prompt by rollart's
endpoint (SmolLM2's template has no tool section; Hermes-style ``<tool_call>{json}</tool_call>``,
parsed by vLLM's ``hermes`` parser):

- ``lookup_price(item)``: the shop's price of one item (prices change every episode, so the model
  cannot know them);
- ``calculator(expression)``: an arithmetic expression's value (``rollart_env.calculator``: exact,
  bounded, never raises).

Real tools are remote calls: ``task_data: {tool_latency_s: M, tool_latency_sigma: S}`` in the env's
options makes every call wait a log-normal delay (median M seconds), drawn from the episode's seed.

No tool choice is enforced and the arguments are free-form JSON: the agent runs each call the model
writes and sends the result back, for at most ``MAX_ROUNDS`` model calls. The reward is 1 when the
final reply's last number is the answer. A malformed or unknown call is the model's mistake: the
agent answers it with an error message as the tool's result, and an episode that never answers
scores 0.

The prompt holds one worked example of each kind (other items, numbers outside the tasks' ranges)
as earlier turns of the conversation: shown only the tool schemas, the 135M model wrote its calls
inside ``<tool_response>`` tags (the last tag it had seen) or wrote no call.

Held-out questions share no numbers with training ones (``make_train_task`` /
``make_heldout_task``: the split is keyed on the kind and the question's numbers, whatever the item).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import random
import re
from typing import Any

from rollart_env.agent import AgentResult, AgentTask
from rollart_env.calculator import ToolError, evaluate, format_number

ITEMS = [
    "apple",
    "banana",
    "lemon",
    "orange",
    "pear",
    "melon",
    "onion",
    "carrot",
    "egg",
    "cookie",
    "candle",
    "pencil",
    "notebook",
    "cup",
    "plate",
    "spoon",
    "towel",
    "sock",
    "hat",
    "ball",
    "kite",
    "book",
    "bottle",
    "lamp",
]  # fmt: skip  (plurals: the name and an s)
KINDS = ["price", "sum", "total"]
COUNTS = range(2, 10)
PRICES = range(2, 20)
MAX_ROUNDS = 4
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup_price",
            "description": "The shop's price of one item.",
            "parameters": {
                "type": "object",
                "properties": {"item": {"type": "string"}},
                "required": ["item"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "The value of an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    },
]


def worked_example(
    question: str, calls: list[tuple[str, dict[str, str], str]], answer: str, k: int
) -> list[Any]:
    """One solved question as earlier turns of the conversation: its tool calls, then the answer."""
    turns: list[dict[str, Any]] = [{"role": "user", "content": question}]
    for n, (name, args, result) in enumerate(calls):
        call_id = f"call_ex{k}{n}"
        call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
        turns += [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call_id, "content": result},
        ]
    return [*turns, {"role": "assistant", "content": answer}]


# one of each kind; items no task asks about, numbers outside every task's ranges
EXAMPLES = [
    *worked_example("How much does one mango cost?", [("lookup_price", {"item": "mango"}, "23")], "One mango costs 23.", 0),
    *worked_example("What is 131 plus 252?", [("calculator", {"expression": "131 + 252"}, "383")], "131 plus 252 is 383.", 1),
    *worked_example(
        "How much do 3 rulers cost?",
        [("lookup_price", {"item": "ruler"}, "24"), ("calculator", {"expression": "3 * 24"}, "72")],
        "3 rulers cost 72.",
        2,
    ),
]  # fmt: skip


def held_out(numbers: tuple[int, ...]) -> bool:
    """One question's numbers in eight are held out: a stable hash, the same on every machine."""
    return hashlib.sha256(repr(numbers).encode()).digest()[0] % 8 == 0


def _question(rng: random.Random) -> tuple[str, tuple[int, ...], int, str]:
    """``(kind, the question's numbers, the answer, the item asked about or "")``."""
    kind = rng.choice(KINDS)
    item = rng.choice(ITEMS)
    if kind == "sum":
        a, b = rng.randrange(10, 100), rng.randrange(10, 100)
        return kind, (a, b), a + b, ""
    price = rng.choice(PRICES)
    if kind == "price":
        return kind, (price,), price, item
    count = rng.choice(COUNTS)
    return kind, (count, price), count * price, item


def _make_task(seed: int, heldout: bool) -> dict[str, Any]:
    rng = random.Random(seed)
    while True:
        kind, numbers, value, item = _question(rng)
        if held_out((KINDS.index(kind), *numbers)) == heldout:
            break
    shop = {name: rng.choice(PRICES) for name in rng.sample(ITEMS, 4)}
    if kind == "sum":
        question = f"What is {numbers[0]} plus {numbers[1]}?"
    elif kind == "price":
        question, shop[item] = f"How much does one {item} cost?", numbers[0]
    else:
        question, shop[item] = f"How much do {numbers[0]} {item}s cost?", numbers[1]
    return {"question": question, "kind": kind, "numbers": list(numbers), "shop": shop, "value": value}


def make_train_task(seed: int) -> dict[str, Any]:
    return _make_task(seed, heldout=False)


def make_heldout_task(seed: int) -> dict[str, Any]:
    return _make_task(seed, heldout=True)


def run_tool(name: str, arguments: str, shop: dict[str, int]) -> str:
    """A call's result as the tool's message; a bad call gets an error text, never an exception."""
    try:
        args = json.loads(arguments)
    except json.JSONDecodeError:
        return "error: the arguments are not JSON"
    if not isinstance(args, dict):
        return "error: the arguments must be an object"
    if name == "lookup_price":
        item = str(args.get("item", "")).strip().lower()
        price = shop.get(item, shop.get(item.removesuffix("s")))
        return str(price) if price is not None else f"error: no item {item!r} in this shop"
    if name == "calculator":
        try:
            return format_number(evaluate(str(args.get("expression", "")), max_ops=8))
        except ToolError as e:
            return f"error: {e}"
    return f"error: no tool {name!r}"


def tool_delay(task: AgentTask, call: int) -> float:
    """Seconds the ``call``-th tool call of this episode takes: log-normal with median
    ``task_data.tool_latency_s`` (0, the default: instant) and spread ``tool_latency_sigma`` (1.0), drawn
    from the episode's seed, so runs that launch the same episodes wait on the same delays."""
    median = float(task.data.get("tool_latency_s", 0.0))
    if median <= 0:
        return 0.0
    sigma = float(task.data.get("tool_latency_sigma", 1.0))
    rng = random.Random(f"tool-latency/{task.seed}/{call}")
    return median * math.exp(sigma * rng.gauss(0.0, 1.0))


async def solve(client: Any, task: AgentTask) -> AgentResult:
    shop: dict[str, int] = task.data["shop"]
    messages: list[Any] = [*EXAMPLES, {"role": "user", "content": task.data["question"]}]
    reply = ""
    calls = errors = 0
    for _ in range(MAX_ROUNDS):
        r = await client.chat.completions.create(
            model=task.model,
            messages=messages,
            tools=TOOLS,
            max_tokens=task.max_tokens,
            temperature=task.temperature,
        )
        msg = r.choices[0].message
        if not msg.tool_calls:
            reply = msg.content or ""
            break
        messages.append(msg)
        for call in msg.tool_calls:
            await asyncio.sleep(tool_delay(task, calls))  # a real tool is a remote call
            result = run_tool(call.function.name, call.function.arguments, shop)
            calls += 1
            errors += result.startswith("error:")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    numbers = re.findall(r"-?\d+(?:\.\d+)?", reply)
    answer = numbers[-1] if numbers else None
    ok = answer is not None and float(answer) == task.data["value"]
    info = {"success": ok, "kind": task.data["kind"], "tool_calls": calls, "tool_errors": errors}
    return AgentResult(answer=answer, reward=float(ok), info=info)
