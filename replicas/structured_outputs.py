"""StructuredOutputsParams: the shape a request's output must take (vLLM's name and fields).

Exactly one of json (a JSON Schema, as a dict or its JSON text), json_object (any
JSON object), regex, choice (one of a list of strings) or grammar (EBNF, as in
GBNF / xgrammar) is set. This module checks the request's side only: the
grammar itself is compiled against the tokenizer by replicas/grammar.py,
which reports a schema or pattern it cannot compile.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from replicas.errors import InvalidRequestError

KINDS = ("json", "json_object", "regex", "choice", "grammar")
_FIELD = "structured_outputs"


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One output constraint. disable_any_whitespace (vLLM's flag): JSON laid out as Python's json.dumps does
    (", " and ": " between items, nothing else); by default any whitespace may appear between tokens, which a
    model may fill without end."""

    json: str | dict | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        problems = self._problems()
        if problems:
            raise InvalidRequestError([(_FIELD, f"{_FIELD}: {p}") for p in problems])
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))

    def _problems(self) -> list[str]:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            return [f"set exactly one of {', '.join(KINDS)}" + (f" (got {', '.join(given)})" if given else "")]
        kind = given[0]
        value = getattr(self, kind)
        if kind == "json":
            schema = value
            if isinstance(value, str):
                try:
                    schema = json.loads(value)
                except ValueError as exc:
                    return [f"json is not valid JSON text ({exc})"]
            if not isinstance(schema, dict):
                return [f"json must be a JSON Schema (an object), got {type(schema).__name__}"]
        elif kind == "json_object" and value is not True:
            return [f"json_object must be true, got {value!r}"]
        elif kind in ("regex", "grammar") and (not isinstance(value, str) or not value):
            return [f"{kind} must be a non-empty string, got {value!r}"]
        elif kind == "choice" and (not isinstance(value, (list, tuple)) or not value
                                   or not all(isinstance(c, str) and c for c in value)):
            return [f"choice must be a non-empty list of non-empty strings, got {value!r}"]
        if not isinstance(self.disable_any_whitespace, bool):
            return [f"disable_any_whitespace must be a bool, got {self.disable_any_whitespace!r}"]
        return []

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def schema_text(self) -> str:
        """The JSON Schema as JSON text (kind "json")."""
        return self.json if isinstance(self.json, str) else json.dumps(self.json)

    def key(self) -> tuple:
        """Equal for two requests that compile to the same grammar."""
        value = self.schema_text if self.kind == "json" else getattr(self, self.kind)
        return self.kind, value, self.disable_any_whitespace

    @classmethod
    def of(cls, value: Any) -> "StructuredOutputsParams | None":
        """value as a StructuredOutputsParams: itself, or a dict of its fields (as sent over HTTP, gRPC or
        Ray); None stays None."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise InvalidRequestError(f"{_FIELD} must be an object with one of {', '.join(KINDS)}, "
                                      f"got {type(value).__name__}", _FIELD)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise InvalidRequestError(f"{_FIELD}: unknown field(s) {', '.join(map(repr, unknown))}; "
                                      f"known: {', '.join(sorted(known))}", _FIELD)
        return cls(**value)
