"""Enforced tool calls: a ``tool_choice`` naming a function whose arguments are all choices (``enum``).

vLLM's own server enforces a named ``tool_choice`` with guided decoding: a grammar masks the logits
at every token. rollart does not train on such outputs: the trainer recomputes each token's logprob
under the restriction it was sampled with (``allowed_token_ids``, one set per engine call), and a
grammar's mask changes from token to token, so the trained ratios would be off at every forced
token. Instead the endpoint writes the call itself, in the model's own format: the chat template
renders the call (so the text is what the model will see in its history), the call's fixed text
(function name, keys, punctuation, end of turn) is fed as context, and each argument's value is
sampled by the model among the values of its ``enum``: one engine call per token where more than one
value is still possible, restricted to the tokens that continue one of them, the rest fed as well.
Every engine call is recorded like any other, so an agent trajectory trains exactly the model's
choices, under the restriction each was drawn with, and the fixed text is context.

Enforced when ``tool_choice`` names a function (or is ``required`` with a single tool) and every
property of that function's ``parameters`` has a non-empty ``enum`` of strings, no value's tokens
(each value encoded alone) being a prefix of another's. For other schemas the model writes the call
freely and the tool parser reads it (the reply's ``rollart.tool_call_error`` says when it holds none).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from rollart_core.errors import EngineError
from rollart_core.types import GenerateOutput, SamplingParams
from rollart_proxy.server.tools import ToolsError, template_messages

__all__ = ["CallPlan", "ForcedCall", "generate_call", "plan_call"]


@dataclass(frozen=True, slots=True)
class Slot:
    """One argument: its name, its values, and each value's token ids (encoded alone)."""

    name: str
    values: tuple[str, ...]
    value_ids: tuple[tuple[int, ...], ...]


@dataclass(frozen=True, slots=True)
class CallPlan:
    """A call as the template writes it: fixed text ``pieces[0]``, a value of ``slots[0]``,
    ``pieces[1]``, … ``pieces[-1]`` (up to and including the end-of-turn token)."""

    function: str
    pieces: tuple[tuple[int, ...], ...]
    slots: tuple[Slot, ...]

    @property
    def max_tokens(self) -> int:
        """Tokens of the longest call this plan can write."""
        return sum(map(len, self.pieces)) + sum(max(map(len, s.value_ids)) for s in self.slots)


