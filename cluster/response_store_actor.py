"""The Serve app's response store: one named Ray actor holding a ResponseStore, shared by every ingress replica.

Why: each ingress replica answering from a store of its own made a previous_response_id, GET or DELETE that
Serve routed to another replica a 404 (with ingress.num_replicas above 1, or an ingress autoscaled). The actor
is detached, as the adapter tier is by default, so that it outlives the replica that happened to create it; it
restarts empty after a failure (the store is a cache of conversations, as OpenAI's responses expire too).
Each call is one small round trip to the actor; a conversation is sent whole on put and get.
"""

from __future__ import annotations

from typing import Any

import ray

from cluster.response_store import STORE_SIZE, ResponseStore, StoredResponse

DEFAULT_NAME = "lorafleet-responses"


@ray.remote(num_cpus=0)
class ResponseStoreActor:
    """ResponseStore's methods, remote. Its errors (ResponseNotFoundError) reach the caller as themselves."""

    def __init__(self, capacity: int = STORE_SIZE) -> None:
        self._store = ResponseStore(capacity)

    def put(self, response: dict[str, Any], inputs: list[dict[str, Any]]) -> None:
        self._store.put(response, inputs)

    def get(self, response_id: str, field: str | None = None) -> StoredResponse:
        return self._store.get(response_id, field)

    def delete(self, response_id: str) -> None:
        self._store.delete(response_id)

    def size(self) -> int:
        return len(self._store)


def get_or_create_response_store(name: str = DEFAULT_NAME, namespace: str | None = None, *, detached: bool = True,
                                 capacity: int = STORE_SIZE):
    """The cluster's response-store actor (started with capacity if absent; an existing one is returned as is)."""
    options: dict[str, Any] = dict(name=name, namespace=namespace, get_if_exists=True, max_restarts=-1)
    if detached:
        options["lifetime"] = "detached"
    return ResponseStoreActor.options(**options).remote(capacity)


class SharedResponses:
    """LocalResponses' async methods over the actor: what every ingress replica of the Serve app stores into."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    async def get(self, response_id: str, field: str | None = None) -> StoredResponse:
        return await self.actor.get.remote(response_id, field)

    async def put(self, response: dict[str, Any], inputs: list[dict[str, Any]]) -> None:
        await self.actor.put.remote(response, inputs)

    async def delete(self, response_id: str) -> None:
        await self.actor.delete.remote(response_id)
