"""Tool calls found in free text, for tool_choice "auto": a parser per model family's call syntax, as vLLM's
--tool-call-parser, chosen by ServerConfig.tool_call_parser.

- "hermes" (Hermes 2 Pro, Qwen2.5 and others trained on its format): calls are
  <tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks after any text; that text is the
  message's content.
- "llama3_json" (Llama 3.1 / 3.2 with their JSON tool calling): the whole output is a call
  {"name": ..., "parameters": {...}}, or several separated by ";", after an optional <|python_tag|>.
- "mistral" (Mistral 7B Instruct v0.3, Mistral Nemo, Mistral Small / Large): the calls follow the special
  token [TOOL_CALLS], as a JSON array of {"name": ..., "arguments": {...}}, or (tokenizer v11 and later:
  Mistral Small 3.2, Magistral) as name[ARGS]{...} after a [TOOL_CALLS] each. A special token is left out
  of the text by default, so the server keeps them in the text of a request this parser reads
  (needs_special_tokens).
- "pythonic" (Llama 3.2 1B / 3B Instruct, Llama 4): the whole output is a Python list of calls with keyword
  arguments, [get_weather(city="Paris", days=2), get_time()], which Llama 4 may wrap in <|python_start|> and
  <|python_end|>. It is read with Python's ast, never run: each argument must be a literal.

A parser reads a finished output (parse) and, while it streams, says how much of it is surely content
(content_end): the rest may be the start of a call, and is held back until the output says which.
"""

from __future__ import annotations

import ast
import json
import math
import re
from typing import Any, Protocol

Call = tuple[str, dict[str, Any]]  # function name, arguments


class ToolParser(Protocol):
    needs_special_tokens: bool  # the syntax holds a special token: keep them in the text (skip_special_tokens off)

    def parse(self, text: str) -> tuple[str | None, list[Call]] | None:
        """(content before the calls or None, the calls), or None where the text holds no call."""

    def content_end(self, text: str) -> int:
        """How many leading characters of a partial output are content whatever follows."""


def _call(value: Any, arguments_key: str) -> Call | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, value.get("arguments", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments, strict=False)
        except ValueError:
            return None
    return (value["name"], arguments) if isinstance(arguments, dict) else None


def held_prefix(text: str, marker: str) -> int:
    """Characters at the end of text that could begin marker."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class HermesParser:
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    needs_special_tokens = False  # in Qwen's vocabularies <tool_call> is an added token that is not special
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, list[Call]] | None:
        start = text.find(self.OPEN)
        if start < 0:
            return None
        calls = []
        for block in self._BLOCK.finditer(text, start):
            try:
                call = _call(json.loads(block.group(1), strict=False), "arguments")
            except ValueError:
                return None
            if call is None:
                return None
            calls.append(call)
        # right-stripped only, so that the content is the text a stream has sent the start of
        content = text[:start].rstrip()
        return (content or None), calls

    def content_end(self, text: str) -> int:
        start = text.find(self.OPEN)
        return start if start >= 0 else len(text) - held_prefix(text, self.OPEN)


class Llama3JsonParser:
    TAG = "<|python_tag|>"  # special, and optional: the parser reads the JSON with or without it
    needs_special_tokens = False

    def parse(self, text: str) -> tuple[str | None, list[Call]] | None:
        rest = text.strip()
        if rest.startswith(self.TAG):
            rest = rest[len(self.TAG):].lstrip()
        if not rest.startswith("{"):
            return None
        decoder, calls, at = json.JSONDecoder(strict=False), [], 0
        while at < len(rest):
            try:
                value, at = decoder.raw_decode(rest, at)
            except ValueError:
                return None
            call = _call(value, "parameters")
            if call is None:
                return None
            calls.append(call)
            while at < len(rest) and rest[at] in " \t\r\n;":
                at += 1
        return None, calls

    def content_end(self, text: str) -> int:
        rest = text.lstrip()
        if not rest or rest.startswith("{") or self.TAG.startswith(rest[: len(self.TAG)]):
            return 0  # a call may be what this output is: wait for it
        return len(text)


class MistralParser:
    TAG, ARGS = "[TOOL_CALLS]", "[ARGS]"
    needs_special_tokens = True  # [TOOL_CALLS] is one

    def parse(self, text: str) -> tuple[str | None, list[Call]] | None:
        start = text.find(self.TAG)
        if start < 0:
            return None
        calls: list[Call] = []
        for piece in (p.strip() for p in text[start:].split(self.TAG)):
            if not piece:
                continue
            if self.ARGS in piece:  # name[ARGS]{...}
                name, _, arguments = piece.partition(self.ARGS)
                try:
                    found = [_call({"name": name.strip(), "arguments": json.loads(arguments, strict=False)},
                                   "arguments")]
                except ValueError:
                    return None
            else:  # [{"name": ..., "arguments": ...}, ...]
                try:
                    value = json.loads(piece, strict=False)
                except ValueError:
                    return None
                found = [_call(item, "arguments") for item in (value if isinstance(value, list) else [value])]
            if None in found:
                return None
            calls += found
        if not calls:
            return None
        content = text[:start].rstrip()  # right-stripped only: a stream has sent its start
        return (content or None), calls

    def content_end(self, text: str) -> int:
        start = text.find(self.TAG)
        return start if start >= 0 else len(text) - held_prefix(text, self.TAG)


def _literal(node: ast.expr) -> Any:
    """A call argument's value as JSON data; ValueError where it is not a literal that JSON can hold."""
    if isinstance(node, ast.Constant) and (node.value is None or type(node.value) in (str, bool, int, float)):
        value = node.value
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)) and \
            isinstance(node.operand, ast.Constant) and type(node.operand.value) in (int, float):
        value = -node.operand.value if isinstance(node.op, ast.USub) else node.operand.value  # -1 is not a Constant
    elif isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(item) for item in node.elts]
    elif isinstance(node, ast.Dict):
        keys = [None if key is None else _literal(key) for key in node.keys]  # None: a **splat
        if not all(isinstance(key, str) for key in keys):
            raise ValueError("a dict argument's keys must be strings")
        return dict(zip(keys, (_literal(item) for item in node.values)))
    else:
        raise ValueError(f"not a literal: {ast.dump(node)[:80]}")
    if isinstance(value, float) and not math.isfinite(value):  # 1e999: JSON has no infinity
        raise ValueError("not a finite number")
    return value


