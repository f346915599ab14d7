"""The adapter-affinity policy on plain data (no Ray)."""

from collections import Counter
from dataclasses import dataclass

import pytest

from cluster.routing import (BASE, COLD, GPU_HIT, HOST_HIT, PENDING, SPREAD, AdapterAffinityPolicy,
                             InflightTracker, ReplicaStats, adapter_of)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def replica(rid, gpu=(), host=(), queue=0, free=2, max_ongoing=8):
    return ReplicaStats(rid, frozenset(gpu), frozenset(host), free_slots=free, queue_len=queue,
                        max_loras=4, max_ongoing=max_ongoing)


def policy(clock=None, **kw):
    kw.setdefault("seed", 0)
    return AdapterAffinityPolicy(clock=clock or FakeClock(), **kw)


def test_gpu_holder_first_even_with_a_longer_queue():
    p = policy()
    replicas = [replica("r0", queue=0), replica("r1", host=["x"], queue=0), replica("r2", gpu=["x"], queue=2)]
    d = p.choose("x", replicas)
    assert (d.replica_id, d.kind) == ("r2", GPU_HIT)
    assert d.ranking[1] == "r1"  # the host holder is the fallback
    assert set(d.ranking) == {"r0", "r1", "r2"}


def test_host_holder_before_a_non_holder():
    d = policy().choose("x", [replica("r0"), replica("r1", host=["x"], queue=1)])
    assert (d.replica_id, d.kind) == ("r1", HOST_HIT)


def test_shortest_queue_among_gpu_holders():
    replicas = [replica("r0", gpu=["x"], queue=3), replica("r1", gpu=["x"], queue=1), replica("r2", gpu=["x"], queue=2)]
    assert policy().choose("x", replicas).replica_id == "r1"


def test_cold_adapter_goes_to_least_loaded_then_most_free_slots():
    replicas = [replica("r0", queue=2), replica("r1", queue=1, free=0), replica("r2", queue=1, free=3)]
    d = policy().choose("new", replicas)
    assert (d.replica_id, d.kind) == ("r2", COLD)


def test_busy_holder_spreads_to_least_loaded_non_holder():
    p = policy(busy_queue_len=4)
    replicas = [replica("r0", gpu=["x"], queue=4), replica("r1", queue=3), replica("r2", queue=1)]
    d = p.choose("x", replicas)
    assert (d.replica_id, d.kind) == ("r2", SPREAD)


def test_busy_threshold_from_max_ongoing_and_fraction():
    p = policy(busy_fraction=0.5)
    assert p.busy_threshold(replica("r", max_ongoing=8)) == 4
    assert p.busy_threshold(replica("r", max_ongoing=1)) == 1
    assert policy(busy_queue_len=3).busy_threshold(replica("r", max_ongoing=100)) == 3
    holder_at_3 = [replica("r0", gpu=["x"], queue=3), replica("r1")]
    assert p.choose("x", holder_at_3).kind == GPU_HIT  # 3 < 4: not busy yet
    holder_at_4 = [replica("r0", gpu=["x"], queue=4), replica("r1")]
    assert p.choose("x", holder_at_4).kind == SPREAD


def test_everyone_busy_stays_on_least_loaded_holder():
    p = policy(busy_queue_len=2)
    replicas = [replica("r0", gpu=["x"], queue=5), replica("r1", host=["x"], queue=3), replica("r2", queue=2)]
    d = p.choose("x", replicas)
    assert (d.replica_id, d.kind) == ("r1", HOST_HIT)


def test_cold_burst_before_stats_refresh_lands_on_one_replica():
    clock = FakeClock()
    p = policy(clock, pending_ttl_s=5.0, busy_queue_len=8)
    stale = [replica(f"r{i}") for i in range(4)]  # stats never show the adapter during the burst
    inflight = Counter()
    chosen = []
    for _ in range(6):
        d = p.choose("burst", [replica(r.replica_id, queue=inflight[r.replica_id]) for r in stale])
        inflight[d.replica_id] += 1
        chosen.append(d)
    assert len({d.replica_id for d in chosen}) == 1
    assert [d.kind for d in chosen] == [COLD] + [PENDING] * 5
    assert p.decisions[COLD] == 1 and p.decisions[PENDING] == 5


