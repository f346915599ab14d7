"""Adapter-affinity routing policy: which replica serves a request, on plain data (no Ray).

Each replica reports routing stats (`ReplicaStats`): adapters resident on GPU and
in host memory, free GPU slots and queue depth. The router adds its own in-flight
counts to the queue depth and asks `AdapterAffinityPolicy.choose` for a ranking.

Rules for a request naming an adapter, best first:
  1. a replica that is not busy and holds the adapter: on GPU, then one it was just
     sent to (a load in flight that stats do not show yet), then in host memory;
     among equals the shortest queue;
  2. every holder busy: spread to the least-loaded replica that is not busy (a hot
     adapter is never pinned to one replica); if every replica is busy, stay on the
     least-loaded holder rather than load the adapter somewhere else;
  3. no holder: cold start on the least-loaded replica (most free slots among equals).
A replica is busy when its queue reaches `busy_queue_len`, or by default
`busy_fraction` of its `max_ongoing` (Serve's max_ongoing_requests).
Spread and cold assignments are remembered for `pending_ttl_s` (renewed while
requests keep going there and the stats do not show it yet), so the requests
of a burst that arrive before the stats refresh go to the same replica instead of
loading the adapter everywhere. Base-model requests (adapter None) take the
shorter queue of two random replicas (power of two choices).
"""

from __future__ import annotations

import heapq
import math
import random
import time
import weakref
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Mapping, Sequence

ReplicaKey = Hashable

# Decision kinds, counted in `AdapterAffinityPolicy.decisions`.
GPU_HIT = "gpu_hit"  # the replica reports the adapter on GPU
PENDING = "pending"  # the replica was just sent this adapter; its stats do not show it yet
HOST_HIT = "host_hit"  # the replica reports the adapter in host memory
SPREAD = "spread"  # every holder busy: a new replica takes the adapter
COLD = "cold"  # no replica holds the adapter
BASE = "base"  # base-model request
KINDS = (GPU_HIT, PENDING, HOST_HIT, SPREAD, COLD, BASE)

_TIER_KIND = {0: GPU_HIT, 1: PENDING, 2: HOST_HIT}
_NOT_HELD = 3


@dataclass(frozen=True)
class ReplicaStats:
    """What the policy knows of one replica. `queue_len` is the router's best estimate of its queue."""

    replica_id: ReplicaKey
    gpu_adapters: frozenset[str] = frozenset()
    host_adapters: frozenset[str] = frozenset()
    free_slots: int = 0
    queue_len: int = 0
    max_loras: int = 0
    max_ongoing: int = 5  # Serve's max_ongoing_requests (its default is 5)

    @classmethod
    def from_report(cls, replica_id: ReplicaKey, report: Mapping[str, Any] | None, *,
                    queue_len: int | None = None, max_ongoing: int = 5) -> "ReplicaStats":
        """Build from a replica's `record_routing_stats` dict; a missing or partial report means nothing resident.

        `queue_len` overrides the reported queue depth (the router knows fresher numbers).
        """
        report = report or {}
        gpu = frozenset(report.get("gpu_adapters") or ())
        max_loras = int(report.get("max_loras") or 0)
        free = report.get("free_slots")
        free = int(free) if free is not None else max(max_loras - len(gpu), 0)
        reported_queue = int(report.get("queue_len") or 0)
        return cls(replica_id=replica_id, gpu_adapters=gpu,
                   host_adapters=frozenset(report.get("host_adapters") or ()) - gpu,
                   free_slots=free, queue_len=reported_queue if queue_len is None else queue_len,
                   max_loras=max_loras, max_ongoing=max_ongoing)


@dataclass(frozen=True)
class Decision:
    """A ranking of replica ids, best first, and what sending the request to each would be (its kind)."""

    adapter: str | None
    ranking: tuple[ReplicaKey, ...]
    kinds: tuple[str, ...]

    @property
    def replica_id(self) -> ReplicaKey:
        return self.ranking[0]

    @property
    def kind(self) -> str:
        return self.kinds[0]

    def kind_of(self, replica_id: ReplicaKey) -> str:
        if replica_id in self.ranking:
            return self.kinds[self.ranking.index(replica_id)]
        return BASE if self.adapter is None else COLD


