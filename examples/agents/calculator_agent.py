"""A tool-using calculator agent written with the plain ``openai`` SDK, trained by rollart as is.

rollart calls ``solve(client, task)`` once per episode with an ``AsyncOpenAI`` client bound to the
trajectory's session; every call is recorded (ids, logprobs, versions) and trained on.
``make_task(seed)`` gives each episode its problem (``env.options.task_data_fn``).
"""

from __future__ import annotations

import json
import random
from typing import Any

from rollart_env.agent import AgentResult, AgentTask
from rollart_env.calculator import CalculatorConfig, ToolError, evaluate, make_problem

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "Evaluate one arithmetic expression, e.g. 482 * 17",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]


def make_task(seed: int) -> dict[str, Any]:
    expr, value = make_problem(CalculatorConfig(num_operands=3, max_operand=20), random.Random(seed))
    return {"expression": expr, "value": str(value)}


async def solve(client: Any, task: AgentTask) -> AgentResult:
    messages: list[Any] = [
        {
            "role": "system",
            "content": "Compute the expression with the calc tool, then reply with the number.",
        },
        {"role": "user", "content": task.data["expression"]},
    ]
    for _ in range(4):
        reply = await client.chat.completions.create(
            model=task.model,
            messages=messages,
            tools=TOOLS,
            max_tokens=task.max_tokens,
            temperature=task.temperature,
        )
        message = reply.choices[0].message
        messages.append(message)  # sent back unchanged: rollart reuses the sampled token ids
        if not message.tool_calls:
            answer = (message.content or "").strip()
            return AgentResult(
                answer=answer,
                reward=float(answer == task.data["value"]),
                info={"success": answer == task.data["value"]},
            )
        for call in message.tool_calls:
            try:
                result = str(evaluate(json.loads(call.function.arguments)["expression"]))
            except (ToolError, ValueError, KeyError, TypeError, SyntaxError) as e:
                result = f"error: {e}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return AgentResult(answer=None, reward=0.0, info={"success": False})