def _python_call(node: ast.expr) -> Call:
    """name(keyword=literal, ...) as a call; ValueError for anything else."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise ValueError("not a call of a plain name")  # as vLLM: a.b(...) is no call
    if node.args:
        raise ValueError("positional arguments have no name for the JSON object")
    arguments: dict[str, Any] = {}
    for keyword in node.keywords:
        if keyword.arg is None or keyword.arg in arguments:  # **splat; a repeat, which Python refuses too
            raise ValueError("arguments must be distinct keywords")
        arguments[keyword.arg] = _literal(keyword.value)
    return node.func.id, arguments


class PythonicParser:
    START, END = "<|python_start|>", "<|python_end|>"  # Llama 4's, special and optional
    needs_special_tokens = False
    # The output must open as a call list does. parse asks for it too, so that text content_end let go as
    # content can never turn out to be calls.
    _HEAD = re.compile(r"\[\s*[^\W\d]\w*\s*\(")
    _PARTIAL_HEAD = re.compile(r"\[\s*(?:[^\W\d]\w*\s*)?")  # a prefix of _HEAD that may still become one

    def _calls_text(self, text: str) -> str:
        rest = text.strip()
        if rest.startswith(self.START):
            rest = rest[len(self.START):].lstrip()
        return rest

    def parse(self, text: str) -> tuple[str | None, list[Call]] | None:
        rest = self._calls_text(text)
        if rest.endswith(self.END):
            rest = rest[: -len(self.END)]
        if not self._HEAD.match(rest):
            return None
        try:
            tree = ast.parse(rest, mode="eval")  # one expression, parsed only: nothing is evaluated
            if not isinstance(tree.body, ast.List):
                return None
            return None, [_python_call(item) for item in tree.body.elts]
        except (SyntaxError, ValueError, RecursionError):
            return None

    def content_end(self, text: str) -> int:
        rest = self._calls_text(text)
        if self.START.startswith(rest) or self._HEAD.match(rest) or self._PARTIAL_HEAD.fullmatch(rest):
            return 0  # a call list may be what this output is: wait for it
        return len(text)


PARSERS: dict[str, type] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser, "mistral": MistralParser,
                            "pythonic": PythonicParser}


def tool_parser(name: str | None) -> ToolParser | None:
    """The parser called name; None for None. An unknown name is a configuration error."""
    if name is None:
        return None
    if name not in PARSERS:
        raise ValueError(f"tool_call_parser must be one of {sorted(PARSERS)} or null, got {name!r}")
    return PARSERS[name]()
