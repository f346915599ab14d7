"""simulate(trace, cluster_config, policy, seed) -> Report, and the bound no policy can beat.

The cluster: `replicas` SimReplicas on nodes of `replicas_per_node`, a router
running one policy, and the adapter source its design implies (ours: the
shared tier on node 0 over the origin; Ray's multiplexing: each replica's own
download). Requests no replica accepts wait at the router, FIFO, and are routed
again whenever a request finishes or a replica starts.

With `autoscaling` set, replicas come and go under an autoscaler instead
(autoscale.py); `run` also returns its FleetLog, and the Report's `replicas`
is then the time-averaged live count, so its replica-hours integrate it.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from cluster.adapter_tier import DEFAULT_FETCH_CONCURRENCY
from cluster.simulator.autoscale import AutoscaleConfig, Fleet, FleetLog, ScalableReplica
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
    tier_fetch_workers: int = DEFAULT_FETCH_CONCURRENCY  # origin fetches the shared tier runs at once
    stats_period_s: float = 1.0
    max_num_models_per_replica: int | None = None  # Ray's multiplex LRU; None: max_cpu_loras
    policy_kwargs: dict = field(default_factory=dict)  # AdapterAffinityPolicy's knobs
    slo: SLO = field(default_factory=SLO)
    drain_s: float = 3600.0  # run past the last arrival at most this long
    autoscaling: AutoscaleConfig | None = None  # None: `replicas` fixed; else they come and go (autoscale.py)


_MODELS: dict[str, StepModel] = {}


def step_model(gpu: str) -> StepModel:
    if gpu not in _MODELS:
        _MODELS[gpu] = fit(gpu)[0]
    return _MODELS[gpu]


def simulate(trace: list[Request], cfg: ClusterConfig, policy: str = "ours", seed: int = 0) -> Report:
    if policy == "bound":
        return bound(trace, cfg)
    return run(trace, cfg, policy, seed)[0]


def run(trace: list[Request], cfg: ClusterConfig, policy: str = "ours",
        seed: int = 0) -> tuple[Report, FleetLog | None]:
    """simulate's Report, and what the autoscaler did (None when the replica count is fixed)."""
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
        source = SharedTier(loop, model, cfg.costs, cfg.tier_capacity_bytes, fetch_workers=cfg.tier_fetch_workers)
    else:
        source = PerReplicaDownload(loop, model, cfg.costs)
    waiting: deque[SimRequest] = deque()
    done: list[SimRequest] = []

    def route_waiting() -> None:
        # Route the oldest waiting requests while replicas accept them.
        while waiting:
            rep = routing.route(waiting[0], replicas, True)
            if rep is None:
                break
            rep.accept(waiting.popleft())

    def finish(r: SimRequest) -> None:
        done.append(r)
        routing.finished(r)
        route_waiting()  # a slot at the router freed up

    fleet = None
    if cfg.autoscaling is None:
        replicas = [SimReplica(i, i // cfg.replicas_per_node, cfg.replica, model, cfg.costs, loop, source.fetch,
                               finish) for i in range(cfg.replicas)]
    else:
        fleet = _fleet(cfg, loop, model, routing, source, finish, route_waiting, waiting,
                       lambda: loop.now >= span and len(done) + fleet.log.lost >= len(reqs))
        replicas = fleet.replicas

    def arrive(r: SimRequest) -> None:
        rep = None if waiting else routing.route(r, replicas, False)
        if rep is None:
            waiting.append(r)
        else:
            rep.accept(r)

    reqs = [SimRequest(i, q) for i, q in enumerate(trace)]
    span = trace[-1].arrival_s if trace else 0.0
    if fleet is not None:
        fleet.start()
    # Arrivals are scheduled lazily, one ahead, so the heap stays small on long traces.
    def next_arrival(i: int) -> None:
        arrive(reqs[i])
        if i + 1 < len(reqs):
            loop.at(reqs[i + 1].req.arrival_s, next_arrival, i + 1)

    if reqs:
        loop.at(reqs[0].req.arrival_s, next_arrival, 0)
    loop.run(until=span + cfg.drain_s)
    end_s = loop.now
    n_replicas: float = cfg.replicas
    if fleet is not None:
        end_s = max((r.finish_s for r in done), default=loop.now)
        fleet.close(end_s)
        n_replicas = fleet.log.replica_s / end_s if end_s > 0 else 0.0

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
        duration_s=max(span, 1e-9), end_s=end_s, replicas=n_replicas,
        busy_s=sum(rep.counters.busy_s for rep in replicas), origin_fetches=tc.origin_fetches,
        store_reads_same_node=tc.store_reads_same_node, store_reads_other_node=tc.store_reads_other_node,
        disk_reads=tc.disk_reads, host_loads=sum(rep.counters.host_loads for rep in replicas),
        slot_loads=sum(rep.counters.slot_loads for rep in replicas), decisions=routing.decisions(),
        events=loop.events_run), (fleet.log if fleet is not None else None)


def _fleet(cfg: ClusterConfig, loop: EventLoop, model: StepModel, routing, source, finish, route_waiting,
           waiting: deque, finished) -> Fleet:
    """An autoscaled fleet of ScalableReplicas around the router and the adapter source."""
    window = cfg.autoscaling.adapter_window_s

    def make(index: int) -> ScalableReplica:
        return ScalableReplica(index, index // cfg.replicas_per_node, cfg.replica, model, cfg.costs, loop,
                               source.fetch, finish, adapter_window_s=window)

    def lost(r: SimRequest) -> None:
        routing.finished(r)
        route_waiting()

    def reset_index(index: int) -> None:
        # A new replica in a stopped one's slot: the router and the loaders forget the old one, as Serve's
        # router does for a replica that went away.
        policy = getattr(routing, "policy", None)
        if policy is not None:
            policy.forget_replica(index)
        getattr(routing, "models", {}).pop(index, None)  # Ray's multiplex LRU of model ids
        getattr(source, "downloaded", {}).pop(index, None)  # Ray's per-replica downloads

    def grown() -> None:
        routing._polled_at = -math.inf  # the router's per-position stats no longer cover every replica

    return Fleet(cfg.autoscaling, loop, make, route_waiting, lambda: len(waiting), lost, reset_index, grown,
                 cfg.replicas_per_node, cfg.replica.max_num_seqs, cfg.replica.max_loras, finished)


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
