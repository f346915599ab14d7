"""Several prompts in one /v1/completions request (OpenAI's prompt list): one engine request per prompt, run
side by side, their outputs merged.

Batch scorers send them this way (lm-evaluation-harness's `local-completions` with batch_size > 1, usually
with echo and logprobs). Choice i * n + j is completion j of prompt i, as OpenAI numbers them. The requests
are admitted whole or not at all: if one fails before its first output, the others are aborted (their
streams closed) and the error answers the request; once streaming, a failure is reported in-band as for one
prompt.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

from replicas.errors import InvalidRequestError
from replicas.outputs import RequestOutput

MAX_PROMPTS = 256  # per request: more is one client flooding the queue through one connection


def engine_prompts(prompt: Any) -> list[str | dict]:
    """/v1/completions' prompt as engine prompts: a string, token ids, or a list of either (several prompts)."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(t, int) for t in prompt):
        return [{"prompt_token_ids": prompt}]
    if not prompt:
        raise InvalidRequestError([("prompt", "the prompt list is empty")])
    if len(prompt) > MAX_PROMPTS:
        raise InvalidRequestError([("prompt", f"at most {MAX_PROMPTS} prompts a request, got {len(prompt)}")])
    return [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompt]


class Batch:
    """One task per prompt's stream, from its first output to its last (a stream is only ever iterated by its
    own task), its outputs queued in arrival order. Closing cancels the tasks, which closes the streams (their
    requests are aborted). Over Ray Serve each stream's handle call needs an internal request id of its own
    (cluster/deployments.py, _ReplicaBackend.call_generate)."""

    _DONE = object()

    def __init__(self, streams: list[AsyncIterator[RequestOutput]]) -> None:
        self._queue: asyncio.Queue = asyncio.Queue()
        self._running = len(streams)
        self._held: list[tuple[int, RequestOutput]] = []  # seen while waiting for the first outputs
        self._tasks = [asyncio.create_task(self._pump(i, s)) for i, s in enumerate(streams)]

    async def _pump(self, i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                await self._queue.put((i, out))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            await self._queue.put((i, exc))
        finally:
            await self._queue.put((i, self._DONE))

    async def _next(self) -> tuple[int, RequestOutput] | None:
        """The next output of any stream, None once all have ended; a stream's error is raised here."""
        while self._running:
            i, item = await self._queue.get()
            if item is self._DONE:
                self._running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                return i, item
        return None

    async def firsts(self) -> list[RequestOutput]:
        """Each stream's first output (later ones seen meanwhile are held for outputs())."""
        firsts: dict[int, RequestOutput] = {}
        while len(firsts) < len(self._tasks):
            item = await self._next()
            if item is None:
                raise RuntimeError("a prompt's request ended without output")
            if item[0] in firsts:
                self._held.append(item)
            else:
                firsts[item[0]] = item[1]
        return [firsts[i] for i in range(len(self._tasks))]

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) after the first outputs, until every stream has ended."""
        while self._held:
            yield self._held.pop(0)
        while (item := await self._next()) is not None:
            yield item

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def start(streams: list[AsyncIterator[RequestOutput]]) -> tuple[Batch, list[RequestOutput]]:
    """The streams running side by side, and each one's first output; a failure before all have one closes
    every stream and is raised (the request is refused whole)."""
    batch = Batch(streams)
    try:
        return batch, await batch.firsts()
    except BaseException:
        await batch.close()
        raise


async def last_outputs(batch: Batch, firsts: list[RequestOutput]) -> list[RequestOutput]:
    """Each stream's final output."""
    lasts = list(firsts)
    try:
        async for i, out in batch.outputs():
            lasts[i] = out
    finally:
        await batch.close()
    return lasts


async def merged(batch: Batch, firsts: list[RequestOutput]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) as the streams give them, the firsts first; closing it stops every stream."""
    try:
        for i, first in enumerate(firsts):
            yield i, first
        async for item in batch.outputs():
            yield item
    finally:
        await batch.close()
