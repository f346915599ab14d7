"""Fidelity: the cluster simulator's prediction against the real Serve stack with emulated GPU replicas, one trace.

One seeded trace (cluster.simulator.workload: Zipf adapters, Poisson arrivals at --load of the cluster's
capacity) runs (a) through `simulate(trace, ClusterConfig(...), "ours")` and (b) through the app on a local Ray:
the ingress, AdapterAffinityRouter, the shared adapter tier over an S3 origin on SeaweedFS, and --replicas
replicas whose engines wait the replica model's time (cluster/simulator/emulated.py; bench/emulated_cluster.py runs it),
replayed open loop through the ingress's Python handle, streaming. Prints both side by side with the relative
error of each figure and the issue's targets (TTFT p50/p99 and throughput within 15%, load counts within 10%).

Time factor: the emulated cluster runs --time-factor times slower than modeled time, so that the real stack's own
costs (Serve's hops, Python on two cores) are small against the modeled ones. Its wall-clock settings enter the
simulator divided by the factor (routing-stats period, the router's pending TTL), and its times are reported
divided by it: every figure below is in modeled seconds. docs/simulator.md ("Fidelity") has what was measured.

    python bench/fidelity.py                  # 8 replicas, 300 adapters, Zipf 1.0, 65% load, 12 modeled s, x10
    python bench/fidelity.py --quick          # 3 replicas, a few seconds: that it runs
    python bench/fidelity.py --policies ours ray-multiplex --workload churn --load 0.9 --adapters 3000

With several --policies, each runs in both (the emulated "ray-multiplex" is Ray Serve's default router with
model multiplexing and per-replica origin downloads, as the simulator models it), and a last table sets the
simulator's ours / Ray ratios beside the emulated cluster's: the direction of the placement matrix
(bench/sim_matrix.py) checked on the real stack. --workload takes bench/sim_matrix.py's kinds.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.emulated_cluster import EmulatedCluster, emulated_summary, run_emulated, seaweedfs  # noqa: E402
from bench.sim_matrix import WORKLOADS  # noqa: E402
from cluster.simulator import SLO, ClusterConfig, ReplicaConfig, WorkloadConfig, generate, simulate  # noqa: E402

# (figure, its target: the largest relative error the issue accepts)
FIGURES = (("ttft_p50", 0.15), ("ttft_p99", 0.15), ("throughput", 0.15), ("tpot_p50", None),
           ("origin", 0.10), ("host_loads", 0.10), ("slot_loads", 0.10))


def sim_config(a, time_factor: float) -> ClusterConfig:
    """The simulator's view of the emulated cluster: one node (the tier's), the same engine limits, and the
    real stack's wall-clock knobs in modeled seconds."""
    return ClusterConfig(replicas=a.replicas, replicas_per_node=a.replicas,
                         replica=ReplicaConfig(max_loras=a.max_loras, max_cpu_loras=a.max_cpu_loras,
                                               max_num_seqs=a.max_num_seqs, max_num_batched_tokens=8192,
                                               max_ongoing=a.max_ongoing),
                         stats_period_s=a.stats_period / time_factor,
                         policy_kwargs={"pending_ttl_s": a.pending_ttl / time_factor})


# (figure, format) of the direction table: ours / Ray in the simulator and on the emulated cluster
DIRECTION = (("goodput", "{:.2f}"), ("slo", "{:.4f}"), ("ttft_p50", "{:.3f}"), ("ttft_p99", "{:.3f}"),
             ("origin", "{:.0f}"))


def workload(a, rate: float, duration: float) -> WorkloadConfig:
    """--workload's kind (bench/sim_matrix.py's: churn makes a new adapter hottest every quarter of the run); a
    burst's extra requests count in the rate, so that --load means the same request rate for every kind."""
    spec = dict(WORKLOADS[a.workload])
    churn = spec.pop("churn_quarters", False)
    per_arrival = 1 + spec.get("burst_prob", 0.0) * (spec.get("burst_len", 8) - 1)
    return WorkloadConfig(duration_s=duration, rate=rate / per_arrival, num_adapters=a.adapters, zipf_s=a.zipf,
                          prompt_median=a.prompt_median, output_median=a.output_median, seed=a.seed,
                          churn_every_s=duration / 4 if churn else 0.0, **spec)


def capacity(a) -> float:
    """Requests per modeled second the simulated cluster completes when overloaded (this workload's shape)."""
    cfg = sim_config(a, a.time_factor)
    trace = generate(WorkloadConfig(duration_s=10.0, rate=400.0 * a.replicas / 8, num_adapters=a.adapters,
                                    zipf_s=a.zipf, prompt_median=a.prompt_median, output_median=a.output_median,
                                    seed=a.seed))
    report = simulate(trace, cfg, "ours", seed=a.seed)
    return report.completed / (report.end_s - trace[0].arrival_s)


def sim_summary(report, trace) -> dict:
    s = report.summary()
    span = report.end_s - trace[0].arrival_s
    return {**s, "throughput": report.completed / span, "errors": report.requests - report.completed}


def rel(emu: float, sim: float) -> float:
    return (emu - sim) / sim if sim else (0.0 if emu == sim else math.inf)


