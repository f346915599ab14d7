"""A chat request as the replicas run it: its GenerateRequest, and the ChatFormat that reads the output back.

/v1/chat/completions builds both from its body; /v1/responses (cluster/responses.py) translates its body into
a ChatCompletionRequest first, so that both routes share one sampling, tool plan (cluster/tool_calls.py),
structured outputs and reasoning parser (cluster/reasoning.py).
"""

from __future__ import annotations

from typing import Any

from cluster.protocol import ChatCompletionRequest
from cluster.response_formats import ChatFormat
from cluster.server import GenerateRequest
from cluster.tool_calls import template_messages, tool_plan
from replicas.errors import InvalidRequestError


def chat_generation(body: ChatCompletionRequest, backend: Any) -> tuple[GenerateRequest, ChatFormat]:
    """What the replicas run for body, and how its output reads back; InvalidRequestError names the field at
    fault. backend: default_max_tokens, tool_parser and reasoning_parser (LoRAServer's)."""
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    sampling = body.sampling(backend.default_max_tokens, logprobs)
    if body.max_completion_tokens is not None:
        sampling["max_tokens"] = body.max_completion_tokens
    plan = tool_plan(body.tools, body.tool_choice, body.parallel_tool_calls, backend.tool_parser)
    if plan is not None and plan.constraint is not None:
        if sampling["structured_outputs"] is not None:
            raise InvalidRequestError([("tool_choice", "a forced tool call writes the output's shape: it cannot be "
                                        "combined with response_format (text.format) or structured_outputs")])
        sampling["structured_outputs"] = plan.constraint
    if plan is not None and plan.parser is not None and plan.parser.needs_special_tokens:
        sampling["skip_special_tokens"] = False  # the parser reads a special token (mistral's [TOOL_CALLS])
    req = GenerateRequest(body.model, sampling, messages=template_messages(body.messages), priority=body.priority,
                          add_generation_prompt=body.add_generation_prompt, tools=body.tools,
                          continue_final_message=body.continue_final_message,
                          chat_template_kwargs=body.chat_template_kwargs)
    reasoning = backend.reasoning_parser
    if reasoning is not None and sampling["structured_outputs"] is not None:
        reasoning = reasoning.opened_by_output()  # a grammar's output thinks only where it opens <think>
    return req, ChatFormat(body, backend, plan, reasoning)
