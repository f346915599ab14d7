"""Autoscaling in the cluster simulator: the adapter-aware policy against Serve's request-count policy.

    python bench/autoscale.py                      # 1 simulated hour, one diurnal cycle, a new hot adapter every 2 min
    python bench/autoscale.py --duration 7200 --rate 60 --targets 8 12 16 24
    python bench/autoscale.py --serve-delays 0 180 # Serve's policy with the adapter-aware policy's delays too

Both policies run in cluster/simulator/autoscale.py's model of Serve's controller (the same metrics pipeline,
delay logic, replica start-up and drain) with the adapter-affinity router, on one generated trace: a diurnal
rate curve (`--diurnal` amplitude over one `--duration` period) and churn (`--churn`). Serve's policy is run at
each `--targets` value of target_ongoing_requests. One row each: SLO attainment, TTFT p99, replica-hours (the
live replica count integrated: starting, running and draining), peak replicas, scale changes and lost requests;
then ours against the cheapest Serve row that reaches ours' attainment (or the best Serve row, if none does).
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster.simulator import ClusterConfig, ReplicaConfig, SLO, WorkloadConfig, generate  # noqa: E402
from cluster.simulator.autoscale import (AutoscaleConfig, adapter_aware_config, fleet_summary,  # noqa: E402
                                         parse_scaler)
from cluster.simulator.fleet_bound import diurnal_rate, fleet_bound  # noqa: E402
from cluster.simulator.sim import run  # noqa: E402

HEAD = (f"{'policy':<24} {'slo':>7} {'ttft_p99':>9} {'replica_h':>9} {'peak':>5} {'changes':>7} {'lost':>5} "
        f"{'wall_s':>6}")


def row(name: str, report, log, wall: float) -> dict:
    return dict(fleet_summary(report, log), name=name, wall=wall)


def fmt(r: dict) -> str:
    return (f"{r['name']:<24} {r['slo']:>7.4f} {r['ttft_p99']:>9.3f} {r['replica_h']:>9.2f} {r['peak']:>5} "
            f"{r['changes']:>7} {r['lost']:>5} {r['wall']:>6.1f}")


def simulate(job: tuple) -> dict:
    """One row: the trace generated afresh in this process (generate is deterministic per seed)."""
    name, auto, workload, cluster, seed = job
    start = time.perf_counter()
    report, log = run(generate(workload), replace(cluster, autoscaling=auto), "ours", seed)
    return row(name, report, log, time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=3600.0, help="simulated seconds: one diurnal period")
    p.add_argument("--rate", type=float, default=40.0, help="mean requests per second")
    p.add_argument("--diurnal", type=float, default=0.7, help="rate x (1 + a sin(2 pi t / duration))")
    p.add_argument("--churn", type=float, default=120.0, help="seconds between new hot adapters")
    p.add_argument("--adapters", type=int, default=2000)
    p.add_argument("--zipf", type=float, default=1.0)
    p.add_argument("--max-loras", type=int, default=16)
    p.add_argument("--max-cpu-loras", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-ongoing", type=int, default=64)
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument("--max-replicas", type=int, default=16)
    p.add_argument("--initial-replicas", type=int, default=4)
    p.add_argument("--startup", type=float, default=60.0, help="s from asked for to serving")
    p.add_argument("--look-back", type=float, default=30.0, help="Serve's look_back_period_s (both policies)")
    p.add_argument("--metrics-interval", type=float, default=10.0, help="Serve's metrics push period (both)")
    p.add_argument("--targets", type=float, nargs="+", default=[8, 10, 12, 13, 14, 15, 16, 20, 24],
                   help="Serve's target_ongoing_requests values to run")
    p.add_argument("--serve-delays", type=float, nargs=2, default=[30.0, 600.0], metavar=("UP", "DOWN"),
                   help="Serve's upscale_delay_s, downscale_delay_s (its defaults: 30 600)")
    p.add_argument("--scaler", default="", help="AutoscalerConfig overrides, k=v,k=v (the policy_kwargs)")
    p.add_argument("--slo-ttft", type=float, default=2.0)
    p.add_argument("--slo-tpot", type=float, default=0.1)
    p.add_argument("--bound", type=float, default=0.9999,
                   help="also the clairvoyant fleet's replica-hours at this attainment (fleet_bound.py; 0: skip)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=1, help="rows simulated at once (processes)")
    a = p.parse_args()

    workload = WorkloadConfig(duration_s=a.duration, rate=a.rate, num_adapters=a.adapters, zipf_s=a.zipf,
                              diurnal_amplitude=a.diurnal, diurnal_period_s=a.duration, churn_every_s=a.churn,
                              seed=a.seed)
    trace = generate(workload)  # the header's count; each row generates the same trace in its own process
    replica = ReplicaConfig(max_loras=a.max_loras, max_cpu_loras=a.max_cpu_loras, max_num_seqs=a.max_num_seqs,
                            max_ongoing=a.max_ongoing)
    scaler = parse_scaler(a.scaler)
    common = dict(min_replicas=a.min_replicas, max_replicas=a.max_replicas, initial_replicas=a.initial_replicas,
                  startup_s=a.startup, look_back_period_s=a.look_back, metrics_interval_s=a.metrics_interval)
    print(f"trace: {len(trace)} requests over {a.duration:.0f} s, rate {a.rate} x (1 + {a.diurnal} sin), "
          f"{a.adapters} adapters zipf {a.zipf}, a new hot adapter every {a.churn:.0f} s; replicas "
          f"{a.min_replicas}..{a.max_replicas} (initial {a.initial_replicas}), start-up {a.startup:.0f} s, "
          f"max_loras {a.max_loras}, max_cpu_loras {a.max_cpu_loras}, max_num_seqs {a.max_num_seqs}, "
          f"max_ongoing {a.max_ongoing}; SLO TTFT <= {a.slo_ttft} s, TPOT <= {a.slo_tpot} s; seed {a.seed}")

    cluster = ClusterConfig(replica=replica, slo=SLO(a.slo_ttft, a.slo_tpot))
    up, down = a.serve_delays
    runs = [("adapter-aware", adapter_aware_config(scaler=scaler, **common))]
    runs += [(f"serve target={t:g}", AutoscaleConfig(policy="serve", target_ongoing_requests=t, upscale_delay_s=up,
                                                      downscale_delay_s=down, **common)) for t in a.targets]
    print(HEAD)
    with ProcessPoolExecutor(max(1, a.jobs)) as pool:
        rows = []
        for r in pool.map(simulate, [(name, auto, workload, cluster, a.seed) for name, auto in runs]):
            print(fmt(r), flush=True)
            rows.append(r)
    ours, serve = rows[0], rows[1:]
    reached = [r for r in serve if r["slo"] >= ours["slo"]]
    if reached:
        ref = min(reached, key=lambda r: r["replica_h"])
        print(f"\ncheapest Serve row at >= ours' attainment: {ref['name']} ({ref['slo']:.4f}); ours "
              f"{ours['slo']:.4f} at {ours['replica_h']:.2f} replica-h = {ours['replica_h'] / ref['replica_h']:.3f} x "
              f"its {ref['replica_h']:.2f}")
    else:
        best = max(serve, key=lambda r: r["slo"])
        print(f"\nno Serve row reaches ours' attainment ({ours['slo']:.4f}); the best, {best['name']}, has "
              f"{best['slo']:.4f} at {best['replica_h']:.2f} replica-h; ours uses "
              f"{ours['replica_h'] / best['replica_h']:.3f} x that")
        ref = best
    if a.bound:
        b = fleet_bound(diurnal_rate(workload), a.duration, workload, cluster, a.bound, a.max_replicas, seed=a.seed,
                        startup_s=a.startup, initial=a.initial_replicas)
        rates = ", ".join(f"{n}: {r:.1f}" for n, r in b.rates.items())
        print(f"clairvoyant fleet at {a.bound:.4f} attainment (sustainable req/s by fleet size {rates}): "
              f"{b.replica_h:.2f} replica-h; {b.replica_h_started:.2f} with its replicas' {a.startup:.0f} s start-up")
        for bound_h, what in ((b.replica_h, "the bound"), (b.replica_h_started, "the bound with start-up")):
            print(f"  against {what}: ours {ours['replica_h'] / bound_h:.3f} x (reaches "
                  f"{bound_h / ours['replica_h']:.3f} of it), {ref['name']} {ref['replica_h'] / bound_h:.3f} x; "
                  f"the target, 0.8 x {ref['name']}, is {0.8 * ref['replica_h'] / bound_h:.3f} x (below 1: beyond "
                  f"any autoscaler)")


if __name__ == "__main__":
    main()
