"""A Responses API response object, and its stream events, written from the chat path's output.

ChatFormat (cluster/response_formats.py) reads the engine's output as a chat message: reasoning_content (with
the server's reasoning parser), content, and tool_calls (cluster/tool_calls.py). ResponseWriter turns that
message, whole or as stream deltas, into output items in that order: a "reasoning" item (its text in content
as reasoning_text, summary empty, as vLLM returns it), a "message" item with one output_text part, and a
"function_call" item per call. A stream sends each item's life as events: output_item.added, its part's
content_part.added, text deltas, the text's done, content_part.done, output_item.done; a function call's
arguments go out whole, in one function_call_arguments.delta. Every event carries its sequence_number.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from cluster.response_formats import ChatFormat
from cluster.responses_protocol import ResponsesRequest
from replicas.outputs import CompletionOutput, RequestOutput

# per streamed item kind: (id prefix, its part's type, the text's delta and done events)
KINDS = {"message": ("msg", "output_text", "response.output_text.delta", "response.output_text.done"),
         "reasoning": ("rs", "reasoning_text", "response.reasoning_text.delta", "response.reasoning_text.done")}


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _part(kind: str, text: str) -> dict[str, Any]:
    part = {"type": KINDS[kind][1], "text": text}
    return {**part, "annotations": []} if kind == "message" else part


def _item(kind: str, item_id: str, status: str, text: str | None) -> dict[str, Any]:
    """A message or reasoning item; text None: just opened, no part yet."""
    content = [] if text is None else [_part(kind, text)]
    if kind == "message":
        return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}


class _Items:
    """The output items as the output arrives; each change comes back as the events that tell of it."""

    def __init__(self) -> None:
        self.done: list[dict[str, Any]] = []  # finished items, in output order
        self._kind: str | None = None  # the item whose text is streaming, if any
        self._id, self._text = "", ""
        self.reasoning_text = ""

    def _where(self) -> dict[str, Any]:
        return {"item_id": self._id, "output_index": len(self.done), "content_index": 0}

    def _open(self, kind: str) -> list[dict[str, Any]]:
        events = self.close()
        self._kind, self._id, self._text = kind, _new_id(KINDS[kind][0]), ""
        return events + [{"type": "response.output_item.added", "output_index": len(self.done),
                          "item": _item(kind, self._id, "in_progress", None)},
                         {"type": "response.content_part.added", **self._where(), "part": _part(kind, "")}]

    def stream(self, kind: str, delta: str) -> list[dict[str, Any]]:
        """More text of a message or reasoning item, opening it (and closing another) where needed."""
        if not delta:
            return []
        events = self._open(kind) if self._kind != kind else []
        self._text += delta
        if kind == "reasoning":
            self.reasoning_text += delta
        logprobs = {"logprobs": []} if kind == "message" else {}
        return events + [{"type": KINDS[kind][2], **self._where(), "delta": delta, **logprobs}]

    def finish(self, status: str) -> list[dict[str, Any]]:
        """End the output; one with no item at all gets an empty message, so that its output_text reads ""."""
        events = self.close(status)
        return events if self.done else self._open("message") + self.close(status)

    def close(self, status: str = "completed") -> list[dict[str, Any]]:
        """End the streaming item, if any."""
        kind = self._kind
        if kind is None:
            return []
        logprobs = {"logprobs": []} if kind == "message" else {}
        item = _item(kind, self._id, status, self._text)
        events = [{"type": KINDS[kind][3], **self._where(), "text": self._text, **logprobs},
                  {"type": "response.content_part.done", **self._where(), "part": _part(kind, self._text)},
                  {"type": "response.output_item.done", "output_index": len(self.done), "item": item}]
        self.done.append(item)
        self._kind = None
        return events

    def calls(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The chat's tool_calls as function_call items, each streamed whole."""
        events = self.close() if calls else []
        for call in calls:
            fn, item_id, at = call["function"], _new_id("fc"), len(self.done)
            item = {"id": item_id, "type": "function_call", "call_id": call["id"], "name": fn["name"],
                    "arguments": fn["arguments"], "status": "completed"}
            where = {"item_id": item_id, "output_index": at}
            events += [{"type": "response.output_item.added", "output_index": at,
                        "item": {**item, "arguments": "", "status": "in_progress"}},
                       {"type": "response.function_call_arguments.delta", **where, "delta": fn["arguments"]},
                       {"type": "response.function_call_arguments.done", **where, "name": fn["name"],
                        "arguments": fn["arguments"]},
                       {"type": "response.output_item.done", "output_index": at, "item": item}]
            self.done.append(item)
        return events


