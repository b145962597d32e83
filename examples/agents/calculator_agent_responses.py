"""The calculator agent of ``calculator_agent.py``, written against the OpenAI **Responses** API.

The same task and tool (``calc(a, op, b)``, the operands enums of one value, ``op`` one of ``+ - *``),
asked with ``client.responses.create``: a function tool in the Responses shape, ``tool_choice`` naming
it, the call read back from the ``function_call`` output item. rollart's endpoint maps the request
onto the same chat-template rendering as Chat Completions, so the recorded trajectory (the model's
choice of operator) is the one the Chat Completions agent trains.

``task_data_fn`` is ``calculator_agent.py:make_task`` (examples/agent_calculator_responses.yaml).
"""

from __future__ import annotations

import json
import re
from typing import Any

from rollart_env.agent import AgentResult, AgentTask
from rollart_env.calculator import evaluate, format_number

OPS = ["+", "-", "*"]


def calc_tool(a: str, b: str) -> dict[str, Any]:
    """A Responses function tool: name and parameters at the top level (no ``function`` wrapper)."""
    return {
        "type": "function",
        "name": "calc",
        "parameters": {
            "type": "object",
            "properties": {"a": {"enum": [a]}, "op": {"enum": OPS}, "b": {"enum": [b]}},
        },
    }


async def solve(client: Any, task: AgentTask) -> AgentResult:
    question = task.data["question"]
    a, b = re.findall(r"\d+", question)
    response = await client.responses.create(
        model=task.model,
        input=question,
        tools=[calc_tool(a, b)],
        tool_choice={"type": "function", "name": "calc"},
        max_output_tokens=task.max_tokens,
        temperature=task.temperature,
        store=False,
    )
    call = next(item for item in response.output if item.type == "function_call")
    args = json.loads(call.arguments)
    answer = format_number(evaluate(f"{args['a']} {args['op']} {args['b']}"))
    ok = answer == task.data["value"]
    return AgentResult(answer=answer, reward=float(ok), info={"success": ok, "call": args})
