"""The fewest replica-hours an autoscaler could spend on a rate curve: the clairvoyant fleet.

At every moment it runs the fewest replicas that, held fixed, meet the SLO for `attainment` of the requests at
that moment's rate, and it adds them with no start-up, removes them with no drain and knows the rate ahead.
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


def fleet_bound(rate_at: Callable[[float], float], duration_s: float, workload: WorkloadConfig,
                cluster: ClusterConfig, attainment: float, max_replicas: int, step_s: float = 10.0,
                probe_s: float = 300.0, seed: int = 0) -> FleetBound:
    """The clairvoyant fleet's replica-hours on the rate curve `rate_at(t)` over [0, duration_s): at each step
    the fewest replicas (at least 1, at most max_replicas) whose sustainable rate covers the curve's highest
    rate within the step."""
    peak = max(rate_at(t * step_s) for t in range(int(duration_s / step_s) + 1))
    rates: dict[int, float] = {}
    hint = None
    for n in range(1, max_replicas + 1):
        rates[n] = sustainable_rate(n, workload, cluster, attainment, probe_s, seed=seed,
                                    hi=None if hint is None else hint * n * 1.25)
        hint = rates[n] / n
        if rates[n] >= peak:
            break
    sizes = sorted(rates)
    total = 0.0
    t = 0.0
    while t < duration_s:
        dt = min(step_s, duration_s - t)
        need = max(rate_at(t), rate_at(t + dt))
        n = next((k for k in sizes if rates[k] >= need), math.inf)
        total += n * dt
        t += dt
    return FleetBound(rates=rates, replica_h=total / 3600.0, attainment=attainment)


def diurnal_rate(workload: WorkloadConfig) -> Callable[[float], float]:
    """The arrival rate of `workload` at time t (workload.generate's curve), in requests per second: bursts
    included (each arrival brings its burst's extra requests)."""
    per_arrival = 1 + workload.burst_prob * (workload.burst_len - 1)
    a, period = workload.diurnal_amplitude, workload.diurnal_period_s
    return lambda t: workload.rate * per_arrival * max(1e-6, 1.0 + a * math.sin(2 * math.pi * t / period))
