"""Where a replica's host-tier load comes from: our cluster tier, or Ray Serve LLM's per-replica download.

SharedTier drives the app's AdapterTier (cluster/adapter_tier.py) for its LRU
by bytes: one object-store copy per cluster, held on the node of the tier's
actor; a miss is fetched from the origin once however many replicas wait on
it. AdapterTier's fetch path reads and validates real files, so the simulator
calls the two methods that hold the cache rule (cache_hit, admit: evicting by
bytes) with a placeholder value. Origin fetches run `fetch_workers` at a time
(the tier's fetch pool, AdapterTier.fetch_concurrency), the rest queued in order.

PerReplicaDownload is Ray Serve LLM's LoRA loader (ray/llm/_internal/serve/
utils/lora_serve_utils.py): each replica keeps its own record of adapters it
downloaded (disk_cache) and syncs the files from the origin to node-local disk
the first time it uses one, then loads from that disk.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

from cluster.adapter_tier import DEFAULT_FETCH_CONCURRENCY, AdapterTier

from cluster.simulator.calibration import StepModel, TierCosts
from cluster.simulator.events import EventLoop


@dataclass
class TierCounters:
    origin_fetches: int = 0
    store_reads_same_node: int = 0
    store_reads_other_node: int = 0
    disk_reads: int = 0


def _no_uri(uri: str):
    raise ValueError("the simulator's tier fetches nothing")


class SharedTier:
    def __init__(self, loop: EventLoop, model: StepModel, costs: TierCosts, capacity_bytes: int,
                 tier_node: int = 0, fetch_workers: int = DEFAULT_FETCH_CONCURRENCY) -> None:
        if fetch_workers < 1:
            raise ValueError(f"fetch_workers must be >= 1, got {fetch_workers}")
        self.loop, self.model, self.costs, self.tier_node = loop, model, costs, tier_node
        self.tier = AdapterTier(_no_uri, capacity_bytes=capacity_bytes)
        self.counters = TierCounters()
        self._inflight: dict[str, list[tuple[object, Callable[[], None]]]] = {}
        self.fetch_workers = fetch_workers
        self._fetching = 0  # origin fetches running
        self._queued: deque[tuple[str, int]] = deque()  # misses waiting for a fetch worker

    def fetch(self, replica, adapter: str, rank: int, done: Callable[[], None]) -> None:
        if self.tier.cache_hit(adapter):
            self._read(replica, rank, done)
            return
        self.tier.metrics.misses += 1
        waiters = self._inflight.get(adapter)
        if waiters is not None:  # concurrent misses share one fetch (AdapterTier._shared_fetch)
            waiters.append((replica, done))
            return
        self._inflight[adapter] = [(replica, done)]
        self.counters.origin_fetches += 1
        self.tier.metrics.origin_fetches += 1
        if self._fetching < self.fetch_workers:
            self._start_fetch(adapter, rank)
        else:
            self._queued.append((adapter, rank))

    def _start_fetch(self, adapter: str, rank: int) -> None:
        self._fetching += 1
        nbytes = self.model.adapter_bytes(rank)
        self.loop.after(self.costs.origin_s(nbytes), self._fetched, adapter, rank, int(nbytes))

    def _fetched(self, adapter: str, rank: int, nbytes: int) -> None:
        self._fetching -= 1
        if self._queued:
            self._start_fetch(*self._queued.popleft())
        self.tier.admit(adapter, None, nbytes)
        for replica, done in self._inflight.pop(adapter):
            self._read(replica, rank, done)

    def _read(self, replica, rank: int, done: Callable[[], None]) -> None:
        nbytes = self.model.adapter_bytes(rank)
        cost = self.costs.local_load_s(nbytes)
        if replica.node == self.tier_node:
            self.counters.store_reads_same_node += 1
        else:
            self.counters.store_reads_other_node += 1
            cost += self.costs.remote_read_s(nbytes)
        self.loop.after(cost, done)


class PerReplicaDownload:
    def __init__(self, loop: EventLoop, model: StepModel, costs: TierCosts) -> None:
        self.loop, self.model, self.costs = loop, model, costs
        self.counters = TierCounters()
        self.downloaded: dict[int, set[str]] = {}  # replica -> its loader's disk_cache

    def fetch(self, replica, adapter: str, rank: int, done: Callable[[], None]) -> None:
        nbytes = self.model.adapter_bytes(rank)
        cost = self.costs.local_load_s(nbytes)
        disk = self.downloaded.setdefault(replica.index, set())
        if adapter in disk:
            self.counters.disk_reads += 1
        else:
            disk.add(adapter)
            self.counters.origin_fetches += 1
            cost += self.costs.origin_s(nbytes)
        self.loop.after(cost, done)
