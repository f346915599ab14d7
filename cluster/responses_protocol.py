"""OpenAI's Responses API request (POST /v1/responses) and its translation into a chat request.

A response runs as a chat completion (cluster/chat_request.py): `instructions` become a leading system message,
the input items (after the stored conversation a previous_response_id names) become chat messages, the flat
function tools and tool_choice take the chat's nested form, and text.format becomes response_format. What the
chat path cannot do (built-in tools, images and files, background runs, truncation) is refused with a 400 that
says so, rather than quietly answered some other way.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationError, model_validator

from cluster.protocol import ChatCompletionRequest, ChatMessage, Int32, _Body
from replicas.errors import InvalidRequestError

# vLLM's sampling extras, which the chat request checks and uses as they are (the openai client sends them
# through extra_body).
PASSED_THROUGH = ("top_k", "min_p", "seed", "stop", "stop_token_ids", "presence_penalty", "frequency_penalty",
                  "repetition_penalty", "ignore_eos", "min_tokens", "logit_bias", "allowed_token_ids",
                  "truncate_prompt_tokens", "bad_words", "skip_special_tokens", "include_stop_str_in_output",
                  "priority", "structured_outputs", "chat_template_kwargs", "include_reasoning")
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text")


class TextFormat(_Body):
    """text.format: plain text, JSON mode (any object) or a JSON Schema; the chat's response_format, flat."""
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None  # the engine always holds the output to the schema

    @model_validator(mode="after")
    def _schema_given(self) -> "TextFormat":
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError('type "json_schema" needs a schema: {"type": "json_schema", "name": ..., "schema": {...}}')
        return self

    def response_format(self) -> dict[str, Any]:
        if self.type != "json_schema":
            return {"type": self.type}
        return {"type": "json_schema", "json_schema": {"name": self.name or "response", "schema": self.schema_}}

    def echo(self) -> dict[str, Any]:
        """As the response object repeats it (a schema's name is required there)."""
        out = self.model_dump(by_alias=True, exclude_none=True)
        if self.type == "json_schema":
            out.setdefault("name", "response")
        return out


class TextConfig(_Body):
    format: TextFormat = Field(default_factory=TextFormat)