def test_pending_memory_expires():
    clock = FakeClock()
    p = policy(clock, pending_ttl_s=2.0)
    first = p.choose("a", [replica("r0"), replica("r1")]).replica_id
    assert p.pending_replicas("a") == {first}
    clock.now += 2.5
    assert p.pending_replicas("a") == set()
    assert p.choose("a", [replica("r0"), replica("r1")]).kind == COLD


def test_pending_memory_renews_while_requests_keep_going_there():
    clock = FakeClock()
    p = policy(clock, pending_ttl_s=2.0)
    replicas = [replica("r0"), replica("r1"), replica("r2")]
    first = p.choose("a", replicas).replica_id
    for _ in range(4):  # stats stay stale for 6 s, longer than the TTL
        clock.now += 1.5
        d = p.choose("a", replicas)
        assert (d.replica_id, d.kind) == (first, PENDING)
    clock.now += 2.5
    assert p.pending_replicas("a") == set()


def test_stale_stats_missing_or_partial_reports():
    # A replica that has not reported yet has nothing resident; a report without free_slots derives it.
    assert ReplicaStats.from_report("r", None).gpu_adapters == frozenset()
    r = ReplicaStats.from_report("r", {"gpu_adapters": ["a"], "max_loras": 3, "queue_len": 7}, max_ongoing=10)
    assert (r.free_slots, r.queue_len, r.max_ongoing) == (2, 7, 10)
    assert ReplicaStats.from_report("r", {"queue_len": 7}, queue_len=1).queue_len == 1  # router's count wins
    both = ReplicaStats.from_report("r", {"gpu_adapters": ["a"], "host_adapters": ["a", "b"]})
    assert both.host_adapters == frozenset({"b"})


def test_stale_stats_holder_that_evicted_the_adapter_is_not_preferred_once_stats_refresh():
    clock = FakeClock()
    p = policy(clock, pending_ttl_s=1.0)
    before = [replica("r0", gpu=["a"]), replica("r1")]
    assert p.choose("a", before).replica_id == "r0"
    after = [replica("r0", gpu=["b"], free=0), replica("r1", free=3)]
    d = p.choose("a", after)
    assert (d.replica_id, d.kind) == ("r1", COLD)


def test_hot_adapter_spreads_to_at_least_two_replicas_under_load():
    p = policy(busy_queue_len=3, pending_ttl_s=30.0)
    inflight = Counter()
    stats = {"r0": ["hot"], "r1": [], "r2": []}
    seen = []
    for _ in range(9):  # concurrent requests: none finishes, queues only grow
        d = p.choose("hot", [replica(rid, gpu=g, queue=inflight[rid]) for rid, g in stats.items()])
        inflight[d.replica_id] += 1
        seen.append(d)
    assert seen[0].replica_id == "r0"
    assert len(set(inflight)) >= 2
    assert inflight["r0"] == 3  # the holder fills up to the threshold before the adapter spreads
    assert p.decisions[SPREAD] >= 1
    # Once spread, the new holder keeps taking the adapter (no new load per request).
    assert p.decisions[SPREAD] + p.decisions[COLD] <= 2


def test_hot_adapter_is_not_pinned_even_with_fresh_stats():
    p = policy(busy_queue_len=2, pending_ttl_s=0.0)  # no memory: stats alone
    replicas = [replica("r0", gpu=["hot"], queue=2), replica("r1", gpu=["hot"], queue=2), replica("r2", queue=0)]
    assert p.choose("hot", replicas).replica_id == "r2"


def test_base_requests_balance_over_all_replicas():
    p = policy()
    inflight = Counter()
    for _ in range(30):
        d = p.choose(None, [replica(f"r{i}", queue=inflight[f"r{i}"]) for i in range(3)])
        assert d.kind == BASE
        inflight[d.replica_id] += 1
    assert len(inflight) == 3
    assert max(inflight.values()) - min(inflight.values()) <= 2  # two choices: near-even, not exact


def test_base_request_takes_the_shorter_of_two():
    p = policy()
    for _ in range(20):
        d = p.choose(None, [replica("r0", queue=5), replica("r1", queue=0)])
        assert d.replica_id == "r1"


def test_same_seed_same_decisions():
    def run(seed):
        p = policy(seed=seed)
        return [p.choose(a, [replica(f"r{i}") for i in range(4)]).replica_id for a in [None, "a", "b", None, "c"] * 4]
    assert run(7) == run(7)
    assert run(7) != run(8) or run(7) != run(9)


