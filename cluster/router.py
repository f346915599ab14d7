"""AdapterAffinityRouter: the Ray Serve request router that applies cluster.routing's policy.

Use it on the replica deployment:

    @serve.deployment(request_router_config=RequestRouterConfig(
        request_router_class="cluster.router.AdapterAffinityRouter",
        request_router_kwargs={"busy_fraction": 0.5, "pending_ttl_s": 5.0},
        request_routing_stats_period_s=1.0))
    class Replica:
        def record_routing_stats(self) -> dict:  # polled by Serve every period
            return {"gpu_adapters": [...], "host_adapters": [...], "free_slots": 2,
                    "queue_len": 3, "max_loras": 4, "base_model": "my-base"}

The adapter a request names is read by `cluster.routing.adapter_of` (kwarg
`adapter=`/`model=`, the multiplexed model id, or the first positional argument's
`adapter`/`model`). A name equal to the base model (`base_model` in the kwargs or
in a replica's stats) is a base-model request.

A replica's queue depth is the larger of this router's own in-flight count for it
and Serve's queue-length cache (the replica's answer to the last send, plus sends
since); the reported `queue_len` stands in when the cache has nothing fresh.

Decisions are counted in the `lorafleet_routing_decisions` metric (tag `kind`)
when Serve confirms where a request went (`on_request_routed`, called for every
accepted request except under Ray Client), and in `decisions` for this router.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, List, Optional

from ray.serve import metrics
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from cluster import routing
from cluster.prometheus import text
from cluster.routing import AdapterAffinityPolicy, InflightTracker, ReplicaStats, adapter_of


class AdapterAffinityRouter(RequestRouter):
    """Prefers replicas holding the request's adapter (GPU, then host), spreads hot adapters, balances the rest."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._decisions_counter = metrics.Counter(
            "lorafleet_routing_decisions",
            description="Routing decisions of the adapter-affinity router, by kind "
                        "(gpu_hit, pending, host_hit, spread, cold, base).",
            tag_keys=("kind",))
        self.initialize_state()

    def initialize_state(self, *, busy_fraction: float = 0.5, busy_queue_len: Optional[int] = None,
                         pending_ttl_s: float = 5.0, base_model: Optional[str] = None,
                         seed: Optional[int] = None, **unknown: Any) -> None:
        """Called by Serve with `request_router_kwargs`; see AdapterAffinityPolicy for the knobs."""
        if unknown:
            raise TypeError(f"unknown request_router_kwargs for AdapterAffinityRouter: {sorted(unknown)}")
        self.policy = AdapterAffinityPolicy(busy_fraction=busy_fraction, busy_queue_len=busy_queue_len,
                                            pending_ttl_s=pending_ttl_s, seed=seed)
        # Serve pickles this class by value, and with it the values of the globals it names: a set named here
        # would be the copy's own. Through the module (pickled by reference) it is the process's one set.
        routing.LIVE_POLICIES.add(self.policy)
        self.inflight = InflightTracker()
        self._base_models = {base_model} if base_model else set()

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        if not candidate_replicas:
            return []
        inflight = self.inflight.counts()
        base_models = set(self._base_models)
        stats = []
        for replica in candidate_replicas:
            report = replica.routing_stats or {}
            if report.get("base_model"):
                base_models.add(report["base_model"])
            cached = self.replica_queue_len_cache.get(replica.replica_id)
            queue_len = cached if cached is not None else int(report.get("queue_len") or 0)
            stats.append(ReplicaStats.from_report(
                replica.replica_id, report, queue_len=max(queue_len, inflight[replica.replica_id]),
                max_ongoing=replica.max_ongoing_requests))

        adapter = None
        if pending_request is not None:
            adapter = adapter_of(pending_request.args, pending_request.kwargs,
                                 multiplexed_model_id=pending_request.metadata.multiplexed_model_id,
                                 base_models=frozenset(base_models))
        # Serve asks again while every replica is full; count and remember a request's first decision only.
        first_try = pending_request is None or pending_request.metadata.internal_request_id not in self.inflight
        decision = self.policy.choose(adapter, stats, record=first_try)
        if pending_request is not None:
            # Back off between rounds when every replica is full, instead of spinning.
            pending_request.routing_context.should_backoff = True
            self.inflight.assign(pending_request.metadata.internal_request_id, decision.replica_id,
                                 decision if first_try else None)
        by_id = {r.replica_id: r for r in candidate_replicas}
        # One replica per rank: Serve takes our first choice unless its queue is full.
        return [[by_id[rid]] for rid in decision.ranking]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        decision = self.inflight.confirm(pending_request.metadata.internal_request_id, replica_id)
        if decision is not None:
            # Count where the request went, which is not our first choice when that one was full.
            self._decisions_counter.inc(tags={"kind": self.policy.redirected(decision, replica_id)})

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.inflight.finish(internal_request_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.policy.forget_replica(replica_id)

    @property
    def decisions(self) -> dict[str, int]:
        """Decision counts by kind since this router started, fixed up when Serve sends a request elsewhere
        (a request a replica rejects is chosen, and counted, again)."""
        return dict(self.policy.decisions)


def decisions_text() -> str:
    """The decisions of this process's routers by kind, in Prometheus text format (the app's /metrics)."""
    total: Counter[str] = Counter()
    for policy in list(routing.LIVE_POLICIES):
        total.update(policy.decisions)
    name = "lorafleet_router_decisions_total"
    return text([(name, {"kind": kind}, count) for kind, count in sorted(total.items())],
                {name: ("counter", "Routing decisions of this ingress's adapter-affinity routers, by kind")})
