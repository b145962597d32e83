"""The calculator agent of ``calculator_agent.py``, written against the **Anthropic Messages** API.

The same task and tool (``calc(a, op, b)``, the operands enums of one value, ``op`` one of ``+ - *``),
asked with ``client.messages.create`` of the ``anthropic`` SDK (the env's ``sdk: anthropic`` hands the
agent an ``AsyncAnthropic`` client): a tool with an ``input_schema``, ``tool_choice`` of type ``tool``,
the call read back from the ``tool_use`` content block. rollart's endpoint maps the request onto the
same chat-template rendering as Chat Completions, so the recorded trajectory (the model's choice of
operator) is the one the Chat Completions agent trains.

``task_data_fn`` is ``calculator_agent.py:make_task`` (examples/agent_calculator_messages.yaml).
"""

from __future__ import annotations

import re
from typing import Any

from rollart_env.agent import AgentResult, AgentTask
from rollart_env.calculator import evaluate, format_number

OPS = ["+", "-", "*"]


def calc_tool(a: str, b: str) -> dict[str, Any]:
    """A Messages tool: its JSON schema is ``input_schema``."""
    return {
        "name": "calc",
        "input_schema": {
            "type": "object",
            "properties": {"a": {"enum": [a]}, "op": {"enum": OPS}, "b": {"enum": [b]}},
        },
    }


async def solve(client: Any, task: AgentTask) -> AgentResult:
    question = task.data["question"]
    a, b = re.findall(r"\d+", question)
    message = await client.messages.create(
        model=task.model,
        max_tokens=task.max_tokens,
        messages=[{"role": "user", "content": question}],
        tools=[calc_tool(a, b)],
        tool_choice={"type": "tool", "name": "calc"},
        # anthropic 2.x has no temperature argument; rollart's endpoint reads it from the body
        extra_body={"temperature": task.temperature},
    )
    call = next(block for block in message.content if block.type == "tool_use")
    args = call.input  # already parsed: a dict
    answer = format_number(evaluate(f"{args['a']} {args['op']} {args['b']}"))
    ok = answer == task.data["value"]
    return AgentResult(answer=answer, reward=float(ok), info={"success": ok, "call": args})