@dataclass(slots=True)
class ForcedCall:
    """What :func:`generate_call` wrote: the whole turn's ids (fixed text included), a logprob and a
    version per id (0.0 and -1 where the text was fixed), the arguments, and the engine calls made."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    arguments: dict[str, str] = field(default_factory=dict)
    outputs: list[GenerateOutput] = field(default_factory=list)

    def feed(self, ids: tuple[int, ...] | list[int]) -> None:
        self.token_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)


def _enforced_function(tools: list[dict[str, Any]], tool_choice: Any) -> dict[str, Any] | None:
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        return next(t["function"] for t in tools if t["function"]["name"] == name)
    if tool_choice == "required" and len(tools) == 1:
        return tools[0]["function"]
    return None


def _choices(params: Any) -> dict[str, list[str]] | None:
    """``{argument: values}`` if every property is an ``enum`` of strings, else None."""
    props = params.get("properties") if isinstance(params, dict) else None
    if not isinstance(props, dict) or not props:
        return None
    out: dict[str, list[str]] = {}
    for key, schema in props.items():
        values = schema.get("enum") if isinstance(schema, dict) else None
        if not isinstance(values, list) or not values or not all(isinstance(v, str) for v in values):
            return None
        out[key] = list(dict.fromkeys(values))
    return out


def plan_call(
    render: Callable[..., str],
    encode: Callable[[str], list[int]],
    eos_text: str | None,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    tool_choice: Any,
) -> CallPlan | None:
    """The plan of an enforced call for this request, or None when the request does not ask for one
    (see the module doc). ``render(messages, add_generation_prompt=..., tools=...)`` is the model's
    chat template. Raises :class:`ToolsError` when the call cannot be written in the model's format."""
    fn = _enforced_function(tools or [], tool_choice) if tools else None
    choices = _choices(fn.get("parameters")) if fn is not None else None
    if fn is None or choices is None:
        return None
    nonce = secrets.token_hex(6)
    marks = {key: f"rollartslot{nonce}n{i}" for i, key in enumerate(choices)}  # survives any JSON escaping
    call = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": fn["name"], "arguments": marks}}
        ],
    }
    prompt = render(template_messages(messages), add_generation_prompt=True, tools=tools)
    full = render(template_messages([*messages, call]), add_generation_prompt=False, tools=tools)
    if not full.startswith(prompt):
        raise ToolsError(
            "tool_choice: the chat template does not render the assistant's call after the generation "
            "prompt, so the call cannot be enforced",
            "tool_choice",
        )
    text = full[len(prompt) :]
    if eos_text and eos_text in text:
        text = text[: text.rindex(eos_text) + len(eos_text)]  # the rest opens the next message
    cuts = [(text.find(mark), key) for key, mark in marks.items()]
    if any(pos < 0 or text.count(marks[key]) != 1 for pos, key in cuts):
        raise ToolsError(
            "tool_choice: the chat template does not render the call's arguments as JSON strings, so "
            "the call cannot be enforced",
            "tool_choice",
        )
    pieces: list[tuple[int, ...]] = []
    slots: list[Slot] = []
    at = 0
    for pos, key in sorted(cuts):
        pieces.append(tuple(encode(text[at:pos])) if pos > at else ())
        at = pos + len(marks[key])
        # a value's text as the template writes it inside the JSON string (escapes included)
        texts = [json.dumps(v, ensure_ascii=False)[1:-1] for v in choices[key]]
        ids = tuple(tuple(encode(t)) for t in texts)
        for i, a in enumerate(ids):
            clash = next((choices[key][j] for j, b in enumerate(ids) if j != i and b[: len(a)] == a), None)
            if not a or clash is not None:
                raise ToolsError(
                    f"tool_choice: the values {choices[key][i]!r} and {clash!r} of argument {key!r} "
                    "start alike token by token (one's tokens are a prefix of the other's): the model "
                    "could not say which it chose",
                    "tool_choice",
                )
        slots.append(Slot(key, tuple(choices[key]), ids))
    pieces.append(tuple(encode(text[at:])))
    return CallPlan(fn["name"], tuple(pieces), tuple(slots))


async def generate_call(
    plan: CallPlan,
    prompt_ids: list[int],
    sampling: SamplingParams,
    generate: Callable[[list[int], SamplingParams], Awaitable[GenerateOutput]],
) -> ForcedCall:
    """Write the call: fixed text fed, each undecided token of a value drawn by ``generate(prompt,
    sampling)`` (one token, restricted to the tokens that continue a value). ``sampling``'s
    temperature, top-p/k and seed apply; the seed is advanced per engine call."""
    call = ForcedCall()
    for k, slot in enumerate(plan.slots):
        call.feed(plan.pieces[k])
        alive = list(range(len(slot.values)))
        pos = 0
        while len(alive) > 1:
            nexts = sorted({slot.value_ids[i][pos] for i in alive})
            if len(nexts) == 1:
                call.feed([nexts[0]])
            else:
                step = sampling.model_copy(
                    update={
                        "max_tokens": 1,
                        "allowed_token_ids": tuple(nexts),
                        "stop": (),
                        "stop_token_ids": (),
                        "seed": None if sampling.seed is None else sampling.seed + len(call.outputs),
                    }
                )
                out = await generate(prompt_ids + call.token_ids, step)
                call.outputs.append(out)
                if len(out.token_ids) != 1 or out.token_ids[0] not in nexts:
                    raise EngineError(
                        f"enforced tool call: the engine returned {out.token_ids[:4]} "
                        f"({out.finish_reason or 'no reason'}), not one of the {len(nexts)} allowed tokens"
                    )
                call.token_ids += out.token_ids
                call.logprobs += out.logprobs
                call.versions += out.versions
            alive = [i for i in alive if slot.value_ids[i][pos] == call.token_ids[-1]]
            pos += 1
        chosen = alive[0]
        call.feed(slot.value_ids[chosen][pos:])
        call.arguments[slot.name] = slot.values[chosen]
    call.feed(plan.pieces[-1])
    return call
