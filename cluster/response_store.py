"""The response store: finished responses by id, each with the input items that led to it.

GET /v1/responses/{id} reads a stored response, GET /v1/responses/{id}/input_items pages through its input
items, DELETE /v1/responses/{id} forgets it, and previous_response_id continues its conversation. The store is
a bounded LRU in memory, lost on restart: in the process that serves the API (LocalResponses), or, in the Serve
app, in one actor that every ingress replica shares (cluster/response_store_actor.py).

Input items are kept as OpenAI lists them, so that the SDK's item types read them: each has an id (the one the
client sent, else a new one: msg_ for a message, fc_ for a function call, fco_ for a call's output, rs_ for
reasoning) and a status; a message's content is a list of parts, input_text for the user, system and developer
roles, and for the assistant output_text with annotations (the shape of an output message).
"""

from __future__ import annotations

import collections
import uuid
from dataclasses import dataclass
from typing import Any

from cluster.errors import ResponseNotFoundError
from replicas.errors import InvalidRequestError

# Responses an ingress replica keeps, counted, not weighed: each holds its conversation's items up to then.
STORE_SIZE = 1024
ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}
PAGE_LIMIT = (1, 100, 20)  # OpenAI's: the least, the most and the default items on a page of input items


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # as GET /v1/responses/{id} returns it
    inputs: list[dict[str, Any]]  # what led to it: every earlier turn's input and output items, then its input

    @property
    def items(self) -> list[dict[str, Any]]:
        """The conversation through this response, which previous_response_id continues."""
        return self.inputs + self.response["output"]


class ResponseStore:
    """Finished responses by id; past capacity, the least recently stored or read goes first."""

    def __init__(self, capacity: int = STORE_SIZE) -> None:
        if capacity < 1:
            raise ValueError(f"a response store holds at least 1 response, got capacity {capacity}")
        self.capacity = capacity
        self._entries: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: dict[str, Any], inputs: list[dict[str, Any]]) -> None:
        self._entries[response["id"]] = StoredResponse(response, inputs)
        self._entries.move_to_end(response["id"])
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str, field: str | None = None) -> StoredResponse:
        """ResponseNotFoundError (naming field, where a request field gave the id) for one it does not hold."""
        entry = self._entries.get(response_id)
        if entry is None:
            raise ResponseNotFoundError(
                f"response {response_id!r} not found: it was not stored (store false) or was deleted, or is no "
                f"longer kept (the latest {self.capacity} responses are kept, in memory)", field)
        self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> None:
        """Forget a response (ResponseNotFoundError, as get's, for one it does not hold). Responses that
        continued it keep their own copy of the conversation, so they are left as they are."""
        self.get(response_id)
        del self._entries[response_id]


class LocalResponses:
    """A ResponseStore in this process, behind the async methods the routes await (as SharedResponses',
    cluster/response_store_actor.py, whose store every ingress replica shares)."""

    def __init__(self, store: ResponseStore | None = None) -> None:
        self.store = store if store is not None else ResponseStore()

    async def get(self, response_id: str, field: str | None = None) -> StoredResponse:
        return self.store.get(response_id, field)

    async def put(self, response: dict[str, Any], inputs: list[dict[str, Any]]) -> None:
        self.store.put(response, inputs)

    async def delete(self, response_id: str) -> None:
        self.store.delete(response_id)


def stored_inputs(items: list[dict[str, Any]], history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A request's input items (ones the chat translation has read, so of a known type and shape) as the
    store keeps them. history: the stored conversation they continue. A client's id is kept, and must be new
    to the conversation, as OpenAI requires: an item sent again under previous_response_id would be in the
    prompt twice, and paging by `after` needs ids that name one item each."""
    seen = {item["id"] for item in history}
    out = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        item_id = item.get("id")
        if item_id is None:
            item_id = f"{ID_PREFIXES[kind]}_{uuid.uuid4().hex}"
        elif not isinstance(item_id, str) or not item_id:
            raise InvalidRequestError([(f"input[{i}].id", f"an item's id must be a non-empty string, got {item_id!r}")])
        elif item_id in seen:
            raise InvalidRequestError([(f"input[{i}].id", f"item id {item_id!r} is already in the conversation: an "
                                                          f"id names one item (with previous_response_id, send "
                                                          f"only the new items)")])
        seen.add(item_id)
        out.append({**_shaped(kind, item), "id": item_id})
    return out


def _shaped(kind: str, item: dict[str, Any]) -> dict[str, Any]:
    """The item as OpenAI lists it (the module's docstring), its id aside."""
    status = item.get("status") or "completed"
    if kind == "message":
        return {**item, "type": "message", "content": _parts(item.get("content"), item["role"] == "assistant"),
                "status": status}
    if kind == "function_call_output":
        output = item.get("output")
        return {**item, "output": output if isinstance(output, str) else _parts(output, False), "status": status}
    if kind == "reasoning":
        return {**item, "summary": item.get("summary") or []}
    return {**item, "status": status}


def _parts(content: str | list[dict[str, Any]] | None, output: bool) -> list[dict[str, Any]]:
    """Text content as parts: output_text (with its annotations) for what the assistant said, else input_text."""
    parts = [] if content is None else [{"text": content}] if isinstance(content, str) else content
    if output:
        return [{"type": "output_text", "text": p["text"], "annotations": p.get("annotations") or []} for p in parts]
    return [{"type": "input_text", "text": p["text"]} for p in parts]


def input_page(items: list[dict[str, Any]], limit: str | int | None = None, order: str = "desc",
               after: str | None = None) -> dict[str, Any]:
    """One page of a response's input items as OpenAI's list object: up to limit (1 to 100, default 20) items
    in order ("asc": the conversation's first item first; "desc", OpenAI's default: its last first), from the
    one after the item whose id is after. The query's values come as they were sent (strings); an
    InvalidRequestError names each bad one."""
    least, most, default = PAGE_LIMIT
    problems = []
    try:
        count = default if limit is None else int(limit)
    except ValueError:
        count = 0
    if not least <= count <= most:
        problems.append(("limit", f"limit must be an integer from {least} to {most}, got {limit!r}"))
    if order not in ("asc", "desc"):
        problems.append(("order", f'order must be "asc" or "desc", got {order!r}'))
    ordered = items if order == "asc" else items[::-1]
    ids = [item["id"] for item in ordered]
    start = 0
    if after is not None:
        if after in ids:
            start = ids.index(after) + 1
        else:
            problems.append(("after", f"after must be the id of one of the response's input items, got {after!r}"))
    if problems:
        raise InvalidRequestError(problems)
    page = ordered[start:start + count]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": start + count < len(ordered)}
