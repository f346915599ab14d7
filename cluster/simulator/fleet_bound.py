"""The fewest replica-hours an autoscaler could spend on a rate curve: the clairvoyant fleet.

At every moment it runs the fewest replicas that, held fixed, meet the SLO for `attainment` of the requests at
that moment's rate, and it adds them with no start-up, removes them with no drain and knows the rate ahead.
`replica_h_started` charges what no autoscaler avoids on top: a replica serves only `startup_s` after it is asked
for, so the clairvoyant fleet asks that early for each replica it adds, or keeps one it would stop for less than
that instead.
A fleet's sustainable rate is measured in the simulator with the same replicas, router and request mix (the
workload at a constant rate), by bisection. Any real autoscaler pays start-up and the look-back of its metrics,
so it spends more; the bound is quasi-static (a queue may absorb a short peak), which a curve that changes over
minutes, as diurnal traffic does, does not exploit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

from cluster.simulator.sim import ClusterConfig, simulate
from cluster.simulator.workload import WorkloadConfig, generate


def sustainable_rate(replicas: int, workload: WorkloadConfig, cluster: ClusterConfig, attainment: float,
                     duration_s: float = 300.0, policy: str = "ours", seed: int = 0, tolerance: float = 0.02,
                     hi: float | None = None) -> float:
    """The largest constant request rate at which `replicas` fixed replicas meet the SLO for `attainment` of the
    requests on `workload`'s mix (its rate and diurnal curve replaced), within `tolerance` (relative)."""
    fixed = replace(cluster, replicas=replicas, autoscaling=None)

    def meets(rate: float) -> bool:
        trace = generate(replace(workload, rate=rate, duration_s=duration_s, diurnal_amplitude=0.0, seed=seed))
        return simulate(trace, fixed, policy, seed).summary()["slo"] >= attainment

    lo, hi = 0.0, hi or 16.0 * replicas
    while meets(hi):  # find a rate the fleet cannot sustain
        lo, hi = hi, 2 * hi
    while hi - lo > tolerance * hi:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if meets(mid) else (lo, mid)
    return lo


@dataclass
class FleetBound:
    rates: dict[int, float]  # fleet size -> sustainable rate
    replica_h: float  # the clairvoyant fleet's replica-hours over the curve
    attainment: float
    replica_h_started: float = 0.0  # ... with each replica it adds asked for startup_s ahead


def started_replica_s(sizes: list[tuple[float, int]], step_s: float, startup_s: float, initial: int) -> float:
    """Replica-seconds of a fleet of sizes[i] = (start of step i, replicas) over steps of `step_s` (the last
    ending at its own start + step_s) whose replicas serve `startup_s` after they are asked for: the j-th
    replica's running spans, each started startup_s ahead unless the j-th stopped less than that before (then
    kept running over the gap, which costs less). The first `initial` replicas run at time 0."""
    total = 0.0
    for j in range(1, max((n for _, n in sizes), default=0) + 1):
        stopped: float | None = None  # when the j-th replica last stopped
        up = False
        for t, n in sizes:
            if n >= j and not up:
                if t > 0 or j > initial:
                    total += startup_s if stopped is None else min(startup_s, t - stopped)
                up = True
            elif n < j and up:
                stopped, up = t, False
            total += step_s if up else 0.0
    return total


def fleet_bound(rate_at: Callable[[float], float], duration_s: float, workload: WorkloadConfig,
                cluster: ClusterConfig, attainment: float, max_replicas: int, step_s: float = 10.0,
                probe_s: float = 300.0, seed: int = 0, startup_s: float = 0.0, initial: int = 0) -> FleetBound:
    """The clairvoyant fleet's replica-hours on the rate curve `rate_at(t)` over [0, duration_s): at each step
    the fewest replicas (at least 1, at most max_replicas) whose sustainable rate covers the curve's highest
    rate within the step; and with start-up (started_replica_s: `initial` replicas up at time 0)."""
    peak = max(rate_at(t * step_s) for t in range(int(duration_s / step_s) + 1))
    rates: dict[int, float] = {}
    hint = None
    for n in range(1, max_replicas + 1):
        rates[n] = sustainable_rate(n, workload, cluster, attainment, probe_s, seed=seed,
                                    hi=None if hint is None else hint * n * 1.25)
        hint = rates[n] / n
        if rates[n] >= peak:
            break
    fleets = sorted(rates)
    plan: list[tuple[float, int]] = []  # (step start, replicas)
    for i in range(math.ceil(duration_s / step_s)):
        t = i * step_s
        need = max(rate_at(t), rate_at(min(t + step_s, duration_s)))
        plan.append((t, next((k for k in fleets if rates[k] >= need), max_replicas + 1)))
    # whole steps: the curve's last partial step is charged in full, a few replica-seconds at most
    total = sum(n * step_s for _, n in plan)
    return FleetBound(rates=rates, replica_h=total / 3600.0, attainment=attainment,
                      replica_h_started=started_replica_s(plan, step_s, startup_s, initial) / 3600.0)


def diurnal_rate(workload: WorkloadConfig) -> Callable[[float], float]:
    """The arrival rate of `workload` at time t (workload.generate's curve), in requests per second: bursts
    included (each arrival brings its burst's extra requests)."""
    per_arrival = 1 + workload.burst_prob * (workload.burst_len - 1)
    a, period = workload.diurnal_amplitude, workload.diurnal_period_s
    return lambda t: workload.rate * per_arrival * max(1e-6, 1.0 + a * math.sin(2 * math.pi * t / period))
