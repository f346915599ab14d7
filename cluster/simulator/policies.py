"""Routing policies side by side: ours (the app's AdapterAffinityPolicy), Ray Serve's multiplexed routing,
power of two choices, random.

Each `route(req, replicas)` returns the replica that accepts the request, or
None when every candidate is full (Serve then backs off; the simulator retries
when a request finishes). A replica accepts while its queue is below Serve's
max_ongoing_requests. Replicas' routing reports are polled every
`stats_period_s` (request_routing_stats_period_s), as Serve does.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Sequence

from cluster.routing import AdapterAffinityPolicy, InflightTracker, ReplicaStats

from cluster.simulator.events import EventLoop
from cluster.simulator.replica import SimReplica, SimRequest


class Routing:
    name = "?"
    fetch_kind = "shared"  # where replicas' loads come from: "shared" tier or "per_replica" download

    def __init__(self, loop: EventLoop, seed: int, stats_period_s: float = 1.0) -> None:
        self.loop, self.stats_period_s = loop, stats_period_s
        self.rng = random.Random(seed)
        self._polled_at = -1e18

    def _poll(self, replicas: Sequence[SimReplica]) -> bool:
        if self.loop.now - self._polled_at >= self.stats_period_s:
            self._polled_at = self.loop.now
            return True
        return False

    def route(self, r: SimRequest, replicas: Sequence[SimReplica], retry: bool) -> SimReplica | None:
        raise NotImplementedError

    def finished(self, r: SimRequest) -> None:
        pass

    def decisions(self) -> dict[str, int]:
        return {}


class AffinityRouting(Routing):
    """cluster/router.py's AdapterAffinityRouter.choose_replicas, on simulated replicas."""

    name = "ours"

    def __init__(self, loop: EventLoop, seed: int, stats_period_s: float = 1.0, **policy_kwargs) -> None:
        super().__init__(loop, seed, stats_period_s)
        self.policy = AdapterAffinityPolicy(seed=seed, clock=loop.clock, **policy_kwargs)
        self.inflight = InflightTracker(clock=loop.clock)
        self._stats: list[ReplicaStats] = []

    def route(self, r, replicas, retry):
        if self._poll(replicas):
            # The router builds stats from each replica's last report; polled once a period, so built once.
            self._stats = [ReplicaStats.from_report(rep.index, rep.report(), max_ongoing=rep.cfg.max_ongoing)
                           for rep in replicas]
        inflight = self.inflight.counts()
        # Serve's queue-length cache is the replica's answer to the last probe or send: its queue now. Only the
        # replicas whose queue changed get a new (frozen) ReplicaStats: the rest keep last request's object.
        stats = self._stats
        for i, rep in enumerate(replicas):
            q = len(rep.waiting) + len(rep.running)
            f = inflight.get(i, 0)
            if f > q:
                q = f
            s = stats[i]
            if q != s.queue_len:
                stats[i] = ReplicaStats(s.replica_id, s.gpu_adapters, s.host_adapters, s.free_slots, q,
                                        s.max_loras, s.max_ongoing)
        decision = self.policy.choose(r.req.adapter, stats, record=not retry)
        self.inflight.assign(str(r.rid), decision.replica_id, None if retry else decision)
        for rid in decision.ranking:  # Serve takes the first that is not full
            rep = replicas[rid]
            if rep.accepts():
                recorded = self.inflight.confirm(str(r.rid), rid)
                if recorded is not None:
                    self.policy.redirected(recorded, rid)
                return rep
        return None

    def finished(self, r):
        self.inflight.finish(str(r.rid))

    def decisions(self):
        return dict(self.policy.decisions)


class RayMultiplexRouting(Routing):
    """Ray Serve's PowerOfTwoChoicesRequestRouter with MultiplexMixin (serve/_private/request_router/), and
    each replica's @serve.multiplexed LRU of max_num_models_per_replica model ids.

    Candidates: the replicas whose reported model ids hold the adapter, else those with the fewest models;
    two at random, the shorter queue that accepts. When neither accepts: the fewest-models replicas, then
    (after the matching timeout) all replicas, each a power-of-two round.
    """

    name = "ray-multiplex"
    fetch_kind = "per_replica"

    def __init__(self, loop: EventLoop, seed: int, stats_period_s: float = 1.0,
                 max_num_models_per_replica: int = 16) -> None:
        super().__init__(loop, seed, stats_period_s)
        self.max_models = max_num_models_per_replica
        self.models: dict[int, OrderedDict[str, None]] = {}  # replica -> its multiplex LRU
        self._model_to_replicas: dict[str, set[int]] = {}
        self._counts: dict[int, int] = {}

    def _loaded(self, rep: SimReplica, adapter: str) -> None:
        lru = self.models.setdefault(rep.index, OrderedDict())
        if adapter in lru:
            lru.move_to_end(adapter)
            return
        if len(lru) >= self.max_models:
            lru.popitem(last=False)
        lru[adapter] = None

    def route(self, r, replicas, retry):
        if self._poll(replicas):
            table: dict[str, set[int]] = {}
            for rep in replicas:
                for m in self.models.get(rep.index, ()):
                    table.setdefault(m, set()).add(rep.index)
            self._model_to_replicas = table
            self._counts = {rep.index: len(self.models.get(rep.index, ())) for rep in replicas}
        adapter = r.req.adapter
        rounds = []
        if adapter is None:
            rounds.append([rep.index for rep in replicas])
        else:
            if not retry:
                rounds.append(sorted(self._model_to_replicas.get(adapter, ())) or self._fewest(replicas))
            rounds += [self._fewest(replicas), [rep.index for rep in replicas]]
        for ids in rounds:
            rep = self._pow2(ids, replicas)
            if rep is not None:
                if adapter is not None:
                    self._loaded(rep, adapter)
                return rep
        return None

    def _fewest(self, replicas) -> list[int]:
        least = min(self._counts.get(rep.index, 0) for rep in replicas)
        return [rep.index for rep in replicas if self._counts.get(rep.index, 0) == least]

    def _pow2(self, ids: list[int], replicas) -> SimReplica | None:
        two = [ids[0]] if len(ids) == 1 else self.rng.sample(ids, 2)
        ok = [replicas[i] for i in two if replicas[i].accepts()]
        return min(ok, key=lambda rep: rep.queue_len) if ok else None


class PowerOfTwoRouting(Routing):
    name = "pow2"

    def route(self, r, replicas, retry):
        two = self.rng.sample(range(len(replicas)), min(2, len(replicas)))
        ok = [replicas[i] for i in two if replicas[i].accepts()]
        if ok:
            return min(ok, key=lambda rep: rep.queue_len)
        free = [rep for rep in replicas if rep.accepts()]
        return min(free, key=lambda rep: rep.queue_len) if free else None


class RandomRouting(Routing):
    name = "random"

    def route(self, r, replicas, retry):
        free = [rep for rep in replicas if rep.accepts()]
        return self.rng.choice(free) if free else None


POLICIES = {cls.name: cls for cls in (AffinityRouting, RayMultiplexRouting, PowerOfTwoRouting, RandomRouting)}
