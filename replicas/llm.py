"""LLM: the offline API, shaped like vLLM's.

    llm = LLM(model=path, enable_lora=True, max_loras=4, max_lora_rank=16)
    outs = llm.generate(["Hello", {"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=16),
                        lora_request=[LoRARequest("sql", 1, sql_dir), None])
    outs[0].outputs[0].text
    llm.chat([{"role": "user", "content": "Hello"}], SamplingParams(max_tokens=16))   # the model's chat template
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Sequence

from lora_core.request import LoRARequest
from replicas.chat_template import chat_prompt_ids
from replicas.engine import EngineArgs, LLMEngine
from replicas.errors import EngineError
from replicas.outputs import CompletionOutput, RequestOutput
from replicas.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    def __init__(self, model: str, **kwargs) -> None:
        self.engine = LLMEngine(EngineArgs(model=model, **kwargs))
        self._ids = itertools.count()

    def generate(self, prompts: str | dict | Sequence[str | dict],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 priority: int | Sequence[int] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        A prompt that cannot be served (bad parameter, too long, unknown or
        broken adapter) gets a finished output whose ``error`` holds the
        typed exception; the other prompts run normally.
        """
        prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        params = _per_prompt(sampling_params, len(prompts), SamplingParams, "sampling_params")
        loras = _per_prompt(lora_request, len(prompts), LoRARequest, "lora_request")
        priorities = _per_prompt(priority, len(prompts), int, "priority")
        order, results = [], {}
        for prompt, param, lora, prio in zip(prompts, params, loras, priorities):
            request_id = str(next(self._ids))
            order.append(request_id)
            try:
                # only the last output is kept: the steps need not build the others (as vLLM's LLM asks)
                param = dataclasses.replace(param or SamplingParams(), output_kind=RequestOutputKind.FINAL_ONLY)
                self.engine.add_request(request_id, prompt, param, lora, prio or 0)
            except (EngineError, ValueError) as exc:
                results[request_id] = RequestOutput(request_id, prompt if isinstance(prompt, str) else None, [],
                                                    [CompletionOutput(0, "", [], None, "error")], True,
                                                    lora.lora_name if lora else None, exc)
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output.finished:
                    results[output.request_id] = output
        return [results[i] for i in order]

    def chat(self, messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list[dict[str, Any]] | None = None,
             priority: int | Sequence[int] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """vLLM's LLM.chat: one conversation (a list of {"role", "content"} messages) or a list of them, each
        rendered with the model's chat template (replicas/chat_template.py; OpenAI's tools and
        chat_template_kwargs passed to it), then generated as generate() would. continue_final_message: the last
        message is carried on, not answered."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt=False")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [{"prompt_token_ids": chat_prompt_ids(self.engine.tokenizer, list(conversation),
                                                        add_generation_prompt, tools, continue_final_message,
                                                        chat_template_kwargs)}
                   for conversation in conversations]
        return self.generate(prompts, sampling_params, lora_request, priority)

    def shutdown(self) -> None:
        self.engine.shutdown()


def _per_prompt(value, n: int, kind: type, name: str) -> list:
    if value is None or isinstance(value, kind):
        return [value] * n
    value = list(value)
    if len(value) != n:
        raise ValueError(f"{name}: {len(value)} given for {n} prompts")
    return value
