"""simulate(trace, cluster_config, policy, seed) -> Report, and the bound no policy can beat.

The cluster: `replicas` SimReplicas on nodes of `replicas_per_node`, a router
running one policy, and the adapter source its design implies (ours: the
shared tier on node 0 over the origin; Ray's multiplexing: each replica's own
download). Requests no replica accepts wait at the router, FIFO, and are routed
again whenever a request finishes.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from cluster.simulator.calibration import StepModel, TierCosts, fit
from cluster.simulator.events import EventLoop
from cluster.simulator.metrics import SLO, Report
from cluster.simulator.policies import POLICIES
from cluster.simulator.replica import ReplicaConfig, SimReplica, SimRequest
from cluster.simulator.tiers import PerReplicaDownload, SharedTier
from cluster.simulator.workload import Request


@dataclass
class ClusterConfig:
    replicas: int = 4
    replicas_per_node: int = 8
    gpu: str = "h200-llama3-8b"  # a calibration.ROWS table
    replica: ReplicaConfig = field(default_factory=ReplicaConfig)
    costs: TierCosts = field(default_factory=TierCosts)
    tier_capacity_bytes: int = 64 * 2**30
    stats_period_s: float = 1.0
    max_num_models_per_replica: int | None = None  # Ray's multiplex LRU; None: max_cpu_loras
    policy_kwargs: dict = field(default_factory=dict)  # AdapterAffinityPolicy's knobs
    slo: SLO = field(default_factory=SLO)
    drain_s: float = 3600.0  # run past the last arrival at most this long


_MODELS: dict[str, StepModel] = {}


def step_model(gpu: str) -> StepModel:
    if gpu not in _MODELS:
        _MODELS[gpu] = fit(gpu)[0]
    return _MODELS[gpu]


def simulate(trace: list[Request], cfg: ClusterConfig, policy: str = "ours", seed: int = 0) -> Report:
    if policy == "bound":
        return bound(trace, cfg)
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; one of {sorted(POLICIES) + ['bound']}")
    loop = EventLoop()
    model = step_model(cfg.gpu)
    cls = POLICIES[policy]
    if policy == "ours":
        routing = cls(loop, seed, cfg.stats_period_s, **cfg.policy_kwargs)
    elif policy == "ray-multiplex":
        routing = cls(loop, seed, cfg.stats_period_s,
                      max_num_models_per_replica=cfg.max_num_models_per_replica or cfg.replica.max_cpu_loras)
    else:
        routing = cls(loop, seed, cfg.stats_period_s)
    if routing.fetch_kind == "shared":
        source = SharedTier(loop, model, cfg.costs, cfg.tier_capacity_bytes)
    else:
        source = PerReplicaDownload(loop, model, cfg.costs)
    waiting: deque[SimRequest] = deque()
    done: list[SimRequest] = []

    def finish(r: SimRequest) -> None:
        done.append(r)
        routing.finished(r)
        # A slot at the router freed up: route the oldest waiting requests while replicas accept them.
        while waiting:
            rep = routing.route(waiting[0], replicas, True)
            if rep is None:
                break
            rep.accept(waiting.popleft())

    replicas = [SimReplica(i, i // cfg.replicas_per_node, cfg.replica, model, cfg.costs, loop, source.fetch, finish)
                for i in range(cfg.replicas)]

    def arrive(r: SimRequest) -> None:
        rep = None if waiting else routing.route(r, replicas, False)
        if rep is None:
            waiting.append(r)
        else:
            rep.accept(r)

    reqs = [SimRequest(i, q) for i, q in enumerate(trace)]
    # Arrivals are scheduled lazily, one ahead, so the heap stays small on long traces.
    def next_arrival(i: int) -> None:
        arrive(reqs[i])
        if i + 1 < len(reqs):
            loop.at(reqs[i + 1].req.arrival_s, next_arrival, i + 1)

    if reqs:
        loop.at(reqs[0].req.arrival_s, next_arrival, 0)
    span = trace[-1].arrival_s if trace else 0.0
    loop.run(until=span + cfg.drain_s)

    ttft, tpot = [], []
    for r in reqs:
        if r.finish_s < 0:
            ttft.append(math.nan)
            tpot.append(math.nan)
            continue
        ttft.append(r.first_token_s - r.req.arrival_s)
        tpot.append((r.finish_s - r.first_token_s) / (r.req.output_tokens - 1) if r.req.output_tokens > 1 else 0.0)
    tc = source.counters
    return Report(
        policy=policy, requests=len(reqs), completed=len(done), ttft_s=ttft, tpot_s=tpot, slo=cfg.slo,
        duration_s=max(span, 1e-9), end_s=loop.now, replicas=cfg.replicas,
        busy_s=sum(rep.counters.busy_s for rep in replicas), origin_fetches=tc.origin_fetches,
        store_reads_same_node=tc.store_reads_same_node, store_reads_other_node=tc.store_reads_other_node,
        disk_reads=tc.disk_reads, host_loads=sum(rep.counters.host_loads for rep in replicas),
        slot_loads=sum(rep.counters.slot_loads for rep in replicas), decisions=routing.decisions(),
        events=loop.events_run)


def bound_times(req: Request, model: StepModel) -> tuple[float, float]:
    """A request's TTFT and TPOT alone on a replica, its adapter already on the GPU, nothing queued: no
    policy can do better (every step time grows with the batch, prompt tokens, adapters and rank)."""
    n = 0 if req.adapter is None else 1
    ttft = model.step_s(0, req.prompt_tokens, n, req.rank)
    tpot = model.step_s(1, 0, n, req.rank) if req.output_tokens > 1 else 0.0
    return ttft, tpot


def bound(trace: list[Request], cfg: ClusterConfig) -> Report:
    model = step_model(cfg.gpu)
    times = [bound_times(r, model) for r in trace]
    busy = sum(t + p * (r.output_tokens - 1) for r, (t, p) in zip(trace, times))
    span = trace[-1].arrival_s if trace else 0.0
    end = max((r.arrival_s + t + p * (r.output_tokens - 1) for r, (t, p) in zip(trace, times)), default=0.0)
    return Report(policy="bound", requests=len(trace), completed=len(trace), ttft_s=[t for t, _ in times],
                  tpot_s=[p for _, p in times], slo=cfg.slo, duration_s=max(span, 1e-9), end_s=end,
                  replicas=cfg.replicas, busy_s=busy)
