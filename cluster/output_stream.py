"""A request's outputs across the Serve handle as deltas: the replica encodes, the ingress decodes.

The engine reports a cumulative RequestOutput after every step: the prompt's ids and text, every token so
far, all its text and logprobs. Streamed across the handle as they were, each step's chunk carried all of
it again (a 1,000-token answer to a 500-token prompt: ~1,000 chunks of ~10 KB), deep-copied first by
dataclasses.asdict on the replica's event loop, which the engine's outputs share: 0.4 - 3 ms a chunk at 10 -
4,000 tokens, 11 - 47 ms with logprobs at 1,000 - 4,000, for every request at every step
(bench/stream_encoding.py).

DeltaEncoder (replica side) sends the first output whole and then, for each completion, only what it
gained: the new text, token ids and logprobs, and its finish reason; the prompt's fields go once (prompt
logprobs as they grow). DeltaDecoder (ingress side) rebuilds the cumulative RequestOutputs, equal to the
engine's, so the HTTP, gRPC and Python handle APIs above it are unchanged. A field that shrank (none does
today: the detokenizer holds back what a stop string might still take) is sent whole, marked as such.

coalesced (replica side) sends at most one chunk per interval (ServerConfig.stream_interval_ms): a Serve
stream item costs ~0.4-0.5 ms of host time between the two processes (2 CPU cores, measured), and an 8B
model's engine step on an H200 (~6 ms) makes one for each of 32 streams, more than a replica can pass on.
Ray Serve LLM batches its streams the same way. The first output and the last go at once; between them the
latest cumulative output stands for those it replaced (the encoder sends what they all added).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator

from replicas.outputs import CompletionOutput, RequestOutput

GROWING = ("text", "token_ids", "logprobs")  # a completion's fields that only grow while it runs


def _tail(value, sent: int) -> tuple[Any, bool]:
    """(what value gained past its first `sent` items, False), or (all of it, True) where it shrank."""
    if value is None or len(value) < sent:
        return value, True
    return value[sent:], False


class DeltaEncoder:
    """One request's outputs -> wire dicts (plain values: Ray pickles them as they are)."""

    def __init__(self) -> None:
        self._sent: dict[int, dict[str, int]] = {}  # per completion index: items of each field sent
        self._prompt_logprobs = 0
        self._first = True

    def encode(self, out: RequestOutput) -> dict:
        item: dict[str, Any] = {"request_id": out.request_id, "finished": out.finished, "error": out.error,
                                "order": [c.index for c in out.outputs], "completions": []}
        if self._first:
            self._first = False
            item.update(prompt=out.prompt, prompt_token_ids=out.prompt_token_ids, lora_name=out.lora_name)
        if out.prompt_logprobs is not None:
            item["prompt_logprobs"], item["prompt_logprobs_whole"] = _tail(out.prompt_logprobs, self._prompt_logprobs)
            self._prompt_logprobs = len(out.prompt_logprobs)
        for c in out.outputs:
            sent = self._sent.setdefault(c.index, {})
            entry: dict[str, Any] = {"index": c.index, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            for name in GROWING:
                value = getattr(c, name)
                entry[name], whole = _tail(value, sent.get(name, 0))
                if whole:
                    entry[name + "_whole"] = True
                sent[name] = 0 if value is None else len(value)
            item["completions"].append(entry)
        return item


class DeltaDecoder:
    """DeltaEncoder's wire dicts -> the cumulative RequestOutputs they were made from (each with lists of its
    own, as the engine's are)."""

    def __init__(self) -> None:
        self._head: dict[str, Any] = {}
        self._prompt_logprobs: list | None = None
        self._completions: dict[int, dict[str, Any]] = {}

    def decode(self, item: dict) -> RequestOutput:
        for name in ("prompt", "prompt_token_ids", "lora_name"):
            if name in item:
                self._head[name] = item[name]
        if "prompt_logprobs" in item:
            self._prompt_logprobs = _grow(self._prompt_logprobs, item["prompt_logprobs"],
                                          item.get("prompt_logprobs_whole", False))
        for entry in item["completions"]:
            held = self._completions.setdefault(entry["index"], {})
            for name in GROWING:
                held[name] = _grow(held.get(name), entry[name], entry.get(name + "_whole", False))
            held["finish_reason"], held["stop_reason"] = entry["finish_reason"], entry["stop_reason"]
        outputs = [self._completion(index) for index in item["order"]]
        return RequestOutput(item["request_id"], self._head["prompt"], list(self._head["prompt_token_ids"]),
                             outputs, item["finished"], self._head["lora_name"], item["error"],
                             prompt_logprobs=None if self._prompt_logprobs is None else list(self._prompt_logprobs))

    def _completion(self, index: int) -> CompletionOutput:
        held = self._completions[index]
        logprobs = held["logprobs"]
        return CompletionOutput(index, held["text"], list(held["token_ids"]),
                                None if logprobs is None else list(logprobs), held["finish_reason"],
                                held["stop_reason"])


def output_dict(out: RequestOutput) -> dict:
    """dataclasses.asdict(out) without its deep copy (the Python handle's answer: Ray pickles it for the
    caller anyway, and asdict of a 1,000-token output with logprobs took 11 ms on the ingress's loop)."""
    fields = {name: getattr(out, name) for name in out.__dataclass_fields__}
    fields["outputs"] = [{name: getattr(c, name) for name in c.__dataclass_fields__} for c in out.outputs]
    return fields


def _grow(held, gained, whole: bool):
    """held extended by gained (a list in place; text), or gained itself where it was sent whole (or is the
    first). The lists are the decoder's own (unpickled for it), and outputs get copies of them."""
    if whole or held is None:
        return list(gained) if isinstance(gained, list) else gained  # not the wire's: the lists grow in place
    if isinstance(held, list):
        held.extend(gained)
        return held
    return held + gained


async def coalesced(outputs: AsyncIterator[RequestOutput], interval_s: float) -> AsyncIterator[RequestOutput]:
    """outputs, at most one per interval_s after the first (the latest of those that arrived meanwhile); a
    finished output at once. Closing this closes outputs (the engine aborts the request): the reader task is
    cancelled inside the source's await."""
    if interval_s <= 0:
        async for out in outputs:
            yield out
        return
    latest: list[RequestOutput] = []  # the newest output not yet passed on (at most one)
    arrived, ended = asyncio.Event(), asyncio.Event()
    failure: list[BaseException] = []

    async def read() -> None:
        try:
            async for out in outputs:
                latest[:] = [out]
                arrived.set()
                if out.finished:
                    ended.set()
        except Exception as exc:  # noqa: BLE001 - the request's error, raised to the reader below
            failure.append(exc)
        finally:
            ended.set()
            arrived.set()

    reader = asyncio.create_task(read())
    try:
        sent_at = None
        while True:
            await arrived.wait()
            if sent_at is not None and not ended.is_set():
                try:  # more outputs may land meanwhile; the last one cuts the wait short
                    await asyncio.wait_for(ended.wait(), sent_at + interval_s - time.monotonic())
                except asyncio.TimeoutError:
                    pass
            arrived.clear()
            if latest:
                out = latest.pop()
                yield out
                sent_at = time.monotonic()
            if ended.is_set() and not latest:
                await reader
                if failure:
                    raise failure[0]
                return
    finally:
        reader.cancel()
