"""The cluster simulator (cluster/simulator/): deterministic, runs the app's own policy classes, models Ray
Serve's per-replica downloads, and never beats its bound."""

import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import pytest

import cluster.simulator as simulator
from cluster.simulator import ClusterConfig, ReplicaConfig, WorkloadConfig, generate, read_trace, simulate
from cluster.simulator import write_trace

ROOT = Path(__file__).resolve().parents[2]


def small_trace(seed=0, **kw):
    cfg = dict(duration_s=20.0, rate=15.0, num_adapters=60, zipf_s=1.0, seed=seed, output_median=48,
               prompt_median=128, max_output=256)
    cfg.update(kw)
    return generate(WorkloadConfig(**cfg))


CLUSTER = ClusterConfig(replicas=3, replicas_per_node=2, replica=ReplicaConfig(max_loras=4, max_cpu_loras=8))


def test_no_ray_import():
    code = "import sys, cluster.simulator; assert 'ray' not in sys.modules, [m for m in sys.modules if 'ray' in m]"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
    for path in (ROOT / "cluster" / "simulator").glob("*.py"):
        text = path.read_text()
        assert "import ray" not in text and "from ray" not in text, path


def test_uses_the_apps_classes():
    from cluster.adapter_tier import AdapterTier
    from cluster.routing import AdapterAffinityPolicy, InflightTracker, ReplicaStats
    from lora_core.host_cache import HostLRUCache
    from cluster.simulator import policies, replica, tiers
    assert simulator.routing_policy_class is AdapterAffinityPolicy
    assert simulator.replica_stats_class is ReplicaStats
    assert simulator.inflight_tracker_class is InflightTracker
    assert simulator.host_cache_class is HostLRUCache
    assert simulator.adapter_tier_class is AdapterTier
    from cluster.autoscaling import AdapterAwareAutoscaler
    assert simulator.autoscaler_class is AdapterAwareAutoscaler
    # ... and the modules that run them hold those very classes, not copies.
    assert policies.AdapterAffinityPolicy is AdapterAffinityPolicy
    assert policies.ReplicaStats is ReplicaStats and policies.InflightTracker is InflightTracker
    assert replica.HostLRUCache is HostLRUCache and tiers.AdapterTier is AdapterTier
    # The objects a run builds are instances of exactly those classes.
    from cluster.simulator.events import EventLoop
    from cluster.simulator.sim import step_model
    loop = EventLoop()
    routing = policies.AffinityRouting(loop, 0)
    assert type(routing.policy) is AdapterAffinityPolicy and type(routing.inflight) is InflightTracker
    rep = replica.SimReplica(0, 0, ReplicaConfig(), step_model("h200-llama3-8b"), simulator.TierCosts(), loop,
                             lambda *a: None, lambda r: None)
    assert type(rep.host) is HostLRUCache and type(rep.slots) is HostLRUCache
    tier = tiers.SharedTier(loop, step_model("h200-llama3-8b"), simulator.TierCosts(), 2**30)
    assert type(tier.tier) is AdapterTier


@pytest.mark.parametrize("policy", ["ours", "ray-multiplex"])
def test_deterministic_per_seed(policy):
    a = simulate(small_trace(seed=0), CLUSTER, policy, seed=0)
    b = simulate(small_trace(seed=0), CLUSTER, policy, seed=0)
    assert a.ttft_s == b.ttft_s and a.tpot_s == b.tpot_s and a.summary() == b.summary()
    c = simulate(small_trace(seed=1), CLUSTER, policy, seed=1)
    assert c.ttft_s != a.ttft_s
    assert a.completed == a.requests