def test_kinds_per_rank():
    p = policy(busy_queue_len=4)
    d = p.choose("x", [replica("r0", gpu=["x"]), replica("r1", host=["x"]), replica("r2")])
    assert dict(zip(d.ranking, d.kinds)) == {"r0": GPU_HIT, "r1": HOST_HIT, "r2": SPREAD}
    d = p.choose("new", [replica("r0"), replica("r1")])
    assert d.kinds == (COLD, COLD) and d.kind_of("elsewhere") == COLD
    assert p.choose(None, [replica("r0"), replica("r1")]).kinds == (BASE, BASE)


def test_redirect_moves_the_count_and_the_memory():
    # Serve skipped our cold choice (its queue was full or its probe timed out): the burst follows the request.
    p = policy()
    replicas = [replica("r0"), replica("r1"), replica("r2")]
    d = p.choose("a", replicas)
    other = d.ranking[1]
    assert p.redirected(d, other) == COLD
    assert p.pending_replicas("a") == {other}
    assert p.decisions[COLD] == 1
    assert p.choose("a", replicas).replica_id == other
    # Landing on a GPU holder instead of a spread target counts as a hit.
    q = policy(busy_queue_len=2)
    d = q.choose("x", [replica("r0", gpu=["x"], queue=2), replica("r1")])
    assert d.kind == SPREAD
    assert q.redirected(d, "r0") == GPU_HIT
    assert (q.decisions[SPREAD], q.decisions[GPU_HIT]) == (0, 1)
    assert q.pending_replicas("x") == set()
    assert q.redirected(d, d.replica_id) == SPREAD  # no redirect: nothing changes
    assert q.decisions[SPREAD] == 0


def test_record_false_neither_counts_nor_remembers():
    p = policy()
    d = p.choose("a", [replica("r0"), replica("r1")], record=False)
    assert d.kind == COLD and p.decisions[COLD] == 0 and p.pending_replicas("a") == set()


def test_forget_replica_drops_its_pending_assignments():
    p = policy()
    rid = p.choose("a", [replica("r0"), replica("r1")]).replica_id
    p.forget_replica(rid)
    assert p.pending_replicas("a") == set()


def test_bad_config():
    with pytest.raises(ValueError):
        AdapterAffinityPolicy(busy_fraction=0)
    with pytest.raises(ValueError):
        AdapterAffinityPolicy(busy_queue_len=0)
    with pytest.raises(ValueError):
        policy().choose("a", [])


def test_inflight_tracker():
    clock = FakeClock()
    t = InflightTracker(unconfirmed_ttl_s=5.0, clock=clock)
    t.assign("q1", "r0")
    t.assign("q2", "r0")
    t.assign("q3", "r1")
    assert t.counts() == Counter({"r0": 2, "r1": 1})
    t.assign("q1", "r0", info="first")
    t.assign("q1", "r0")  # re-assigned on a retry: the info of the first assignment stays
    assert t.confirm("q2", "r2") is None  # Serve sent it elsewhere
    t.finish("q3")
    assert "q1" in t and "q3" not in t
    clock.now += 6  # q1 was never confirmed (cancelled while queued): it stops counting
    assert t.counts() == Counter({"r2": 1})
    t.assign("q4", "r1", info="decision")
    assert t.confirm("q4", "r1") == "decision"
    t.finish("q4")
    t.finish("q2")
    t.finish("unknown")
    assert t.counts() == Counter()


@dataclass
class Body:
    model: str
    prompt: str = ""


def test_adapter_of_convention():
    assert adapter_of((), {"adapter": "a"}) == "a"
    assert adapter_of((), {"model": "a"}) == "a"
    assert adapter_of((), {"adapter": None, "model": "x"}) is None  # explicit base
    assert adapter_of((), {}, multiplexed_model_id="m") == "m"
    assert adapter_of((), {"adapter": "a"}, multiplexed_model_id="m") == "a"
    assert adapter_of((Body("b"),), {}) == "b"
    assert adapter_of(({"model": "c", "prompt": "hi"},), {}) == "c"
    assert adapter_of(({"adapter": "d", "model": "base"},), {}) == "d"
    assert adapter_of(("a plain prompt",), {}) is None
    assert adapter_of((), {}) is None
    assert adapter_of((Body("base"),), {}, base_models={"base"}) is None
    assert adapter_of((), {"adapter": ""}) is None
