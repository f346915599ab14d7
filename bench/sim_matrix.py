"""Issue 40's placement matrix in the simulator: our router and tier against Ray Serve's multiplexed routing.

Cells: {32, 128} replicas x Zipf {0.8, 1.0, 1.2} x {i.i.d., bursty, churn} x {70%, 90%} of the cluster's
capacity (cluster/simulator/capacity.py), 10,000 adapters, origin 200 ms + 500 MB/s. Every cell runs the
same trace through each policy and the bound, side by side, and prints per cell:

- goodput (requests per second meeting the SLO, TTFT <= 2 s and TPOT <= 100 ms) of ours, Ray's and the bound;
- ours / Ray, and bound / Ray: the most any policy could gain over Ray in that cell (a 1.3 x target above it
  cannot be met);
- ours / bound;
- origin fetches (ours, Ray) against the distinct adapters of the trace.

    python bench/sim_matrix.py                         # the whole matrix, 2 processes
    python bench/sim_matrix.py --replicas 32 --zipf 1.2 --workloads bursty --loads 0.9
    python bench/sim_matrix.py --markdown matrix.md    # also write the table as markdown

Workloads: i.i.d. is Poisson arrivals over Zipf popularity; bursty is Gamma arrivals (cv 2) with tenant
bursts (5% of arrivals start a run of 8 requests for one adapter); churn is Poisson with a new hottest
adapter every quarter of the run. A burst's extra requests count in the load: the arrival rate is the
target request rate over the mean burst size.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster.simulator import ClusterConfig, ReplicaConfig, TierCosts, WorkloadConfig, generate, simulate  # noqa: E402
from cluster.simulator.capacity import workload_capacity_rps  # noqa: E402
from cluster.simulator.sim import step_model  # noqa: E402

WORKLOADS = {
    "iid": dict(arrival="poisson"),
    "bursty": dict(arrival="gamma", gamma_cv=2.0, burst_prob=0.05, burst_len=8),
    "churn": dict(arrival="poisson", churn_quarters=True),
}


def cell_workload(kind: str, zipf: float, load: float, replicas: int, cfg: ClusterConfig, adapters: int,
                  duration: float, seed: int) -> tuple[WorkloadConfig, float]:
    spec = dict(WORKLOADS[kind])
    churn = spec.pop("churn_quarters", False)
    wl = WorkloadConfig(duration_s=duration, num_adapters=adapters, zipf_s=zipf, seed=seed, **spec)
    if churn:
        wl = replace(wl, churn_every_s=duration / 4)
    target = load * workload_capacity_rps(replicas, step_model(cfg.gpu), cfg.replica, wl)
    per_arrival = 1 + wl.burst_prob * (wl.burst_len - 1)
    return replace(wl, rate=target / per_arrival), target


def run_cell(args: tuple) -> dict:
    replicas, zipf, kind, load, policies, a = args
    cfg = ClusterConfig(replicas=replicas, replicas_per_node=8, gpu=a.gpu,
                        replica=ReplicaConfig(max_loras=a.max_loras, max_cpu_loras=a.max_cpu_loras,
                                              max_num_seqs=a.max_num_seqs, max_ongoing=a.max_ongoing),
                        costs=TierCosts(origin_latency_s=a.origin_latency, origin_bw=a.origin_gbps * 1e9),
                        tier_capacity_bytes=int(a.tier_gb * 2**30), policy_kwargs=json.loads(a.policy_kwargs))
    duration = a.duration if a.duration else (300.0 if replicas <= 32 else 120.0)
    wl, target = cell_workload(kind, zipf, load, replicas, cfg, a.adapters, duration, a.seed)
    trace = generate(wl)
    out = dict(replicas=replicas, zipf=zipf, workload=kind, load=load, target_rps=target, requests=len(trace),
               distinct=len({r.adapter for r in trace if r.adapter is not None}))
    t = time.perf_counter()
    for policy in (*policies, "bound"):
        s = simulate(trace, cfg, policy, seed=a.seed).summary()
        out[policy] = s
    out["wall_s"] = time.perf_counter() - t
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, nargs="+", default=[32, 128])
    p.add_argument("--zipf", type=float, nargs="+", default=[0.8, 1.0, 1.2])
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--loads", type=float, nargs="+", default=[0.7, 0.9])
    p.add_argument("--policies", nargs="+", default=["ours", "ray-multiplex"])
    p.add_argument("--adapters", type=int, default=10000)
    p.add_argument("--duration", type=float, default=0.0, help="simulated s of arrivals (0: 300 at <= 32 "
                                                                "replicas, else 120)")
    p.add_argument("--gpu", default="h200-llama3-8b")
    p.add_argument("--max-loras", type=int, default=16)
    p.add_argument("--max-cpu-loras", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-ongoing", type=int, default=64)
    p.add_argument("--origin-latency", type=float, default=0.2)
    p.add_argument("--origin-gbps", type=float, default=0.5)
    p.add_argument("--tier-gb", type=float, default=1024.0, help="the shared tier's object-store bytes (GiB)")
    p.add_argument("--policy-kwargs", default="{}", help="AdapterAffinityPolicy's knobs for ours, as JSON")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--markdown", help="also write the table here")
    a = p.parse_args()
    ours, ray = a.policies[0], a.policies[1] if len(a.policies) > 1 else None
    cells = [(r, z, w, l, tuple(a.policies), a)
             for r, z, w, l in itertools.product(a.replicas, a.zipf, a.workloads, a.loads)]
    print(f"{len(cells)} cells; {a.adapters} adapters; origin {a.origin_latency * 1e3:.0f} ms + "
          f"{a.origin_gbps * 1e3:.0f} MB/s; tier {a.tier_gb:.0f} GiB; {a.gpu}; seed {a.seed}", flush=True)
    t = time.perf_counter()
    with ProcessPoolExecutor(a.jobs) as pool:
        results = list(pool.map(run_cell, cells))
    head = (f"| replicas | zipf | workload | load | req/s | {ours} goodput | {ray} goodput | bound goodput | "
            f"{ours}/{ray} | bound/{ray} | {ours}/bound | {ours} slo | {ray} slo | {ours} ttft p99 | "
            f"{ray} ttft p99 | distinct | {ours} origin | {ray} origin |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        o, y, b = r[ours], r[ray], r["bound"]
        lines.append(f"| {r['replicas']} | {r['zipf']} | {r['workload']} | {r['load']:.0%} | {r['target_rps']:.0f} | "
                     f"{o['goodput']:.1f} | {y['goodput']:.1f} | {b['goodput']:.1f} | "
                     f"{o['goodput'] / y['goodput']:.3f} | {b['goodput'] / y['goodput']:.3f} | "
                     f"{o['goodput'] / b['goodput']:.3f} | {o['slo']:.3f} | {y['slo']:.3f} | "
                     f"{o['ttft_p99']:.2f} | {y['ttft_p99']:.2f} | {r['distinct']} | {o['origin']} | {y['origin']} |")
    text = "\n".join(lines)
    print(text)
    vs_ray = [r[ours]["goodput"] / r[ray]["goodput"] for r in results]
    of_bound = [r[ours]["goodput"] / r["bound"]["goodput"] for r in results]
    hard = [r for r in results if r["workload"] in ("bursty", "churn")]
    met = sum(r[ours]["goodput"] >= min(1.3 * r[ray]["goodput"], 0.95 * r["bound"]["goodput"]) for r in hard)
    once = sum(r[ours]["origin"] == r["distinct"] for r in results)
    print(f"\n{ours}/{ray} goodput: min {min(vs_ray):.3f}, max {max(vs_ray):.3f} (target: never below 1.0)")
    print(f"{ours}/bound goodput: min {min(of_bound):.3f} (target >= 0.9)")
    print(f"bursty + churn cells at >= 1.3 x {ray}, or >= 0.95 x the bound where bound/{ray} < 1.3/0.95: "
          f"{met}/{len(hard)}")
    print(f"cells with {ours}'s origin fetches == distinct adapters: {once}/{len(results)}")
    print(f"wall {time.perf_counter() - t:.0f} s")
    if a.markdown:
        Path(a.markdown).write_text(text + "\n")


if __name__ == "__main__":
    main()
