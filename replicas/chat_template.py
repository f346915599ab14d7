"""Chat prompts: the tokenizer's own chat template (Jinja), or a plain fallback when it has none."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from replicas.errors import InvalidRequestError
from replicas.tokenizer import Tokenizer

_FALLBACK = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
             "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    # Templates come with model files: render them sandboxed, as transformers does.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    return env.from_string(template)


def _raise(message: str) -> None:
    raise InvalidRequestError([("messages", message)])


def render_chat(messages: list[dict[str, Any]], template: str | None, bos_token: str | None = None,
                eos_token: str | None = None, add_generation_prompt: bool = True,
                tools: list[dict[str, Any]] | None = None, continue_final_message: bool = False) -> str:
    """The prompt text for ``messages`` (and OpenAI's ``tools``, for templates that write them, as
    transformers' apply_chat_template passes them); a template's own checks become InvalidRequestError (400).

    continue_final_message (vLLM's and transformers'): the text stops right after the last message's content,
    without the end of its turn, so that the model carries that message on (a "prefilled" answer)."""
    try:
        text = _compile(template or _FALLBACK).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                      bos_token=bos_token or "", eos_token=eos_token or "",
                                                      tools=tools)
    except jinja2.TemplateError as exc:
        raise InvalidRequestError([("messages", f"chat template failed: {exc}")]) from exc
    if not continue_final_message:
        return text
    final = (messages[-1].get("content") or "").rstrip() if messages else ""
    end = text.rfind(final) if final else -1
    if end < 0:  # templates may strip or rewrite content: then there is no place to cut
        raise InvalidRequestError([("continue_final_message", "the chat template does not write the last "
                                                              "message's content as given, so it cannot be continued")])
    return text[: end + len(final)]


def chat_prompt_ids(tokenizer: Tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None, continue_final_message: bool = False) -> list[int]:
    """The token ids a model reads for ``messages``: rendered with its chat template (render_chat) and encoded
    without adding special tokens again (the template writes BOS itself)."""
    text = render_chat(messages, tokenizer.chat_template, tokenizer.bos_token, tokenizer.eos_token,
                       add_generation_prompt, tools, continue_final_message)
    return tokenizer.encode(text, add_special_tokens=False)
