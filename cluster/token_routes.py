"""vLLM's /tokenize and /detokenize: the served model's tokenizer over HTTP.

For clients that count or check tokens before they send (a prompt's length against the context, a chat's
rendered prompt). Adapters share the base model's tokenizer, so the request's model name changes nothing.
Unlike vLLM's, they need an API key where keys are on: tokenizing is work an anonymous caller could make the
ingress do (cluster/api.py), and a prompt is bounded by max_prompt_chars as on the generating routes.
"""

from __future__ import annotations

from typing import Any, Callable

from fastapi import FastAPI

from cluster.protocol import DetokenizeRequest, TokenizeRequest
from cluster.request_limits import MAX_PROMPT_CHARS, check_prompt_chars
from cluster.tool_calls import template_messages
from replicas.chat_template import chat_prompt_ids
from replicas.errors import InvalidRequestError


def add_token_routes(app: FastAPI, backend: Any, error_response: Callable[[BaseException], Any], *,
                     max_prompt_chars: int = MAX_PROMPT_CHARS) -> None:
    """backend.tokenizer: a replicas.tokenizer.Tokenizer; backend.max_model_len, if it has one, is reported."""

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        if (body.prompt is None) == (body.messages is None):
            return error_response(InvalidRequestError([("prompt", "send exactly one of prompt or messages")]))
        try:
            check_prompt_chars("messages" if body.prompt is None else "prompt", body.prompt_chars(),
                               max_prompt_chars)
        except InvalidRequestError as exc:
            return error_response(exc)
        tok = backend.tokenizer
        if body.messages is not None:
            try:
                ids = chat_prompt_ids(tok, template_messages(body.messages), body.add_generation_prompt, body.tools,
                                      template_kwargs=body.chat_template_kwargs)
            except InvalidRequestError as exc:  # the template's own checks, or a bad chat_template_kwargs
                return error_response(exc)
        else:
            ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        out: dict[str, Any] = {"count": len(ids), "tokens": ids}
        if getattr(backend, "max_model_len", None):
            out["max_model_len"] = backend.max_model_len
        return out

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        tok = backend.tokenizer
        if not all(0 <= t < tok.vocab_size for t in body.tokens):
            return error_response(InvalidRequestError([("tokens", f"tokens must be ids in [0, {tok.vocab_size})")]))
        return {"prompt": tok.decode(body.tokens, skip_special_tokens=False)}
