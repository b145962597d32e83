"""A calculator agent written with the plain ``openai`` SDK, trained by rollart as is.

The user asks e.g. ``"7 minus 3"``. The agent gives the model one tool, ``calc(a, op, b)``, and makes
it call that tool (``tool_choice`` names it). The tool's schema keeps the arguments valid the usual
way, with ``enum``s: the agent has read the operands from the question, so ``a`` and ``b`` are enums of
one value each (the first and the second number), and ``op`` is one of ``+ - *``: the model's part is
the operator, read from the question's word. The agent runs the tool and answers with its result; the
reward is 1 when that is the question's value, so a random model is right one time in three.

rollart's endpoint enforces a named ``tool_choice`` over ``enum`` arguments by writing the call in
the model's own format and letting the model choose each undecided argument among its values
(``rollart_proxy.server.forced_call``: one engine call for ``op``, restricted to the three tokens;
the one-value operands are written as fixed text), so the trajectory trains exactly that choice.
(Operands left to the model too, ``a`` and ``b`` each an enum of both numbers, make a random model
right one time in seven; a pure-torch probe of that task did not learn in 15 steps of 64 episodes.)

rollart calls ``solve(client, task)`` once per episode with an ``AsyncOpenAI`` client bound to the
trajectory's session; every call is recorded (ids, logprobs, versions) and trained on.
``make_task(seed)`` gives each episode its problem (``env.options.task_data_fn``).
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

from rollart_env.agent import AgentResult, AgentTask
from rollart_env.calculator import evaluate, format_number

WORDS = {"+": "plus", "-": "minus", "*": "times"}


def make_task(seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    op = rng.choice("+-*")
    a, b = rng.sample(range(2, 10), 2)
    if op == "-" and a < b:
        a, b = b, a  # no negative answers
    return {"question": f"{a} {WORDS[op]} {b}", "value": format_number(evaluate(f"{a} {op} {b}"))}


def calc_tool(a: str, b: str) -> dict[str, Any]:
    """The tool's schema, kept short: the tiny model's tokenizer spends about a token per character
    of it, in every prompt."""
    return {
        "type": "function",
        "function": {
            "name": "calc",
            "parameters": {
                "type": "object",
                "properties": {"a": {"enum": [a]}, "op": {"enum": list(WORDS)}, "b": {"enum": [b]}},
            },
        },
    }


async def solve(client: Any, task: AgentTask) -> AgentResult:
    question = task.data["question"]
    a, b = re.findall(r"\d+", question)
    reply = await client.chat.completions.create(
        model=task.model,
        messages=[{"role": "user", "content": question}],
        tools=[calc_tool(a, b)],
        tool_choice={"type": "function", "function": {"name": "calc"}},
        max_tokens=task.max_tokens,
        temperature=task.temperature,
    )
    call = reply.choices[0].message.tool_calls[0]
    args = json.loads(call.function.arguments)
    answer = format_number(evaluate(f"{args['a']} {args['op']} {args['b']}"))
    ok = answer == task.data["value"]
    return AgentResult(answer=answer, reward=float(ok), info={"success": ok, "call": args})