class ResponseWriter:
    """One response: its object (echoing the request's settings) and, streamed, its events as SSE lines."""

    def __init__(self, body: ResponsesRequest, fmt: ChatFormat, backend: Any) -> None:
        self.body, self.fmt, self.backend = body, fmt, backend
        self.id = _new_id("resp")
        self.created = int(time.time())
        self.items = _Items()
        self._sequence = 0

    def response(self, status: str, usage: dict[str, Any] | None = None) -> dict[str, Any]:
        b = self.body
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "completed_at": int(time.time()) if status == "completed" else None, "background": False,
                "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "max_tool_calls": None,
                "metadata": b.metadata or {}, "model": b.model, "output": list(self.items.done),
                "parallel_tool_calls": b.parallel_tool_calls, "previous_response_id": b.previous_response_id,
                "reasoning": b.reasoning, "store": b.store,
                "temperature": 1.0 if b.temperature is None else b.temperature,
                "text": {"format": b.text.format.echo()}, "tool_choice": b.tool_choice, "tools": b.tools,
                "top_p": 1.0 if b.top_p is None else b.top_p, "truncation": "disabled", "usage": usage, "user": b.user}

    def full(self, last: RequestOutput) -> dict[str, Any]:
        """The finished response of the request's last output."""
        (choice,) = self.fmt.full(last)["choices"]
        self._read(choice["message"])
        return self._finish(last)[1]

    def opening(self) -> list[str]:
        start = self.response("in_progress")
        return [self.sse({"type": "response.created", "response": start}),
                self.sse({"type": "response.in_progress", "response": start})]

    def chunk(self, delta: str, c: CompletionOutput, finished: bool, new_ids: list[int]) -> list[str]:
        """The events for one output's news (CompletionDeltas')."""
        chunk = self.fmt.chunk(delta, c, finished, new_ids)
        return [self.sse(e) for e in self._read(chunk["choices"][0]["delta"])] if chunk is not None else []

    def closing(self, last: RequestOutput) -> tuple[list[str], dict[str, Any]]:
        """The events that end the stream, response.completed last, and the finished response."""
        events, response = self._finish(last)
        return [self.sse(e) for e in events] + [self.sse({"type": "response.completed", "response": response})], \
            response

    def error(self, error: dict[str, Any]) -> str:
        """An error after the stream opened (error_response's body's "error"), reported in-band."""
        return self.sse({"type": "error", "code": error["type"], "message": error["message"],
                         "param": error["param"]})

    def sse(self, event: dict[str, Any]) -> str:
        event["sequence_number"], self._sequence = self._sequence, self._sequence + 1
        return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"

    def _read(self, message: dict[str, Any]) -> list[dict[str, Any]]:
        """A chat message (the whole, or a stream's delta) as item events."""
        return (self.items.stream("reasoning", message.get("reasoning_content") or "")
                + self.items.stream("message", message.get("content") or "")
                + self.items.calls(message.get("tool_calls") or []))

    def _finish(self, last: RequestOutput) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        (c,) = last.outputs
        status = "incomplete" if c.finish_reason == "length" else "completed"
        events = self.items.finish(status)
        return events, self.response(status, self._usage(last, c))

    def _usage(self, last: RequestOutput, c: CompletionOutput) -> dict[str, Any]:
        reasoning = self.items.reasoning_text
        thought = len(self.backend.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        p, g = len(last.prompt_token_ids), len(c.token_ids)
        return {"input_tokens": p, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                "output_tokens": g, "output_tokens_details": {"reasoning_tokens": thought}, "total_tokens": p + g}
