"""OpenAI-compatible request bodies (and vLLM's adapter-loading ones), and their mapping to SamplingParams.

Unknown fields are ignored, as OpenAI clients send extras; values are checked
by SamplingParams, whose InvalidRequestError names the field (HTTP 400).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Sampling(_Body):
    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    logit_bias: dict[str, float] | None = None  # OpenAI's: token id (a JSON key, so a string) -> bias
    allowed_token_ids: list[int] | None = None  # vLLM's extras from here on
    truncate_prompt_tokens: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    user: str | None = None

    def sampling(self, default_max_tokens: int, logprobs: int | None) -> dict[str, Any]:
        """SamplingParams fields; validation happens when SamplingParams is built."""
        return dict(n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                    seed=self.seed, max_tokens=self.max_tokens if self.max_tokens is not None else default_max_tokens,
                    stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
                    presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                    repetition_penalty=self.repetition_penalty, logprobs=logprobs, min_tokens=self.min_tokens,
                    logit_bias=self.logit_bias, allowed_token_ids=self.allowed_token_ids,
                    truncate_prompt_tokens=self.truncate_prompt_tokens)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]  # a list of prompts: cluster/prompt_batch.py
    logprobs: int | None = None
    echo: bool = False


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):  # OpenAI content parts: keep the text ones
            return "".join(p.get("text", "") for p in self.content if p.get("type") == "text")
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True



class TokenizeRequest(_Body):
    """vLLM's /tokenize: exactly one of prompt or messages (rendered with the chat template)."""
    model: str | None = None  # adapters share the base model's tokenizer: any name gives the same ids
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # for a prompt (the chat template writes its own)
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]

class LoadLoRAAdapterRequest(_Body):
    lora_name: str = Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9][A-Za-z0-9._\-/:]*$")
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(_Body):
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None
