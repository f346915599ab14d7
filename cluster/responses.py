"""OpenAI's Responses API, as vLLM serves it: POST /v1/responses, and for a stored response GET and DELETE
/v1/responses/{response_id} and GET /v1/responses/{response_id}/input_items.

A response runs as a chat completion: the request is translated into one (cluster/responses_protocol.py),
which runs through the chat path (cluster/chat_request.py: sampling, tool plan, structured outputs, reasoning
parser), and its output comes back as output items and, streamed, as Responses events
(cluster/responses_output.py).

Finished responses are kept (store true, the default) in a ResponseStore (cluster/response_store.py): a bounded
LRU in memory, lost on restart, in this process or (the Serve app) in an actor that every ingress replica
shares (cluster/response_store_actor.py). It is what the GET and DELETE routes read and what
previous_response_id continues: the stored conversation (every earlier turn's input and output items) comes
before the new input.
"""

from __future__ import annotations

import json
import logging
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse

from cluster.chat_request import chat_generation
from cluster.errors import ResponseNotFoundError
from cluster.request_limits import MAX_PROMPT_CHARS, check_prompt_chars
from cluster.response_store import LocalResponses, input_page, stored_inputs
from cluster.responses_output import ResponseWriter
from cluster.responses_protocol import ResponsesRequest
from cluster.server import GenerateRequest
from replicas.errors import InvalidRequestError
from replicas.outputs import CompletionDeltas, RequestOutput

logger = logging.getLogger(__name__)

Outputs = tuple[RequestOutput, AsyncIterator[RequestOutput]]
Start = Callable[[GenerateRequest, str], Awaitable["Outputs | JSONResponse"]]


def add_response_routes(app: FastAPI, backend: Any, error_response: Callable[[BaseException], JSONResponse],
                        start: Start, store: Any = None, *, max_prompt_chars: int = MAX_PROMPT_CHARS) -> None:
    """start(GenerateRequest, model): the request's first output and all its outputs (api.py's), or the
    JSONResponse of the error it met first. store: LocalResponses (the default: a ResponseStore here) or
    SharedResponses (the Serve app's actor); it is app.state.responses. max_prompt_chars bounds the whole
    conversation a response renders, the stored one included (cluster/request_limits.py)."""
    store = store if store is not None else LocalResponses()
    app.state.responses = store

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest):
        try:
            history = (await store.get(body.previous_response_id, "previous_response_id")).items \
                if body.previous_response_id is not None else []
            chat = body.chat_request(history)
            check_prompt_chars("input", chat.prompt_chars(), max_prompt_chars)
            req, fmt = chat_generation(chat, backend)
            inputs = history + stored_inputs(body.input_items(), history)
        except (InvalidRequestError, ResponseNotFoundError) as exc:
            return error_response(exc)
        started = await start(req, body.model)
        if isinstance(started, JSONResponse):
            return started
        writer = ResponseWriter(body, fmt, backend)
        _, outputs = started

        async def keep(response: dict[str, Any]) -> None:
            if not body.store:
                return
            try:
                await store.put(response, inputs)
            except Exception:  # noqa: BLE001 - the store is a cache: the answer goes out unstored, not lost
                logger.warning("response %s not stored", response["id"], exc_info=True)

        if not body.stream:
            async for last in outputs:
                pass
            response = writer.full(last)
            await keep(response)
            return JSONResponse(response)

        async def events() -> AsyncIterator[str]:
            for line in writer.opening():
                yield line
            deltas = CompletionDeltas()
            try:
                async for last in outputs:
                    for c, delta, ids, finished in deltas(last):
                        for line in writer.chunk(delta, c, finished, ids):
                            yield line
            except Exception as exc:  # noqa: BLE001 - the stream is open: report in-band, then close
                yield writer.error(json.loads(error_response(exc).body)["error"])
                return
            lines, response = writer.closing(last)
            await keep(response)  # before response.completed goes out: a client may retrieve it straight away
            for line in lines:
                yield line

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str):
        try:
            return JSONResponse((await store.get(response_id)).response)
        except ResponseNotFoundError as exc:
            return error_response(exc)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        try:
            await store.delete(response_id)
        except ResponseNotFoundError as exc:
            return error_response(exc)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    # The query's values are read as strings and checked by input_page, so that a bad one is a 400 that names
    # it ("limit", not FastAPI's "query.limit") and says what it takes. include is accepted and ignored: nothing
    # is kept that it could add.
    @app.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(response_id: str, limit: str | None = None, order: str = "desc",
                               after: str | None = None):
        try:
            return JSONResponse(input_page((await store.get(response_id)).inputs, limit, order, after))
        except (InvalidRequestError, ResponseNotFoundError) as exc:
            return error_response(exc)
