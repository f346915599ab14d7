"""OpenAI-compatible request bodies (and vLLM's adapter-loading ones), and their mapping to SamplingParams.

Unknown fields are ignored, as OpenAI clients send extras; values are checked
by SamplingParams, whose InvalidRequestError names the field (HTTP 400).
Types are strict: each field takes the JSON type it declares and no other.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from cluster.adapter_names import adapter_name_problem

# Integer bounds against values no tensor or counter holds (max_tokens 2**70): the real limits (the context, the
# vocabulary, MAX_N, MAX_LOGPROBS) are SamplingParams' and the engine's, which name the field. seed is vLLM's
# int64 range (a torch generator's).
Int32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]


class _Body(BaseModel):
    # strict: lax pydantic read true as 1 and "0.5" as 0.5, which SamplingParams can no longer tell from the
    # real thing; an int is still a float (the openai client sends temperature=0). allow_inf_nan: Python's json
    # reads Infinity, NaN and 1e999 as floats that pass every range check.
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class JSONSchemaFormat(_Body):
    """OpenAI's response_format.json_schema."""
    name: str = "response"
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None  # the engine always holds the output to the schema
    description: str | None = None


class ResponseFormat(_Body):
    """OpenAI's response_format: plain text, JSON mode (any object) or a JSON Schema."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('type "json_schema" needs json_schema: {"name": ..., "schema": {...}}')
        return self


# vLLM's earlier names for structured outputs' kinds, still sent by many clients.
_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


class _Sampling(_Body):
    model: str
    max_tokens: Int32 | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: Int32 = -1
    min_p: float = 0.0
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int32] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: Int32 = 0
    logit_bias: dict[str, float] | None = None  # OpenAI's: token id (a JSON key, so a string) -> bias
    allowed_token_ids: list[Int32] | None = None  # vLLM's extras from here on
    truncate_prompt_tokens: Int32 | None = None
    bad_words: list[str] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: Int32 = 0  # vLLM's: lower first, where the server's scheduling_policy is "priority"
    response_format: ResponseFormat | None = None  # OpenAI's; the next five are vLLM's (replicas/structured_outputs.py)
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    n: Int32 = 1
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    user: str | None = None

    @model_validator(mode="after")
    def _one_output_format(self) -> "_Sampling":
        given = [name for name in ("response_format", "structured_outputs", *_GUIDED)
                 if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.type == "text":
            given.remove("response_format")
        if len(given) > 1:
            raise ValueError(f"set at most one of response_format, structured_outputs or a guided_* field "
                             f"(got {', '.join(given)})")
        return self

    def structured(self) -> dict[str, Any] | None:
        """The output constraint asked for, as StructuredOutputsParams fields (checked on the replica)."""
        fmt = self.response_format
        if fmt is not None and fmt.type != "text":
            return {"json": fmt.json_schema.schema_} if fmt.type == "json_schema" else {"json_object": True}
        if self.structured_outputs is not None:
            return dict(self.structured_outputs)
        guided = next((name for name in _GUIDED if getattr(self, name) is not None), None)
        return None if guided is None else {guided.removeprefix("guided_"): getattr(self, guided)}

    def sampling(self, default_max_tokens: int, logprobs: int | None) -> dict[str, Any]:
        """SamplingParams fields; validation happens when SamplingParams is built."""
        return dict(n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                    seed=self.seed, max_tokens=self.max_tokens if self.max_tokens is not None else default_max_tokens,
                    stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
                    presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                    repetition_penalty=self.repetition_penalty, logprobs=logprobs, min_tokens=self.min_tokens,
                    logit_bias=self.logit_bias, allowed_token_ids=self.allowed_token_ids,
                    truncate_prompt_tokens=self.truncate_prompt_tokens, structured_outputs=self.structured(),
                    bad_words=self.bad_words, skip_special_tokens=self.skip_special_tokens,
                    include_stop_str_in_output=self.include_stop_str_in_output)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[Int32] | list[list[Int32]]  # a list of prompts: cluster/prompt_batch.py
    logprobs: Int32 | None = None
    echo: bool = False

    def prompt_chars(self) -> int:
        """The characters the tokenizer reads, over every prompt (token ids need no tokenizing)."""
        prompts = [self.prompt] if isinstance(self.prompt, str) else self.prompt
        return sum(len(p) for p in prompts if isinstance(p, str))


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls (cluster/tool_calls.py)
    tool_call_id: str | None = None  # a tool's result: the call it answers
    name: str | None = None

    @model_validator(mode="after")
    def _text_parts(self) -> "ChatMessage":
        """Content parts other than text (image_url, input_audio, file, ...) are refused, not dropped: the
        model reads text only, and an answer that silently ignored the image would be wrong."""
        for i, part in enumerate(self.content if isinstance(self.content, list) else []):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("text", "refusal"):
                raise ValueError(f"content[{i}]: a {kind!r} content part is not supported: this model reads "
                                 f"text only")
            if not isinstance(part.get(kind, ""), str):
                raise ValueError(f"content[{i}].{kind} must be a string")
        return self

    @model_validator(mode="after")
    def _content_given(self) -> "ChatMessage":
        """OpenAI's rule: only an assistant message that carries tool_calls may leave content out (null)."""
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content (a string or text parts); only an assistant "
                             f"message with tool_calls may have none")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):  # OpenAI content parts: the text ones (an assistant's refusal aside)
            return "".join(p.get("text", "") for p in self.content if p.get("type") == "text")
        return self.content or ""


def chat_chars(messages: list[ChatMessage], tools: list[dict[str, Any]] | None) -> int:
    """The characters a chat template renders for the tokenizer: the messages' text, their tool calls and the
    tools (JSON), all of which a client could fill."""
    structured = [m.tool_calls for m in messages if m.tool_calls] + ([tools] if tools else [])
    return sum(len(m.text()) for m in messages) + (len(json.dumps(structured, ensure_ascii=False)) if structured
                                                   else 0)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int32 | None = None
    logprobs: bool = False
    top_logprobs: Int32 | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: carry the last (assistant) message on, no new turn
    tools: list[dict[str, Any]] | None = None  # OpenAI's functions; tool_choice decides (cluster/tool_calls.py)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: more variables for the template (enable_thinking)
    include_reasoning: bool = True  # vLLM's: with a reasoning parser, send the reasoning (cluster/reasoning.py)

    @model_validator(mode="after")
    def _one_way_to_end(self) -> "ChatCompletionRequest":
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt false: the answer either starts a "
                             "new turn or carries the last message on")
        return self

    def prompt_chars(self) -> int:
        return chat_chars(self.messages, self.tools)



class TokenizeRequest(_Body):
    """vLLM's /tokenize: exactly one of prompt or messages (rendered with the chat template)."""
    model: str | None = None  # adapters share the base model's tokenizer: any name gives the same ids
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # for a prompt (the chat template writes its own)
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None  # written by the template, as /v1/chat/completions renders them
    chat_template_kwargs: dict[str, Any] | None = None

    def prompt_chars(self) -> int:
        return len(self.prompt) if self.prompt is not None else chat_chars(self.messages or [], self.tools)


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[Int32]

class LoadLoRAAdapterRequest(_Body):
    lora_name: str  # cluster/adapter_names.py's rule
    lora_path: str = Field(min_length=1)

    @field_validator("lora_name")
    @classmethod
    def _a_name(cls, name: str) -> str:
        problem = adapter_name_problem(name)
        if problem:
            raise ValueError(problem)
        return name


class UnloadLoRAAdapterRequest(_Body):
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None
