"""Tool calls in chat completions: tool_choice "required" or a named function, through structured outputs.

OpenAI's tools are functions with JSON Schema parameters. Where the request forces a call, the output's
shape is known in advance, so the engine's grammar (replicas/grammar.py) writes it and no model-specific
parser has to find calls in free text, as vLLM does for these two choices:

- a named function ({"type": "function", "function": {"name": ...}}): the output is that function's
  arguments, a JSON object matching its parameters;
- "required": a JSON array of one or more {"name": ..., "parameters": {...}} objects, each naming one of
  the tools and holding arguments for it.

Arguments are written compactly (no free whitespace: a weak model cannot pad them without end). "none"
renders the tools into the prompt and answers in text. "auto", OpenAI's default once tools are given, lets
the model choose, so a parser for the model family's call syntax must find the calls in free text
(cluster/tool_parsers.py, named by ServerConfig.tool_call_parser); without one it is refused, saying so.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from cluster.tool_parsers import ToolParser
from replicas.errors import InvalidRequestError

_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def _refuse(message: str, field: str = "tool_choice") -> InvalidRequestError:
    return InvalidRequestError([(field, message)])


def _functions(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """name -> parameters schema of each tool, checked."""
    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict) or \
                not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _refuse(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}", "tools")
        parameters = fn.get("parameters", _EMPTY_PARAMETERS)
        if not isinstance(parameters, dict):
            raise _refuse(f"tools[{i}].function.parameters must be a JSON Schema object", "tools")
        out[fn["name"]] = parameters
    return out


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tool_choice makes of its output: the constraint that writes a forced call, or the parser
    that finds calls the model chose to make ("auto"); and how to read the output back."""

    name: str | None  # the named function; None for "required" and "auto"
    constraint: dict[str, Any] | None  # StructuredOutputsParams fields (forced calls)
    parser: ToolParser | None = None  # "auto"

    def message(self, text: str) -> dict[str, Any]:
        """The assistant message's content and tool_calls for a finished output; its text as content where it
        holds no call whole (cut by max_tokens, or the model answered in text)."""
        found = self._found(text)
        if found is None:
            return {"content": text}
        content, calls = found
        return {"content": content, "tool_calls": [
            {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": name, "arguments": json.dumps(arguments)}} for name, arguments in calls]}

    def _found(self, text: str) -> tuple[str | None, list[tuple[str, Any]]] | None:
        if self.parser is not None:
            return self.parser.parse(text)
        try:
            # strict=False: a control character the grammar let into a string is kept (json.dumps escapes it)
            value = json.loads(text, strict=False)
        except ValueError:
            return None
        if self.name is not None:
            return None, [(self.name, value)]
        return None, [(item["name"], item["parameters"]) for item in value]


def tool_plan(tools: list[dict[str, Any]] | None, tool_choice: str | dict | None,
              parallel_tool_calls: bool = True, parser: ToolParser | None = None) -> ToolPlan | None:
    """The plan for a chat request's tools, None where the output stays text; InvalidRequestError names the
    field at fault. parallel_tool_calls False: "required" makes exactly one call. parser: the server's, for
    "auto"."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise _refuse("tool_choice needs tools")
        return None
    functions = _functions(tools)
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return None
    if choice == "auto":
        if parser is None:
            raise _refuse('tool_choice "auto" (the default once tools are given) needs a tool-call parser for the '
                          'model (server.tool_call_parser), which this server does not have: ask for "required" or '
                          'a named function, or "none"')
        return ToolPlan(None, None, parser)
    if choice == "required":
        options = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                    "properties": {"name": {"enum": [name]}, "parameters": parameters}}
                   for name, parameters in functions.items()]
        schema = {"type": "array", "minItems": 1, "items": options[0] if len(options) == 1 else {"anyOf": options}}
        if not parallel_tool_calls:
            schema["maxItems"] = 1
        return ToolPlan(None, {"json": schema, "disable_any_whitespace": True})
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise _refuse('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                      '{"name": ...}}')
    if name not in functions:
        raise _refuse(f"tool_choice names {name!r}, which is not among the tools ({', '.join(functions)})")
    return ToolPlan(name, {"json": functions[name], "disable_any_whitespace": True})


def template_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """Chat messages as chat templates read them: tool calls with their arguments as objects (templates such as
    Llama 3.1's write them with `tojson`), a tool result with its call's id and the function's name."""
    out = []
    for m in messages:
        entry: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.tool_calls:
            entry["tool_calls"] = [_with_arguments_object(call) for call in m.tool_calls]
        if m.tool_call_id is not None:
            entry["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            entry["name"] = m.name
        out.append(entry)
    return out


def _with_arguments_object(call: dict[str, Any]) -> dict[str, Any]:
    fn = dict(call.get("function") or {})
    if isinstance(fn.get("arguments"), str):
        try:
            fn["arguments"] = json.loads(fn["arguments"])
        except ValueError:
            pass  # left as the client wrote it
    return {**call, "function": fn}
