"""OpenAI response bodies: a request's final output as one JSON body, or its deltas as SSE chunks.

CompletionFormat writes /v1/completions' (text_completion: echo, legacy logprobs), ChatFormat
/v1/chat/completions' (chat.completion and its chunks: the role first, top_logprobs, tool calls, reasoning).
Both number choices i * n + j over several prompts (cluster/prompt_batch.py), count usage, and stream each
token's logprobs with the chunk that brings it.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import replace
from typing import Any

from cluster.reasoning import ReasoningParser
from cluster.tool_calls import ToolPlan
from replicas.outputs import CompletionOutput, RequestOutput


def _last(items: list, n: int | None) -> list:
    """items' last n (n None: all of them; 0: none)."""
    return items if n is None else items[len(items) - n:]


class Format:
    """One response's id and numbering. Subclasses write a choice of the full body (choice(completion)) and a
    stream's chunk for a completion's news (chunk(text delta, completion, finished, new token ids), None when
    there is nothing to send)."""

    object_full = ""
    object_chunk = ""
    prefix = ""

    def __init__(self, body: Any, backend: Any) -> None:
        self.body, self.backend = body, backend
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.body.model, "choices": choices}

    @staticmethod
    def usage(*outs: RequestOutput) -> dict:
        """Tokens of one request's outputs, or summed over several prompts'."""
        p = sum(len(out.prompt_token_ids) for out in outs)
        g = sum(len(choice.token_ids) for out in outs for choice in out.outputs)
        return {"prompt_tokens": p, "completion_tokens": g, "total_tokens": p + g}

    def usage_chunk(self, *outs: RequestOutput) -> dict:
        chunk = self._envelope(self.object_chunk, [])
        chunk["usage"] = self.usage(*outs)
        return chunk

    def begin(self, first: RequestOutput, base: int = 0) -> None:
        """A prompt's first output, before any of its chunks; its choices are numbered from base."""

    def full(self, *outs: RequestOutput) -> dict:
        """The whole response of one prompt's final output, or of several prompts' (choice i * n + j)."""
        choices = []
        for i, out in enumerate(outs):
            base = i * self.body.n
            self.begin(out, base)
            choices += [self.choice(replace(c, index=base + c.index)) for c in out.outputs]
        body = self._envelope(self.object_full, choices)
        body["usage"] = self.usage(*outs)
        return body


class CompletionFormat(Format):
    object_full = object_chunk = "text_completion"
    prefix = "cmpl"

    # echo: the prompt's text leads each choice's text (streamed: its first chunk), and with logprobs its tokens
    # lead the logprobs, the first with none (nothing predicts it), as OpenAI's legacy API and vLLM give them:
    # what scoring a text's likelihood (e.g. lm-evaluation-harness) reads.
    def __init__(self, body: Any, backend: Any) -> None:
        super().__init__(body, backend)
        self._prompt_of: dict[int, RequestOutput] = {}  # choice index -> an output of its prompt (echo)
        self._echoed: set[int] = set()  # choices whose first chunk went out

    def begin(self, first: RequestOutput, base: int = 0) -> None:
        if self.body.echo:
            self._prompt_of.update({base + c.index: first for c in first.outputs})

    def _echo_text(self, index: int) -> str:
        prompt = self._prompt_of.get(index)
        if prompt is None:
            return ""
        return prompt.prompt if prompt.prompt is not None else "".join(map(self.backend.decode_token,
                                                                           prompt.prompt_token_ids))

    def _logprobs(self, c: CompletionOutput, new: int | None = None, with_prompt: bool = True) -> dict | None:
        """The choice's logprobs: all, or (a stream's chunk) its last `new` tokens', the echoed prompt's first."""
        if c.logprobs is None:
            return None
        decode = self.backend.decode_token
        ids, steps = _last(list(c.token_ids), new), _last(list(c.logprobs), new)
        prompt = self._prompt_of.get(c.index)
        if with_prompt and prompt is not None and prompt.prompt_logprobs is not None:
            ids, steps = prompt.prompt_token_ids + ids, prompt.prompt_logprobs + steps
        return {"tokens": [decode(t) for t in ids],
                "token_logprobs": [None if lp is None else lp.get(t) for lp, t in zip(steps, ids)],
                "top_logprobs": [None if lp is None else {decode(k): v for k, v in lp.items()} for lp in steps],
                "text_offset": None}

    def choice(self, c: CompletionOutput) -> dict:
        return {"index": c.index, "text": self._echo_text(c.index) + c.text, "logprobs": self._logprobs(c),
                "finish_reason": c.finish_reason}

    def chunk(self, delta: str, c: CompletionOutput, finished: bool, new_ids: list[int] = ()) -> dict | None:
        first = c.index not in self._echoed
        if first:
            self._echoed.add(c.index)
            delta = self._echo_text(c.index) + delta
        logprobs = self._logprobs(c, len(new_ids), with_prompt=first)
        if logprobs is not None and not logprobs["tokens"]:
            logprobs = None
        if not delta and not finished and logprobs is None:
            return None
        return self._envelope(self.object_chunk, [{"index": c.index, "text": delta, "logprobs": logprobs,
                                                   "finish_reason": c.finish_reason if finished else None}])