# This process's policies, one per router (Serve makes a router per handle), for the app's /metrics to add up
# their decisions (cluster/router.py decisions_text). Weak: a router Serve drops leaves nothing behind.
LIVE_POLICIES: "weakref.WeakSet[AdapterAffinityPolicy]" = weakref.WeakSet()


def _key(entry: tuple) -> tuple:
    return entry[0]


def _busy(entry: tuple) -> bool:
    return entry[3]


class AdapterAffinityPolicy:
    """Ranks replicas for a request (see the module docstring for the rules)."""

    def __init__(self, *, busy_fraction: float = 0.5, busy_queue_len: int | None = None,
                 pending_ttl_s: float = 5.0, seed: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not 0.0 < busy_fraction <= 1.0:
            raise ValueError(f"busy_fraction must be in (0, 1], got {busy_fraction}")
        if busy_queue_len is not None and busy_queue_len < 1:
            raise ValueError(f"busy_queue_len must be >= 1, got {busy_queue_len}")
        if pending_ttl_s < 0:
            raise ValueError(f"pending_ttl_s must be >= 0, got {pending_ttl_s}")
        self.busy_fraction = busy_fraction
        self.busy_queue_len = busy_queue_len
        self.pending_ttl_s = pending_ttl_s
        self._rng = random.Random(seed)
        self._clock = clock
        self._pending: dict[str, dict[ReplicaKey, float]] = {}  # adapter -> replica -> expiry
        self._swept_at = -math.inf
        self.decisions: Counter[str] = Counter({kind: 0 for kind in KINDS})

    def busy_threshold(self, replica: ReplicaStats) -> int:
        if self.busy_queue_len is not None:
            return self.busy_queue_len
        return max(1, math.ceil(replica.max_ongoing * self.busy_fraction))

    def is_busy(self, replica: ReplicaStats) -> bool:
        return replica.queue_len >= self.busy_threshold(replica)

    def pending_replicas(self, adapter: str) -> set[ReplicaKey]:
        """Replicas recently sent `adapter` without their stats showing it (cold, spread) and not expired."""
        return set(self._live_pending(adapter))

    def _live_pending(self, adapter: str) -> dict[ReplicaKey, float]:
        # Only this adapter's memory is expired here (a choice is O(replicas), not O(adapters remembered));
        # the rest is swept once a TTL, so forgotten adapters cannot pile up.
        now = self._clock()
        if now - self._swept_at >= self.pending_ttl_s:
            self._expire()
        assigned = self._pending.get(adapter)
        if not assigned:
            return {}
        if min(assigned.values()) <= now:
            assigned = {rid: exp for rid, exp in assigned.items() if exp > now}
            if assigned:
                self._pending[adapter] = assigned
            else:
                del self._pending[adapter]
        return assigned

    def choose(self, adapter: str | None, replicas: Sequence[ReplicaStats], *, record: bool = True) -> Decision:
        """Rank `replicas` for a request for `adapter` (None: the base model).

        With `record`, the decision is counted and a spread or cold assignment remembered.
        """
        if not replicas:
            raise ValueError("no replicas to choose from")
        # Ties break on a per-call random key, so a seeded policy is deterministic.
        rand = self._rng.random
        tie = [rand() for _ in replicas]
        if adapter is None:
            decision = self._choose_base(replicas, tie)
        else:
            decision = self._choose_adapter(adapter, replicas, tie, record)
        if record:
            self.decisions[decision.kind] += 1
        return decision

    def redirected(self, decision: Decision, replica_id: ReplicaKey) -> str:
        """The request of a recorded `decision` went to `replica_id` instead of its first choice
        (Serve skips a replica whose queue is full or that does not answer a probe in time):
        move the count and the memory there. Returns the kind of what happened."""
        kind = decision.kind_of(replica_id)
        if replica_id == decision.replica_id:
            return kind
        self.decisions[decision.kind] -= 1
        self.decisions[kind] += 1
        if decision.adapter is not None:
            if decision.kind in (SPREAD, COLD):
                self._pending.get(decision.adapter, {}).pop(decision.replica_id, None)
            if kind in (SPREAD, COLD, PENDING):
                self._remember(decision.adapter, replica_id)
        return kind

    def _choose_base(self, replicas: Sequence[ReplicaStats], tie: list[float]) -> Decision:
        order = sorted(range(len(replicas)), key=lambda i: (replicas[i].queue_len, tie[i]))
        two = self._rng.sample(range(len(replicas)), k=min(2, len(replicas)))
        best = min(two, key=lambda i: (replicas[i].queue_len, tie[i]))
        ranking = (replicas[best].replica_id, *(replicas[i].replica_id for i in order if i != best))
        return Decision(None, ranking, (BASE,) * len(replicas))

    def _choose_adapter(self, adapter: str, replicas: Sequence[ReplicaStats], tie: list[float],
                        record: bool) -> Decision:
        pending = self._live_pending(adapter)
        fixed = self.busy_queue_len
        thresholds: dict[int, int] = {}
        # One pass: each replica's tier and busy flag, computed once (this runs per request over every replica).
        holders, others = [], []  # (sort key, replica, tier, busy)
        for i, r in enumerate(replicas):
            if adapter in r.gpu_adapters:
                t = 0
            elif r.replica_id in pending:
                t = 1
            elif adapter in r.host_adapters:
                t = 2
            else:
                t = _NOT_HELD
            if fixed is None:
                thr = thresholds.get(r.max_ongoing)
                if thr is None:
                    thr = thresholds[r.max_ongoing] = self.busy_threshold(r)
            else:
                thr = fixed
            busy = r.queue_len >= thr
            if t == _NOT_HELD:
                others.append(((r.queue_len, -r.free_slots, tie[i]), r, t, busy))
            else:
                holders.append(((t, r.queue_len, tie[i]), r, t, busy))
        holders.sort(key=_key)
        others.sort(key=_key)
        free_holder = next((h for h in holders if not h[3]), None)
        free_other = next((o for o in others if not o[3]), None)

        if free_holder is not None:
            first, kind = free_holder, _TIER_KIND[free_holder[2]]
        elif holders and free_other is not None:
            first, kind = free_other, SPREAD
        elif holders:
            # Everyone is busy: loading the adapter elsewhere would not shorten the wait.
            first = min(holders, key=lambda h: (h[1].queue_len, h[2], h[0][2]))
            kind = _TIER_KIND[first[2]]
        else:
            first, kind = others[0], COLD
        if record and kind in (SPREAD, COLD, PENDING):
            self._remember(adapter, first[1].replica_id)  # a pending hit extends the memory: it is still in use there
        miss = SPREAD if holders else COLD
        # The rest: holders before others, and within that not busy before busy (a stable sort on busy).
        rest = [e for e in (*holders, *others) if e is not first]
        rest.sort(key=_busy)
        ranking = (first[1].replica_id, *(e[1].replica_id for e in rest))
        kinds = (kind, *(_TIER_KIND[e[2]] if e[2] != _NOT_HELD else miss for e in rest))
        return Decision(adapter, ranking, kinds)

    def _remember(self, adapter: str, replica_id: ReplicaKey) -> None:
        if self.pending_ttl_s > 0:
            self._pending.setdefault(adapter, {})[replica_id] = self._clock() + self.pending_ttl_s

    def _expire(self) -> None:
        now = self._clock()
        self._swept_at = now
        for adapter in list(self._pending):
            live = {rid: exp for rid, exp in self._pending[adapter].items() if exp > now}
            if live:
                self._pending[adapter] = live
            else:
                del self._pending[adapter]

    def forget_replica(self, replica_id: ReplicaKey) -> None:
        """Drop what is remembered about a replica that went away."""
        for assigned in self._pending.values():
            assigned.pop(replica_id, None)


class InflightTracker:
    """Requests this router has assigned and not yet seen finish, per replica.

    A request counts from the moment it is assigned (before it is sent), so the
    requests of a burst see each other; one that is never confirmed as sent
    (cancelled while queued) stops counting after `unconfirmed_ttl_s`.
    """

    def __init__(self, *, unconfirmed_ttl_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.unconfirmed_ttl_s = unconfirmed_ttl_s
        self._clock = clock
        # id -> (replica, expiry or None once sent, what the caller attached to the assignment)
        self._requests: dict[str, tuple[ReplicaKey, float | None, Any]] = {}
        # Kept as requests come and go, so `counts` (asked per request) does not walk every request in flight.
        self._counts: Counter = Counter()
        self._expiries: list[tuple[float, int, str]] = []  # heap of unconfirmed assignments' expiries
        self._seq = 0

    def _set(self, request_id: str, entry: tuple[ReplicaKey, float | None, Any]) -> None:
        self._drop(request_id)
        self._requests[request_id] = entry
        self._counts[entry[0]] += 1
        if entry[1] is not None:
            self._seq += 1
            heapq.heappush(self._expiries, (entry[1], self._seq, request_id))

    def _drop(self, request_id: str) -> None:
        old = self._requests.pop(request_id, None)
        if old is not None:
            left = self._counts[old[0]] - 1
            if left:
                self._counts[old[0]] = left
            else:
                del self._counts[old[0]]

    def assign(self, request_id: str, replica_id: ReplicaKey, info: Any = None) -> None:
        """Count the request on `replica_id`; a re-assignment keeps the earlier info unless given new."""
        if info is None and request_id in self._requests:
            info = self._requests[request_id][2]
        self._set(request_id, (replica_id, self._clock() + self.unconfirmed_ttl_s, info))

    def confirm(self, request_id: str, replica_id: ReplicaKey) -> Any:
        """The request was sent to `replica_id` (which may differ from the one assigned); returns the info
        attached by `assign`, or None if it was not assigned."""
        info = self._requests[request_id][2] if request_id in self._requests else None
        self._set(request_id, (replica_id, None, None))
        return info

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def finish(self, request_id: str) -> None:
        self._drop(request_id)

    def counts(self) -> Counter:
        now = self._clock()
        heap = self._expiries
        while heap and heap[0][0] <= now:
            expiry, _, rid = heapq.heappop(heap)
            entry = self._requests.get(rid)
            if entry is not None and entry[1] == expiry:  # still that unconfirmed assignment
                self._drop(rid)
        return Counter(self._counts)


def adapter_of(args: Sequence[Any], kwargs: Mapping[str, Any], *, multiplexed_model_id: str = "",
               base_models: frozenset[str] | set[str] = frozenset()) -> str | None:
    """The adapter a request names, or None for the base model. The convention, first match wins:

    1. a keyword argument `adapter` (or `model`) of `handle.remote(...)`;
    2. the multiplexed model id of `handle.options(multiplexed_model_id=...)`;
    3. the first positional argument's `adapter` (or `model`) attribute or mapping key
       (an OpenAI-style request body or a GenerateRequest).
    An empty name, or one in `base_models`, means the base model.
    """
    name: Any = None
    for key in ("adapter", "model"):
        if key in kwargs:
            name = kwargs[key]
            break
    else:
        if multiplexed_model_id:
            name = multiplexed_model_id
        elif args:
            name = _field(args[0], "adapter")
            if name is None:
                name = _field(args[0], "model")
    if not isinstance(name, str) or not name or name in base_models:
        return None
    return name


def _field(obj: Any, key: str) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(key)
    return getattr(obj, key, None)
