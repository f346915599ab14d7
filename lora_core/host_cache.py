"""HostLRUCache: the per-replica host tier of adapters, least recently used first.

Eviction is two-phase: victims are chosen first (skipping pinned keys and
any key ``can_evict`` refuses, e.g. adapters in use by the running batch),
and only if enough can go are they removed and ``on_evict`` called. So a
``put`` that cannot make room raises LoRACapacityError and changes nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Generic, Hashable, Iterator, TypeVar

from lora_core.errors import LoRACapacityError, UnknownLoRAError

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class HostLRUCache(Generic[K, V]):
    """An LRU of at most ``capacity`` entries with pins and a veto on eviction.

    can_evict(key) -> bool: asked for each candidate victim; False protects it.
    on_evict(key, value): called after a victim left the cache.
    """

    def __init__(self, capacity: int, *, can_evict: Callable[[K], bool] | None = None,
                 on_evict: Callable[[K, V], None] | None = None) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be a positive integer, got {capacity!r}")
        self.capacity = capacity
        self._can_evict = can_evict
        self._on_evict = on_evict
        self._entries: OrderedDict[K, V] = OrderedDict()
        self._pinned: set[K] = set()

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[K]:
        """Keys, least recently used first."""
        return iter(list(self._entries))

    def _require(self, key: K) -> None:
        if key not in self._entries:
            raise UnknownLoRAError(f"LoRA adapter {key!r} is not in the host cache")

    def get(self, key: K) -> V:
        """The value, marked most recently used."""
        self._require(key)
        self._entries.move_to_end(key)
        return self._entries[key]

    def peek(self, key: K) -> V:
        """The value, recency unchanged."""
        self._require(key)
        return self._entries[key]

    def touch(self, key: K) -> None:
        self._require(key)
        self._entries.move_to_end(key)

    def is_pinned(self, key: K) -> bool:
        return key in self._pinned

    def pin(self, key: K) -> None:
        self._require(key)
        self._pinned.add(key)

    def unpin(self, key: K) -> None:
        self._pinned.discard(key)

    def evictable(self, exclude: set[K] | frozenset[K] = frozenset()) -> list[K]:
        """Keys that eviction may take, least recently used first."""
        return [k for k in self._entries
                if k not in self._pinned and k not in exclude and (self._can_evict is None or self._can_evict(k))]

    def put(self, key: K, value: V) -> list[K]:
        """Insert (or replace) ``key`` as most recently used; returns the evicted keys."""
        if key in self._entries:
            self._entries[key] = value
            self._entries.move_to_end(key)
            return []
        overflow = len(self._entries) + 1 - self.capacity
        victims = self.evictable()[:max(overflow, 0)]
        if len(victims) < overflow:
            raise LoRACapacityError(
                f"host cache is full ({self.capacity} adapters) and every one is pinned or in use")
        for victim in victims:
            self._drop(victim)
        self._entries[key] = value
        return victims

    def remove(self, key: K) -> V:
        """Remove ``key`` whatever its pin; on_evict is not called (the caller asked)."""
        self._require(key)
        self._pinned.discard(key)
        return self._entries.pop(key)

    def _drop(self, key: K) -> None:
        value = self._entries.pop(key)
        self._pinned.discard(key)
        if self._on_evict is not None:
            self._on_evict(key, value)
