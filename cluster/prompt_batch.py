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


async def first_outputs(streams: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    """Each stream's first output; on any failure every stream is closed and the first error raised."""
    results = await asyncio.gather(*(anext(s) for s in streams), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        await close_all(streams)
        raise (errors[0] if not isinstance(errors[0], StopAsyncIteration)
               else RuntimeError("a request ended without output"))
    return list(results)


async def close_all(streams: list[AsyncIterator[RequestOutput]]) -> None:
    for s in streams:
        await s.aclose()


async def last_outputs(firsts: list[RequestOutput], streams: list[AsyncIterator[RequestOutput]]
                       ) -> list[RequestOutput]:
    """Each stream's final output (the streams run side by side)."""
    async def last(first: RequestOutput, stream: AsyncIterator[RequestOutput]) -> RequestOutput:
        out = first
        async for out in stream:
            pass
        return out

    try:
        return list(await asyncio.gather(*(last(f, s) for f, s in zip(firsts, streams))))
    except BaseException:
        await close_all(streams)
        raise


async def merged(firsts: list[RequestOutput], streams: list[AsyncIterator[RequestOutput]]
                 ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) as each stream gives them, the firsts first; a stream's error is raised here
    after the other streams are closed."""
    for i, first in enumerate(firsts):
        yield i, first
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, exc))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await close_all(streams)
