"""Cluster simulator: policies side by side on one generated workload, with the bound; or a speed run.

    python bench/simulate.py                           # small: 8 replicas, 1,000 adapters, 2 simulated minutes
    python bench/simulate.py --replicas 32 --adapters 10000 --zipf 1.2 --duration 600 --rate 200 --burst 0.05
    python bench/simulate.py --trace my.csv            # replay a trace (arrival_s,adapter,prompt_tokens,output_tokens)
    python bench/simulate.py --speed                   # 128 replicas x 10,000 adapters x 1 simulated hour, ours

Prints the step model's calibration fit (rows of bench/RESULTS.md) with its error, then one row per policy:
TTFT p50/p99 and TPOT p50/p99 (s), SLO attainment, goodput (req/s meeting the SLO), origin fetches, object-store
reads (same / other node), local-disk reads (Ray's per-replica copies), host and slot loads, GPU busy share and
replica-hours. docs/simulator.md explains the model.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster.simulator import (ClusterConfig, ReplicaConfig, SLO, WorkloadConfig, fit_table, generate,  # noqa: E402
                               read_trace, simulate, table, write_trace)

POLICIES = ("ours", "ray-multiplex", "pow2", "random", "bound")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--replicas-per-node", type=int, default=8)
    p.add_argument("--gpu", default="h200-llama3-8b", help="calibration table (h200-llama3-8b, h100-llama3-8b)")
    p.add_argument("--adapters", type=int, default=1000)
    p.add_argument("--zipf", type=float, default=1.0)
    p.add_argument("--rate", type=float, default=30.0, help="mean requests per second")
    p.add_argument("--duration", type=float, default=120.0, help="simulated seconds of arrivals")
    p.add_argument("--arrival", choices=("poisson", "gamma"), default="poisson")
    p.add_argument("--gamma-cv", type=float, default=2.0)
    p.add_argument("--burst", type=float, default=0.0, help="chance an arrival starts a tenant burst")
    p.add_argument("--churn", type=float, default=0.0, help="seconds between new hot adapters (0: none)")
    p.add_argument("--diurnal", type=float, default=0.0, help="amplitude of a daily rate curve")
    p.add_argument("--ranks", type=int, nargs="+", default=[16])
    p.add_argument("--max-loras", type=int, default=16)
    p.add_argument("--max-cpu-loras", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-ongoing", type=int, default=64)
    p.add_argument("--origin-latency", type=float, default=0.2, help="s")
    p.add_argument("--origin-gbps", type=float, default=1.0, help="GB/s")
    p.add_argument("--slo-ttft", type=float, default=2.0)
    p.add_argument("--slo-tpot", type=float, default=0.1)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--trace", help="replay this CSV instead of generating")
    p.add_argument("--write-trace", help="write the generated workload here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--speed", action="store_true", help="time 128 replicas x 10,000 adapters x 1 simulated hour")
    a = p.parse_args()
    if a.speed:
        a.replicas, a.adapters, a.duration, a.policies = 128, 10000, 3600.0, "ours"
        a.rate = a.rate if a.rate != 30.0 else 128 * 1.0

    print(fit_table(a.gpu), "\n")
    from cluster.simulator.calibration import TierCosts
    cfg = ClusterConfig(replicas=a.replicas, replicas_per_node=a.replicas_per_node, gpu=a.gpu,
                        replica=ReplicaConfig(max_loras=a.max_loras, max_cpu_loras=a.max_cpu_loras,
                                              max_num_seqs=a.max_num_seqs, max_ongoing=a.max_ongoing),
                        costs=TierCosts(origin_latency_s=a.origin_latency, origin_bw=a.origin_gbps * 1e9),
                        slo=SLO(a.slo_ttft, a.slo_tpot))
    t = time.perf_counter()
    if a.trace:
        trace = read_trace(a.trace)
    else:
        trace = generate(WorkloadConfig(duration_s=a.duration, rate=a.rate, num_adapters=a.adapters, zipf_s=a.zipf,
                                        arrival=a.arrival, gamma_cv=a.gamma_cv, burst_prob=a.burst,
                                        churn_every_s=a.churn, diurnal_amplitude=a.diurnal,
                                        diurnal_period_s=max(a.duration, 1.0), ranks=tuple(a.ranks), seed=a.seed))
    gen_s = time.perf_counter() - t
    if a.write_trace:
        write_trace(trace, a.write_trace)
    print(f"{len(trace)} requests over {trace[-1].arrival_s if trace else 0:.0f} s, "
          f"{len({r.adapter for r in trace})} distinct adapters; {a.replicas} replicas ({a.gpu}), "
          f"max_loras {a.max_loras}, max_cpu_loras {a.max_cpu_loras}; SLO TTFT <= {a.slo_ttft} s, "
          f"TPOT <= {a.slo_tpot * 1e3:.0f} ms; seed {a.seed}; generated in {gen_s:.1f} s")
    rows = []
    for policy in a.policies.split(","):
        t = time.perf_counter()
        report = simulate(trace, cfg, policy, seed=a.seed)
        wall = time.perf_counter() - t
        rows.append(report.summary())
        extra = f"  decisions {report.decisions}" if report.decisions else ""
        print(f"  {policy}: {wall:.1f} s wall, {report.events} events, {report.completed}/{report.requests} "
              f"finished{extra}", flush=True)
    print()
    print(table(rows))
    if a.speed:
        print(f"\nspeed: {a.replicas} replicas x {a.adapters} adapters x {a.duration:.0f} simulated s "
              f"({len(trace)} requests): generate {gen_s:.1f} s + simulate {wall:.1f} s = {gen_s + wall:.1f} s")


if __name__ == "__main__":
    main()
