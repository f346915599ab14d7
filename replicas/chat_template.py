"""Chat prompts: the tokenizer's own chat template (Jinja), or a plain fallback when it has none.

Templates are written for transformers' apply_chat_template, so they render in the environment it builds:
its `tojson` (json.dumps, non-ASCII kept and nothing HTML-escaped: Jinja's own writes ' as \\u0027 and takes
no ensure_ascii), `strftime_now` (Llama 3.1 / 3.2 write today's date into the system turn, else a fixed
one), `{% break %}` / `{% continue %}`, and `{% generation %}` blocks (they mark the assistant's tokens for
training masks; here their text is simply rendered).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from replicas.errors import InvalidRequestError
from replicas.tokenizer import Tokenizer

_FALLBACK = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
             "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


class _Generation(Extension):
    """{% generation %}...{% endgeneration %}: the body, rendered as it stands."""

    tags = {"generation"}

    def parse(self, parser) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    # Templates come with model files: render them sandboxed, as transformers does.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _Generation])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def _raise(message: str) -> None:
    raise InvalidRequestError([("messages", message)])


# What render_chat passes itself: chat_template_kwargs may not replace them.
RESERVED = ("messages", "add_generation_prompt", "bos_token", "eos_token", "tools", "raise_exception")


def render_chat(messages: list[dict[str, Any]], template: str | None, bos_token: str | None = None,
                eos_token: str | None = None, add_generation_prompt: bool = True,
                tools: list[dict[str, Any]] | None = None, continue_final_message: bool = False,
                template_kwargs: dict[str, Any] | None = None) -> str:
    """The prompt text for ``messages`` (and OpenAI's ``tools``, for templates that write them, as
    transformers' apply_chat_template passes them); a template's own checks become InvalidRequestError (400).

    continue_final_message (vLLM's and transformers'): the text stops right after the last message's content,
    without the end of its turn, so that the model carries that message on (a "prefilled" answer).
    template_kwargs (vLLM's chat_template_kwargs): more variables for the template, such as Qwen3's
    enable_thinking; none may be one of RESERVED."""
    extra = check_template_kwargs(template_kwargs)
    try:
        text = _compile(template or _FALLBACK).render(**extra, messages=messages,
                                                      add_generation_prompt=add_generation_prompt,
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


def check_template_kwargs(template_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """chat_template_kwargs as render_chat passes them ({} for None); InvalidRequestError for a name it
    passes itself or one that is not a string."""
    if template_kwargs is None:
        return {}
    if not isinstance(template_kwargs, dict):
        raise InvalidRequestError([("chat_template_kwargs", "must be an object of template variables")])
    bad = sorted(str(k) for k in template_kwargs if not isinstance(k, str) or k in RESERVED)
    if bad:
        raise InvalidRequestError([("chat_template_kwargs", f"{', '.join(bad)}: set by the request's own fields "
                                                            f"(messages, tools, add_generation_prompt), not here")])
    return dict(template_kwargs)


def chat_prompt_ids(tokenizer: Tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None, continue_final_message: bool = False,
                    template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """The token ids a model reads for ``messages``: rendered with its chat template (render_chat; with tools,
    its "tool_use" template where it has one, as transformers picks) and encoded without adding special tokens
    again (the template writes BOS itself)."""
    template = tokenizer.tool_use_template if tools and tokenizer.tool_use_template else tokenizer.chat_template
    text = render_chat(messages, template, tokenizer.bos_token, tokenizer.eos_token,
                       add_generation_prompt, tools, continue_final_message, template_kwargs)
    return tokenizer.encode(text, add_special_tokens=False)
