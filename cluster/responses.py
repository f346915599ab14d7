"""OpenAI's Responses API, as vLLM serves it: POST /v1/responses and GET /v1/responses/{response_id}.

A response runs as a chat completion: the request is translated into one (cluster/responses_protocol.py),
which runs through the chat path (cluster/chat_request.py: sampling, tool plan, structured outputs, reasoning
parser), and its output comes back as output items and, streamed, as Responses events
(cluster/responses_output.py).

Finished responses are kept (store true, the default) in a ResponseStore on the ingress replica that served
them: a bounded LRU in memory, not shared between ingress replicas and lost on restart. It is what GET
/v1/responses/{id} reads and what previous_response_id continues: the stored conversation (every earlier
turn's input and output items) comes before the new input.
"""

from __future__ import annotations

import collections
import json
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse

from cluster.chat_request import chat_generation
from cluster.errors import ResponseNotFoundError
from cluster.responses_output import ResponseWriter
from cluster.responses_protocol import ResponsesRequest
from cluster.server import GenerateRequest
from replicas.errors import InvalidRequestError
from replicas.outputs import CompletionDeltas, RequestOutput

# Responses an ingress replica keeps, counted, not weighed: each holds its conversation's items up to then.
STORE_SIZE = 1024

Outputs = tuple[RequestOutput, AsyncIterator[RequestOutput]]
Start = Callable[[GenerateRequest, str], Awaitable["Outputs | JSONResponse"]]


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # as GET /v1/responses/{id} returns it
    items: list[dict[str, Any]]  # the conversation through this response: earlier turns, its input, its output


class ResponseStore:
    """Finished responses by id; past capacity, the least recently stored or read goes first."""

    def __init__(self, capacity: int = STORE_SIZE) -> None:
        if capacity < 1:
            raise ValueError(f"a response store holds at least 1 response, got capacity {capacity}")
        self.capacity = capacity
        self._entries: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: dict[str, Any], items: list[dict[str, Any]]) -> None:
        self._entries[response["id"]] = StoredResponse(response, items)
        self._entries.move_to_end(response["id"])
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str, field: str | None = None) -> StoredResponse:
        """ResponseNotFoundError (naming field, where a request field gave the id) for one it does not hold."""
        entry = self._entries.get(response_id)
        if entry is None:
            raise ResponseNotFoundError(
                f"response {response_id!r} not found: it was not stored (store false), or is no longer kept (this "
                f"ingress replica keeps its latest {self.capacity} responses in memory), or another replica "
                f"served it", field)
        self._entries.move_to_end(response_id)
        return entry


def add_response_routes(app: FastAPI, backend: Any, error_response: Callable[[BaseException], JSONResponse],
                        start: Start, store: ResponseStore | None = None) -> None:
    """start(GenerateRequest, model): the request's first output and all its outputs (api.py's), or the
    JSONResponse of the error it met first. The store is app.state.responses."""
    store = store if store is not None else ResponseStore()
    app.state.responses = store

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest):
        try:
            history = store.get(body.previous_response_id, "previous_response_id").items \
                if body.previous_response_id is not None else []
            req, fmt = chat_generation(body.chat_request(history), backend)
        except (InvalidRequestError, ResponseNotFoundError) as exc:
            return error_response(exc)
        started = await start(req, body.model)
        if isinstance(started, JSONResponse):
            return started
        writer = ResponseWriter(body, fmt, backend)
        _, outputs = started

        def keep(response: dict[str, Any]) -> None:
            if body.store:
                store.put(response, history + body.input_items() + response["output"])

        if not body.stream:
            async for last in outputs:
                pass
            response = writer.full(last)
            keep(response)
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
            keep(response)  # before response.completed goes out: a client may retrieve it straight away
            for line in lines:
                yield line

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str):
        try:
            return JSONResponse(store.get(response_id).response)
        except ResponseNotFoundError as exc:
            return error_response(exc)