def test_ray_multiplex_downloads_per_replica_ours_per_cluster():
    trace = small_trace(seed=2, num_adapters=20, rate=20.0)
    distinct = len({r.adapter for r in trace})
    ours = simulate(trace, CLUSTER, "ours", seed=0)
    ray = simulate(trace, CLUSTER, "ray-multiplex", seed=0)
    assert ours.origin_fetches == distinct  # the tier holds all 20: one fetch per adapter per cluster
    # Ray's loader keeps a record per replica: an adapter used on k replicas is downloaded k times.
    assert distinct < ray.origin_fetches <= distinct * CLUSTER.replicas
    # Every host load is a download or a re-read of the replica's own disk copy; ours read the object store.
    assert ray.origin_fetches + ray.disk_reads == ray.host_loads
    assert ours.store_reads_same_node + ours.store_reads_other_node == ours.host_loads


def test_per_replica_download_counts_replicas_exactly():
    from cluster.simulator.events import EventLoop
    from cluster.simulator.sim import step_model
    from cluster.simulator.tiers import PerReplicaDownload, SharedTier
    loop = EventLoop()

    class Rep:
        def __init__(self, i, node):
            self.index, self.node = i, node

    reps = [Rep(0, 0), Rep(1, 0), Rep(2, 1)]
    ray = PerReplicaDownload(loop, step_model("h200-llama3-8b"), simulator.TierCosts())
    ours = SharedTier(loop, step_model("h200-llama3-8b"), simulator.TierCosts(), 2**40)
    done = []
    for src in (ray, ours):
        for _ in range(2):
            for rep in reps:
                src.fetch(rep, "x", 16, lambda: done.append(1))
        loop.run()
    assert ray.counters.origin_fetches == 3 and ray.counters.disk_reads == 3
    assert ours.counters.origin_fetches == 1  # six concurrent misses share the first fetch
    assert ours.counters.store_reads_same_node == 4 and ours.counters.store_reads_other_node == 2
    assert len(done) == 12


def test_the_shared_tier_runs_its_fetch_workers_at_once_and_queues_the_rest():
    """Five distinct misses on 2 fetch workers: two origin fetches at a time, in order, each the modeled origin
    time; a sixth miss for an adapter already being fetched waits on that fetch, not for a worker."""
    from cluster.simulator.events import EventLoop
    from cluster.simulator.sim import step_model
    from cluster.simulator.tiers import SharedTier

    class Rep:
        index, node = 0, 0

    loop, model, costs = EventLoop(), step_model("h200-llama3-8b"), simulator.TierCosts()
    tier = SharedTier(loop, model, costs, 2**40, fetch_workers=2)
    done: dict[str, float] = {}
    for name in ("a", "b", "c", "d", "e", "a"):
        tier.fetch(Rep(), name, 16, lambda name=name: done.setdefault(name, loop.now))
    loop.run()
    origin, read = costs.origin_s(model.adapter_bytes(16)), costs.local_load_s(model.adapter_bytes(16))
    assert tier.counters.origin_fetches == 5
    assert done == pytest.approx({"a": origin + read, "b": origin + read, "c": 2 * origin + read,
                                  "d": 2 * origin + read, "e": 3 * origin + read})
    with pytest.raises(ValueError):
        SharedTier(loop, model, costs, 2**40, fetch_workers=0)


@pytest.mark.parametrize("seed", [0, 3])
def test_bound_is_never_beaten(seed):
    trace = small_trace(seed=seed, burst_prob=0.1, base_share=0.1, ranks=(8, 16, 64))
    bound = simulate(trace, CLUSTER, "bound")
    for policy in ("ours", "ray-multiplex", "pow2", "random"):
        rep = simulate(trace, CLUSTER, policy, seed=seed)
        assert rep.completed == rep.requests
        for i, (t, p, bt, bp) in enumerate(zip(rep.ttft_s, rep.tpot_s, bound.ttft_s, bound.tpot_s)):
            assert t >= bt - 1e-12 and p >= bp - 1e-12, (policy, i)
        assert rep.slo_met <= bound.slo_met


