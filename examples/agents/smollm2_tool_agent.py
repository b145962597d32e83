"""A shopping agent for a real model (SmolLM2-135M-Instruct): it must write real tool calls itself.

Per episode a shop with its own prices (2..9 each) and a question, e.g. ``"How much do 7 lemons
cost?"``. The model has two tools, declared the usual OpenAI way and written into its prompt by
rollart's endpoint (SmolLM2's template has no tool section; Hermes-style ``<tool_call>{json}
</tool_call>``, parsed by vLLM's ``hermes`` parser):

- ``lookup_price(item)``: the shop's price of one item (prices change every episode, so the model
  cannot know them);
- ``calculator(expression)``: an arithmetic expression's value (``rollart_env.calculator``: exact,
  bounded, never raises).

No tool choice is enforced and the arguments are free-form JSON: the model looks the price up,
multiplies, and answers; the agent runs each call it writes and sends the result back, for at most
``MAX_ROUNDS`` model calls. The reward is 1 when the final reply's last number is the right total.
A malformed or unknown call is the model's mistake: the agent answers it with an error message as
the tool's result, and an episode that never answers scores 0.

The prompt holds three worked examples (other items, other numbers) as earlier turns of the
conversation: shown only the tool schemas, or one example, the 135M model wrote its calls inside
``<tool_response>`` tags (the last tag it had seen) when greedy; with three, some of its sampled
replies open a real ``<tool_call>``, which is what training has to make the rule.

Held-out questions share no (count, price) pair with training ones (``make_train_task`` /
``make_heldout_task``: the split is keyed on the pair, whatever the item).
"""

from __future__ import annotations

import hashlib
import json
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
COUNTS = range(2, 10)
PRICES = range(2, 10)
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


def worked_example(item: str, count: int, price: int, k: int) -> list[dict[str, Any]]:
    """One solved question as earlier turns of the conversation: look up, multiply, answer."""
    calls = [
        (f"call_ex{k}a", "lookup_price", {"item": item}, str(price)),
        (f"call_ex{k}b", "calculator", {"expression": f"{count} * {price}"}, str(count * price)),
    ]
    turns: list[dict[str, Any]] = [{"role": "user", "content": f"How much do {count} {item}s cost?"}]
    for call_id, name, args, result in calls:
        call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
        turns += [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call_id, "content": result},
        ]
    return [*turns, {"role": "assistant", "content": f"{count} {item}s cost {count * price}."}]


# items no task asks about, prices above any task's: the examples never answer a question
EXAMPLES = [
    turn
    for k, (item, count, price) in enumerate([("mango", 3, 11), ("ruler", 4, 12), ("glove", 5, 13)])
    for turn in worked_example(item, count, price, k)
]


def held_out(count: int, price: int) -> bool:
    """One (count, price) pair in eight is held out: a stable hash, the same on every machine."""
    return hashlib.sha256(f"{count}x{price}".encode()).digest()[0] % 8 == 0


def _make_task(seed: int, heldout: bool) -> dict[str, Any]:
    rng = random.Random(seed)
    while True:
        count, price = rng.choice(COUNTS), rng.choice(PRICES)
        if held_out(count, price) == heldout:
            break
    item = rng.choice(ITEMS)
    shop = {name: rng.choice(PRICES) for name in rng.sample(ITEMS, 4)}
    shop[item] = price
    return {
        "question": f"How much do {count} {item}s cost?",
        "shop": shop,
        "value": count * price,
    }


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
            result = run_tool(call.function.name, call.function.arguments, shop)
            calls += 1
            errors += result.startswith("error:")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    numbers = re.findall(r"-?\d+(?:\.\d+)?", reply)
    answer = numbers[-1] if numbers else None
    ok = answer is not None and float(answer) == task.data["value"]
    info = {"success": ok, "tool_calls": calls, "tool_errors": errors}
    return AgentResult(answer=answer, reward=float(ok), info=info)