class ResponsesRequest(_Body):
    model_config = ConfigDict(extra="allow")  # PASSED_THROUGH fields are read from the extras

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: Int32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    text: TextConfig = Field(default_factory=TextConfig)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    reasoning: dict[str, Any] | None = None  # echoed: whether the model thinks is its template's and server's call
    user: str | None = None
    background: bool = False
    truncation: Literal["disabled", "auto"] | None = None
    top_logprobs: Int32 | None = None
    include: list[str] | None = None  # accepted, and nothing more is included

    def input_items(self) -> list[dict[str, Any]]:
        return [{"type": "message", "role": "user", "content": self.input}] if isinstance(self.input, str) else \
            self.input

    def chat_request(self, history: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat request that answers this one; history: the stored conversation's items (earlier inputs and
        outputs) that come before the input. InvalidRequestError names the field at fault."""
        self._refuse_unsupported()
        messages = [ChatMessage(role="system", content=self.instructions)] if self.instructions else []
        chat_messages(history, messages, "previous_response_id")
        chat_messages(self.input_items(), messages)
        if not messages:
            raise InvalidRequestError([("input", "the input holds no message")])
        fields = {k: v for k, v in (self.model_extra or {}).items() if k in PASSED_THROUGH}
        fields.update(model=self.model, messages=messages, stream=self.stream, tools=chat_tools(self.tools),
                      tool_choice=self._chat_tool_choice(), parallel_tool_calls=self.parallel_tool_calls,
                      response_format=self.text.format.response_format(), max_completion_tokens=self.max_output_tokens)
        fields.update({k: getattr(self, k) for k in ("temperature", "top_p") if getattr(self, k) is not None})
        try:
            return ChatCompletionRequest(**fields)
        except ValidationError as exc:  # an extra's value, or two output formats at once
            problems = [(".".join(map(str, e["loc"])) or "body", e["msg"]) for e in exc.errors()]
            raise InvalidRequestError([(field, f"{field}: {msg}") for field, msg in problems]) from None

    def _refuse_unsupported(self) -> None:
        problems = []
        if self.background:
            problems.append(("background", "background responses are not supported: leave background false and "
                                           "keep the request open (stream: true to see the output as it comes)"))
        if self.truncation == "auto":
            problems.append(("truncation", 'truncation "auto" is not supported: a conversation longer than the '
                                           'model\'s context is a 400, as with "disabled"'))
        if (self.model_extra or {}).get("conversation") is not None:
            problems.append(("conversation", "conversations are not kept here: continue a stored response with "
                                             "previous_response_id, or send the whole conversation as input"))
        if self.top_logprobs:
            problems.append(("top_logprobs", "logprobs are not returned by /v1/responses: use /v1/chat/completions"))
        if problems:
            raise InvalidRequestError(problems)

    def _chat_tool_choice(self) -> str | dict[str, Any] | None:
        choice = self.tool_choice
        if isinstance(choice, str) and choice in ("auto", "none", "required"):
            return None if choice == "auto" and not self.tools else choice  # "auto", the default, needs no tools
        if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
            return {"type": "function", "function": {"name": choice["name"]}}
        raise InvalidRequestError([("tool_choice", 'tool_choice must be "auto", "none", "required" or '
                                                   '{"type": "function", "name": ...}')])


def chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """Responses' flat function tools in the chat's form ({"type": "function", "function": {...}})."""
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise InvalidRequestError([(f"tools[{i}].type", f"tools of type {kind!r} are not supported: only "
                                                            f"function tools run here")])
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise InvalidRequestError([(f"tools[{i}].name", 'a function tool needs a name; Responses tools are flat: '
                                                            '{"type": "function", "name": ..., "parameters": {...}}')])
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out or None


def chat_messages(items: list[Any], into: list[ChatMessage], at: str = "input") -> list[ChatMessage]:
    """Responses input items appended to into as chat messages: a function_call joins the assistant message
    before it (the chat's tool_calls), a function_call_output is a tool message, and reasoning items are left
    out (the chat path gives a template no earlier thinking). at: the field named in errors."""
    names = {call["id"]: call["function"]["name"] for m in into for call in m.tool_calls or []}
    for i, item in enumerate(items):
        where = f"{at}[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise InvalidRequestError([(f"{where}.role", f"role must be one of {', '.join(ROLES)}, got {role!r}")])
            into.append(ChatMessage(role=ROLES[role], content=_text(item.get("content"), f"{where}.content")))
        elif kind == "function_call":
            name, call_id = _string(item, "name", where), _string(item, "call_id", where)
            call = {"id": call_id, "type": "function",
                    "function": {"name": name, "arguments": _string(item, "arguments", where)}}
            names[call_id] = name
            if into and into[-1].role == "assistant":
                into[-1].tool_calls = [*(into[-1].tool_calls or []), call]
            else:
                into.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", where)
            into.append(ChatMessage(role="tool", tool_call_id=call_id, name=names.get(call_id),
                                    content=_text(item.get("output"), f"{where}.output")))
        elif kind != "reasoning":
            raise InvalidRequestError([(where, f"input items of type {kind!r} are not supported: send messages, "
                                               f"function_call and function_call_output items")])
    return into


def _string(item: dict[str, Any], key: str, where: str) -> str:
    if not isinstance(item.get(key), str):
        raise InvalidRequestError([(f"{where}.{key}", f"a {item.get('type')} item needs {key} as a string")])
    return item[key]


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, or text parts (input_text, output_text)."""
    if content is None:  # as chat's content: null is a client's bug, not an empty message
        raise InvalidRequestError([(where, f"{where} is required: a string or a list of input_text parts")])
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError([(where, "content must be a string or a list of input_text parts")])
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise InvalidRequestError([(f"{where}[{j}]", f"content parts of type {kind!r} are not supported: this "
                                                         f"server reads text (input_text, output_text parts)")])
    return "".join(part["text"] for part in content)
