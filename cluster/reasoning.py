"""Reasoning in chat completions: a model's thinking apart from its answer (vLLM's --reasoning-parser).

Reasoning models think between <think> and </think>, then answer. With ServerConfig.reasoning_parser set,
/v1/chat/completions returns the thinking as the message's `reasoning_content` (a stream: each delta's) and
only the answer as `content`, which is also where the tool-call parser looks for calls. Two families:

- "deepseek_r1" (DeepSeek-R1 and its distills; Qwen3's Thinking-2507 models): the chat template opens
  <think> in the prompt, so the output starts inside the thinking. An output with no </think> is all
  reasoning (max_tokens cut it mid-thought).
- "qwen3" (Qwen3, QwQ): the model opens <think> itself, and an output that does not open it is all answer:
  chat_template_kwargs {"enable_thinking": false} makes the template write an empty think block, and the
  model answers straight away.

A request whose output's shape a grammar fixes (response_format, structured_outputs, a forced tool call) is
split only where its output opens <think> itself: the grammar wrote the output from its first token, so a
deepseek_r1 prompt's open <think> is not what it continues.
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.tool_parsers import held_prefix

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    """Splits an output into (reasoning, content); starts_inside: the prompt opened <think> already."""

    starts_inside: bool

    def split(self, text: str, finished: bool = True) -> tuple[str | None, str]:
        """(reasoning or None, content) of the output so far. While unfinished, what may still turn out to be
        a tag is in neither, and each part only grows from one call to the next, so a stream sends each
        part's new characters."""
        inside, body = self.starts_inside, text
        opened = text.lstrip()
        if not finished and len(opened) < len(START) and START.startswith(opened):
            return ("" if inside else None), ""  # nothing yet, or the start of <think>
        if opened.startswith(START):  # opened by the model (a deepseek_r1 model may open it again)
            inside, body = True, opened[len(START):]
        if not inside:
            return None, body
        end = body.find(END)
        if end >= 0:  # the answer without the blank lines that set it off
            return body[:end], body[end + len(END):].lstrip()
        return (body if finished else body[: len(body) - held_prefix(body, END)]), ""

    def opened_by_output(self) -> "ReasoningParser":
        """This parser for an output that starts outside any thinking (a grammar wrote it)."""
        return ReasoningParser(starts_inside=False)


PARSERS = {"deepseek_r1": ReasoningParser(starts_inside=True), "qwen3": ReasoningParser(starts_inside=False)}


def reasoning_parser(name: str | None) -> ReasoningParser | None:
    """The parser called name; None for None. An unknown name is a configuration error."""
    if name is None:
        return None
    if name not in PARSERS:
        raise ValueError(f"reasoning_parser must be one of {sorted(PARSERS)} or null, got {name!r}")
    return PARSERS[name]