def print_direction(sim: dict[str, dict], emu: dict[str, dict], base: str, other: str) -> None:
    print(f"{'figure':<10}{'sim ' + base:>12}{'sim ' + other:>18}{'ratio':>8}{'emu ' + base:>12}"
          f"{'emu ' + other:>18}{'ratio':>8}  same direction")
    for name, fmt in DIRECTION:
        rs, re_ = (d[base][name] / d[other][name] if d[other][name] else math.inf for d in (sim, emu))
        same = (rs > 1.02) == (re_ > 1.02) and (rs < 0.98) == (re_ < 0.98)  # within 2%: even
        print(f"{name:<10}{fmt.format(sim[base][name]):>12}{fmt.format(sim[other][name]):>18}{rs:>8.3f}"
              f"{fmt.format(emu[base][name]):>12}{fmt.format(emu[other][name]):>18}{re_:>8.3f}  "
              f"{'yes' if same else 'NO'}")


def print_table(sim: dict, emu: dict) -> None:
    print(f"{'figure':<12}{'simulator':>12}{'emulated':>12}{'rel err':>9}{'target':>8}")
    for name, target in FIGURES:
        e = rel(emu[name], sim[name])
        verdict = "" if target is None else ("MET" if abs(e) <= target else "MISSED")
        tgt = "-" if target is None else f"{target:.0%}"
        print(f"{name:<12}{sim[name]:>12.4f}{emu[name]:>12.4f}{e:>+9.1%}{tgt:>8}  {verdict}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="3 replicas, 40 adapters, 3 modeled s (that it runs)")
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--adapters", type=int, default=300)
    p.add_argument("--zipf", type=float, default=1.0)
    p.add_argument("--load", type=float, default=0.65, help="arrival rate as a share of the cluster's capacity")
    p.add_argument("--rate", type=float, help="arrival rate (req/s, modeled); default: --load x capacity")
    p.add_argument("--duration", type=float, default=12.0, help="modeled seconds of arrivals")
    p.add_argument("--time-factor", type=float, default=10.0, help="wall seconds per modeled second")
    p.add_argument("--prompt-median", type=int, default=256)
    p.add_argument("--output-median", type=int, default=128)
    p.add_argument("--max-loras", type=int, default=16)
    p.add_argument("--max-cpu-loras", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-ongoing", type=int, default=64, help="Serve max_ongoing_requests per replica")
    p.add_argument("--stats-period", type=float, default=1.0, help="routing-stats period (wall s)")
    p.add_argument("--pending-ttl", type=float, default=5.0, help="the router's pending_ttl_s (wall s)")
    p.add_argument("--policies", nargs="+", default=["ours"], choices=["ours", "ray-multiplex"])
    p.add_argument("--workload", default="iid", choices=sorted(WORKLOADS))
    p.add_argument("--slo-ttft", type=float, default=2.0, help="modeled s")
    p.add_argument("--slo-tpot", type=float, default=0.1, help="modeled s")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    if a.quick:
        a.replicas, a.adapters, a.duration = 3, 40, 3.0

    cap = capacity(a)
    rate = a.rate or a.load * cap
    trace = generate(workload(a, rate, a.duration))
    print(f"{a.replicas} replicas x (max_loras {a.max_loras}, max_cpu_loras {a.max_cpu_loras}, max_num_seqs "
          f"{a.max_num_seqs}, max_ongoing {a.max_ongoing}); {a.adapters} adapters, Zipf({a.zipf}); capacity "
          f"{cap:.1f} req/s, rate {rate:.1f} req/s ({rate / cap:.0%}); {len(trace)} requests over {a.duration:g} "
          f"modeled s; time factor {a.time_factor:g} (stats period {a.stats_period:g} s, pending TTL "
          f"{a.pending_ttl:g} s wall); seed {a.seed}", flush=True)

    sims, emus = {}, {}
    with seaweedfs(Path(tempfile.mkdtemp(prefix="lorafleet-fidelity-"))) as (endpoint, env):
        for policy in a.policies:
            cfg = dataclasses.replace(sim_config(a, a.time_factor), slo=SLO(a.slo_ttft, a.slo_tpot))
            sims[policy] = sim = sim_summary(simulate(trace, cfg, policy, seed=a.seed), trace)
            cluster = EmulatedCluster(
                replicas=a.replicas, engine=dict(max_loras=a.max_loras, max_cpu_loras=a.max_cpu_loras,
                                                 max_num_seqs=a.max_num_seqs, max_num_batched_tokens=8192),
                emulation=dict(time_factor=a.time_factor, max_ongoing=a.max_ongoing), stats_period_s=a.stats_period,
                router_kwargs={"pending_ttl_s": a.pending_ttl}, seed=a.seed, routing=policy)
            t0 = time.perf_counter()
            run = run_emulated(trace, cluster, endpoint, env, bucket=f"adapters-{policy}")
            emus[policy] = emu = emulated_summary(run, trace, SLO(a.slo_ttft, a.slo_tpot))
            print(f"\n{policy}: emulated run {run['wall_s']:.0f} s of trace ({time.perf_counter() - t0:.0f} s in all); "
                  f"{emu['errors']} errors; the replicas' clocks ran events {run['late_mean_s'] * 1e3:.1f} ms late "
                  f"on average, {run['late_max_s'] * 1e3:.0f} ms at worst (wall)", flush=True)
            for r in [r for r in run["results"] if r.get("error")][:3]:
                print(f"  error: {r['error']}")
            print_table(sim, emu)
            print(f"completed: simulator {sim['completed']}/{len(trace)}, emulated {emu['completed']}/{len(trace)}",
                  flush=True)
    if len(a.policies) == 2:
        print(f"\n{a.workload}, {rate / cap:.0%} load: {a.policies[0]} / {a.policies[1]}, simulator and emulated")
        print_direction(sims, emus, *a.policies)


if __name__ == "__main__":
    main()