class ChatFormat(Format):
    object_full, object_chunk = "chat.completion", "chat.completion.chunk"
    prefix = "chatcmpl"

    def __init__(self, body: Any, backend: Any, tools: ToolPlan | None = None,
                 reasoning: ReasoningParser | None = None) -> None:
        super().__init__(body, backend)
        self._started: set[int] = set()  # choices whose role went out
        # With tools (cluster/tool_calls.py): a forced call's output is JSON for tool_calls, streamed whole in the
        # choice's last chunk; under "auto" the content streams up to where a call may begin (the parser's
        # content_end), and what follows goes out in the last chunk, as calls or as content.
        self.tools = tools
        # With a reasoning parser (cluster/reasoning.py) the output's thinking goes out as reasoning_content
        # (include_reasoning false: not at all), and only the answer is content, where tool calls are found.
        self.reasoning = reasoning
        self._sent: dict[int, int] = {}  # content characters streamed per choice
        self._sent_reasoning: dict[int, int] = {}  # reasoning characters streamed per choice

    def _logprobs(self, c: CompletionOutput, new: int | None = None) -> dict | None:
        """The choice's logprobs: all, or (a stream's chunk) its last `new` tokens'."""
        if c.logprobs is None:
            return None
        decode = self.backend.decode_token

        def entry(token: int, logprob: float) -> dict:
            text = decode(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        content = []
        for token, step in zip(_last(list(c.token_ids), new), _last(list(c.logprobs), new)):
            top = sorted(step.items(), key=lambda kv: -kv[1])[: self.body.top_logprobs or 0]
            content.append({**entry(token, step[token]), "top_logprobs": [entry(t, v) for t, v in top]})
        return {"content": content}

    def _parts(self, c: CompletionOutput, finished: bool = True) -> tuple[str | None, str]:
        """(reasoning or None, content) of the output so far."""
        return self.reasoning.split(c.text, finished) if self.reasoning is not None else (None, c.text)

    def _message(self, content: str) -> dict[str, Any]:
        return self.tools.message(content) if self.tools is not None else {"content": content}

    def _finish_reason(self, c: CompletionOutput, message: dict[str, Any]) -> str | None:
        """OpenAI's "tool_calls" where the model chose to call ("auto"); a forced call ends as "stop", as in vLLM."""
        chose = self.tools is not None and self.tools.parser is not None and "tool_calls" in message
        return "tool_calls" if chose and c.finish_reason == "stop" else c.finish_reason

    def choice(self, c: CompletionOutput) -> dict:
        reasoning, content = self._parts(c)
        message = self._message(content)
        if reasoning is not None:
            message["content"] = message["content"] or None  # thought to the end, no answer (max_tokens)
            if self.body.include_reasoning:
                message["reasoning_content"] = reasoning
        return {"index": c.index, "message": {"role": "assistant", **message}, "logprobs": self._logprobs(c),
                "finish_reason": self._finish_reason(c, message)}

    def chunk(self, delta: str, c: CompletionOutput, finished: bool, new_ids: list[int] = ()) -> dict | None:
        message: dict[str, Any] = {}
        if c.index not in self._started:
            message["role"] = "assistant"
            self._started.add(c.index)
        finish_reason = c.finish_reason if finished else None
        reasoning, content = self._parts(c, finished)
        if reasoning is not None and self.body.include_reasoning:
            sent = self._sent_reasoning.get(c.index, 0)
            if len(reasoning) > sent:
                message["reasoning_content"] = reasoning[sent:]
                self._sent_reasoning[c.index] = len(reasoning)
        sent, end = self._sent.get(c.index, 0), len(content)
        if self.tools is not None and finished:
            whole = self._message(content)
            finish_reason = self._finish_reason(c, whole)
            if whole.get("tool_calls"):
                message["tool_calls"] = [{"index": k, **call} for k, call in enumerate(whole["tool_calls"])]
                content, end = whole["content"] or "", len(whole["content"] or "")
        elif self.tools is not None:  # a forced call goes out whole at the end; "auto" holds back a call's start
            end = self.tools.parser.content_end(content) if self.tools.parser is not None else sent
        if end > sent:
            message["content"] = content[sent:end]
            self._sent[c.index] = end
        logprobs = self._logprobs(c, len(new_ids)) if self.tools is None and new_ids else None
        if not message and not finished and not logprobs:
            return None
        return self._envelope(self.object_chunk, [{"index": c.index, "delta": message, "logprobs": logprobs,
                                                   "finish_reason": finish_reason}])