def test_trace_round_trip(tmp_path):
    trace = small_trace(seed=4, base_share=0.2, ranks=(16, 64))
    path = tmp_path / "trace.csv"
    write_trace(trace, path)
    back = read_trace(path)
    assert len(back) == len(trace)
    for a, b in zip(trace, back):
        assert a.adapter == b.adapter and a.prompt_tokens == b.prompt_tokens and a.rank == b.rank
        assert math.isclose(a.arrival_s, b.arrival_s, abs_tol=1e-6)
    rep = simulate(back, CLUSTER, "ours", seed=0)
    assert rep.completed == len(back)


def test_user_trace_without_rank(tmp_path):
    path = tmp_path / "mine.csv"
    path.write_text("arrival_s,adapter,prompt_tokens,output_tokens\n0.5,tenant-a,100,20\n0.1,,50,5\n")
    trace = read_trace(path)
    assert [r.adapter for r in trace] == [None, "tenant-a"] and trace[1].rank == 16
    (tmp_path / "bad.csv").write_text("arrival_s,adapter\n1,x\n")
    with pytest.raises(ValueError, match="lacks the columns"):
        read_trace(tmp_path / "bad.csv")


def test_workload_shapes():
    zipf = generate(WorkloadConfig(duration_s=200, rate=50, num_adapters=1000, zipf_s=1.2, seed=0))
    counts = {}
    for r in zipf:
        counts[r.adapter] = counts.get(r.adapter, 0) + 1
    top = sorted(counts.values(), reverse=True)
    assert top[0] > 10 * top[min(50, len(top) - 1)]  # heavy head
    churn = generate(WorkloadConfig(duration_s=300, rate=50, num_adapters=1000, zipf_s=1.2, seed=0,
                                    churn_every_s=100))
    hottest = [max(set(e), key=e.count) for e in
               ([r.adapter for r in churn if k * 100 <= r.arrival_s < (k + 1) * 100] for k in range(3))]
    assert len(set(hottest)) == 3  # a new hot adapter each epoch
    bursty = generate(WorkloadConfig(duration_s=200, rate=50, arrival="gamma", gamma_cv=3.0, seed=0))
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(bursty, bursty[1:])]
    mean = sum(gaps) / len(gaps)
    cv = (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5 / mean
    assert 2.0 < cv < 4.5


def test_calibration_fit_is_close_and_monotone():
    for name in simulator.ROWS:
        model, rows = simulator.fit(name)
        assert model.rms_ms < 0.5
        assert min(model.t0, model.a, model.b, model.f0, model.f1, model.g) >= 0
        assert "rms error" in simulator.fit_table(name)


def test_capacity_counts_the_batch_the_slots_allow():
    """A replica runs at most max_loras distinct adapters a step: traffic spread over many rare adapters runs
    batches of about max_loras sequences, one hot adapter runs max_num_seqs; capacity follows."""
    from dataclasses import replace as dc_replace

    from cluster.simulator.capacity import capacity_rps, expected_distinct, slot_limited_batch
    from cluster.simulator.sim import step_model
    from cluster.simulator.workload import Request

    assert expected_distinct([1.0], 4, 32) == pytest.approx(1.0)
    # 4 replicas, 400 adapters of 1/400 each: each on one replica, so a replica's batch of b draws from its 100
    assert expected_distinct([1 / 400] * 400, 4, 10) == pytest.approx(100 * (1 - (1 - 1 / 100) ** 10))
    cfg = ReplicaConfig(max_loras=4, max_num_seqs=32)
    spread = [Request(i * 0.01, f"a{i}", 64, 64, 16) for i in range(2000)]
    hot = [dc_replace(r, adapter="a0") for r in spread]
    assert slot_limited_batch(cfg, 4, spread)[0] == 4  # every request a new adapter: 4 fit
    assert slot_limited_batch(cfg, 4, hot) == (32, pytest.approx(1.0))
    model = step_model("h200-llama3-8b")
    assert capacity_rps(4, model, cfg, spread) < 0.5 * capacity_rps(4, model, cfg, hot)


def test_the_clairvoyant_fleet_follows_the_rate_with_the_fewest_sustaining_replicas():
    """fleet_bound: a fleet's sustainable rate grows with its size and meets the SLO where a rate 1.3 x above it
    does not; over a rate curve the bound charges, at each step, the fewest sizes whose rate covers it; and
    diurnal_rate is generate's curve (its arrivals per minute follow it)."""
    from cluster.simulator.fleet_bound import diurnal_rate, fleet_bound, sustainable_rate

    wl = WorkloadConfig(duration_s=60.0, rate=10.0, num_adapters=50, output_median=32, max_output=128, seed=4)
    cluster = ClusterConfig(replica=ReplicaConfig(max_loras=4, max_cpu_loras=8, max_num_seqs=8, max_ongoing=16))
    one = sustainable_rate(1, wl, cluster, 0.99, duration_s=60.0, tolerance=0.05)
    assert 0 < one
    fixed = dataclasses.replace(cluster, replicas=1)
    over = simulate(generate(dataclasses.replace(wl, rate=1.3 * one)), fixed, "ours").summary()["slo"]
    assert over < 0.99
    bound = fleet_bound(lambda t: one * (0.5 if t < 30 else 1.5), 60.0, wl, cluster, 0.99, 3, step_s=10.0,
                        probe_s=60.0)
    assert bound.rates[1] == pytest.approx(one, rel=0.05) and bound.rates[2] > bound.rates[1]
    n_high = min(n for n, r in bound.rates.items() if r >= 1.5 * one)
    # 20 s at 1 replica, then the step [20, 30) sees the rise (its end's rate), so 4 steps at n_high
    assert bound.replica_h == pytest.approx((20 * 1 + 40 * n_high) / 3600)
    # ... and with start-up: one replica was up at 0, each added one asked for 15 s ahead of its step
    started = fleet_bound(lambda t: one * (0.5 if t < 30 else 1.5), 60.0, wl, cluster, 0.99, 3, step_s=10.0,
                          probe_s=60.0, startup_s=15.0, initial=1)
    assert started.replica_h_started == pytest.approx(bound.replica_h + (n_high - 1) * 15 / 3600)
    curve = WorkloadConfig(duration_s=600.0, rate=20.0, diurnal_amplitude=0.8, diurnal_period_s=600.0, seed=1)
    arrivals = generate(curve)
    rate = diurnal_rate(curve)
    for minute in (1, 4, 7):
        seen = sum(1 for r in arrivals if 60 * minute <= r.arrival_s < 60 * (minute + 1)) / 60
        assert seen == pytest.approx(rate(60 * minute + 30), rel=0.25)


def test_a_started_fleet_pays_each_start_or_keeps_a_replica_over_a_short_gap():
    """started_replica_s: the j-th replica's running spans, plus start-up for each span it starts (none for the
    replicas up at time 0), or the gap since it stopped where that is shorter."""
    from cluster.simulator.fleet_bound import started_replica_s

    plan = [(0.0, 1), (10.0, 3), (20.0, 3), (30.0, 1), (40.0, 3), (50.0, 1)]
    # replica 1: 60 s up from 0; replicas 2 and 3 each: 15 s start + 20 s up, kept over the 10 s gap, 10 s up
    assert started_replica_s(plan, 10.0, 15.0, initial=1) == pytest.approx(60 + 2 * (15 + 20 + 10 + 10))
    assert started_replica_s(plan, 10.0, 5.0, initial=1) == pytest.approx(60 + 2 * (5 + 20 + 5 + 10))
    assert started_replica_s(plan, 10.0, 15.0, initial=0) == pytest.approx(15 + 60 + 2 * (15 + 20 + 10 + 10))
    assert started_replica_s(plan, 10.0, 0.0, initial=0) == pytest.approx(sum(n * 10 for _, n in plan))
