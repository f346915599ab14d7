"""`lorafleet-sim`: size a cluster from a trace. Prints the policy table at the trace's own rate, sweeps the
load (the trace's arrivals compressed or stretched to each share of the cluster's capacity) and writes plots.

    lorafleet-sim --trace my.csv --replicas 32 --gpu h100 --model-shape 8b
    lorafleet-sim --adapters 5000 --zipf 1.2 --rate 200 --duration 600 --replicas 16 --out sim-plots
    lorafleet-sim --trace my.csv --size 0.99      # also: the fewest replicas that meet the SLO for 99% of requests
    lorafleet-sim --trace my.csv --autoscale 1:8 --loads   # also: replicas coming and going (no sweep)

--autoscale MIN:MAX replays the trace with replicas added and removed between MIN and MAX, once under lorafleet's
adapter-aware policy (cluster.autoscaling) and once under Serve's request-count policy, and writes
replicas_over_time.png. docs/capacity.md walks through sizing a cluster with it.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from cluster.simulator.autoscale import AutoscaleConfig, FleetLog, adapter_aware_config, fleet_summary, parse_scaler
from cluster.simulator.calibration import ROWS, TierCosts, fit_table
from cluster.simulator.capacity import capacity_rps
from cluster.simulator.metrics import SLO, Report, table
from cluster.simulator.replica import ReplicaConfig
from cluster.simulator.sim import ClusterConfig, run, simulate, step_model
from cluster.simulator.workload import Request, WorkloadConfig, generate, read_trace, write_trace

POLICIES = ("ours", "ray-multiplex", "pow2", "random")


class SimUsageError(ValueError):
    """A command-line choice the simulator cannot honour (an unknown GPU or model shape, a bad load)."""


def calibration_name(gpu: str, model_shape: str) -> str:
    """The calibration table for a GPU and model shape, e.g. ('h100', '8b') -> 'h100-llama3-8b'."""
    name = f"{gpu.lower()}-llama3-{model_shape.lower()}"
    if name not in ROWS:
        shapes = sorted(ROWS)
        raise SimUsageError(f"no calibration for --gpu {gpu} --model-shape {model_shape}; measured: {shapes} "
                            "(bench/engine.py rows in bench/RESULTS.md)")
    return name


def at_rate(trace: list[Request], rps: float) -> list[Request]:
    """The same requests with their arrival times scaled so the trace runs at `rps` requests per second."""
    if len(trace) < 2 or rps <= 0:
        raise SimUsageError("scaling a trace needs at least two requests and a positive rate")
    span = trace[-1].arrival_s - trace[0].arrival_s
    if span <= 0:
        raise SimUsageError("the trace's requests all arrive at once: it has no rate to scale")
    factor = (len(trace) / span) / rps
    t0 = trace[0].arrival_s
    return [replace(r, arrival_s=(r.arrival_s - t0) * factor) for r in trace]


def size_cluster(trace: list[Request], cfg: ClusterConfig, attainment: float, policy: str = "ours",
                 seed: int = 0, limit: int = 4096) -> tuple[int, dict]:
    """The fewest replicas whose SLO attainment on `trace` under `policy` reaches `attainment`: doubling,
    then bisection (attainment grows with replicas on a fixed trace, up to the simulator's noise)."""
    def ok(n: int) -> tuple[bool, dict]:
        s = simulate(trace, replace(cfg, replicas=n), policy, seed).summary()
        return s["slo"] >= attainment, s

    lo, hi = 0, 1
    good, best = ok(hi)
    while not good:
        lo, hi = hi, hi * 2
        if hi > limit:
            raise SimUsageError(f"{limit} replicas do not reach {attainment:.1%} SLO attainment on this trace")
        good, best = ok(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        good, s = ok(mid)
        if good:
            hi, best = mid, s
        else:
            lo = mid
    return hi, best


def load_sweep(trace: list[Request], cfg: ClusterConfig, loads: list[float], policies: list[str],
               seed: int = 0) -> tuple[float, dict[str, list[dict]]]:
    """Each policy's summary at each load (a share of the cluster's capacity on this trace's requests)."""
    cap = capacity_rps(cfg.replicas, step_model(cfg.gpu), cfg.replica, trace)
    out: dict[str, list[dict]] = {p: [] for p in (*policies, "bound")}
    for load in loads:
        scaled = at_rate(trace, load * cap)
        for p in out:
            out[p].append({"load": load, **simulate(scaled, cfg, p, seed).summary()})
    return cap, out


def parse_bounds(text: str) -> tuple[int, int]:
    """--autoscale's MIN:MAX."""
    lo, sep, hi = text.partition(":")
    try:
        bounds = (int(lo), int(hi)) if sep else None
    except ValueError:
        bounds = None
    if bounds is None or not 0 <= bounds[0] <= bounds[1] or bounds[1] < 1:
        raise SimUsageError(f"--autoscale wants MIN:MAX with 0 <= MIN <= MAX and MAX >= 1, got {text!r}")
    return bounds


def autoscaled(trace: list[Request], cfg: ClusterConfig, lo: int, hi: int, *, serve_target: float,
               initial: int | None = None, startup_s: float = 60.0, scaler: dict | None = None,
               serve_delays: tuple[float, float] = (30.0, 600.0), look_back_s: float = 30.0,
               seed: int = 0) -> dict[str, tuple[Report, FleetLog]]:
    """The trace with replicas coming and going between `lo` and `hi`, behind the adapter-affinity router: under
    the adapter-aware policy as deployed (`scaler`: its policy_kwargs), and under Serve's request count at
    `serve_target` ongoing requests per replica with Serve's delays. Keyed by the row's name."""
    common = dict(min_replicas=lo, max_replicas=hi, initial_replicas=initial, startup_s=startup_s,
                  look_back_period_s=look_back_s)
    up, down = serve_delays
    configs = {"adapter-aware": adapter_aware_config(scaler=dict(scaler or {}), **common),
               f"serve target={serve_target:g}": AutoscaleConfig(policy="serve", target_ongoing_requests=serve_target,
                                                                 upscale_delay_s=up, downscale_delay_s=down,
                                                                 **common)}
    return {name: run(trace, replace(cfg, autoscaling=auto), "ours", seed) for name, auto in configs.items()}


AUTOSCALE_COLUMNS = [("policy", "{:<20}", 20), ("slo", "{:>7.4f}", 7), ("goodput", "{:>8.2f}", 8),
                     ("ttft_p99", "{:>9.3f}", 9), ("replica_h", "{:>9.2f}", 9), ("peak", "{:>5}", 5),
                     ("changes", "{:>7}", 7), ("lost", "{:>5}", 5)]


def autoscaling_yaml(lo: int, hi: int, initial: int, look_back_s: float, scaler: dict, max_num_seqs: int) -> str:
    """The adapter-aware run's settings as deploy/config.gpu.yaml's replica.autoscaling_config."""
    # The simulated replicas report max_num_seqs; the deployment's engine may report more, so it is pinned here.
    kwargs = ", ".join(f"{k}: {v:g}" for k, v in {"max_num_seqs": max_num_seqs, **scaler}.items())
    return "\n".join([
        "autoscaling_config:", f"  min_replicas: {lo}", f"  initial_replicas: {initial}",
        f"  max_replicas: {hi}", "  upscale_delay_s: 0", "  downscale_delay_s: 0",
        f"  look_back_period_s: {look_back_s:g}", "  policy:",
        "    policy_function: cluster.autoscaling:AdapterAwarePolicy", f"    policy_kwargs: {{{kwargs}}}"])


def arrival_rate(trace: list[Request], bins: int = 60) -> list[tuple[float, float]]:
    """Requests per second in `bins` equal slices of the trace: (slice middle, rate)."""
    t0, t1 = trace[0].arrival_s, trace[-1].arrival_s
    width = (t1 - t0) / bins
    if width <= 0:
        return []
    counts = [0] * bins
    for r in trace:
        counts[min(bins - 1, int((r.arrival_s - t0) / width))] += 1
    return [(t0 + (i + 0.5) * width, c / width) for i, c in enumerate(counts)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="lorafleet-sim", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_argument_group("workload (a trace, or a generated one)")
    src.add_argument("--trace", help="CSV: arrival_s,adapter,prompt_tokens,output_tokens[,rank]")
    src.add_argument("--adapters", type=int, default=1000)
    src.add_argument("--zipf", type=float, default=1.0)
    src.add_argument("--rate", type=float, default=50.0, help="mean requests per second")
    src.add_argument("--duration", type=float, default=300.0, help="simulated seconds of arrivals")
    src.add_argument("--burst", type=float, default=0.0, help="chance an arrival starts a tenant burst")
    src.add_argument("--churn", type=float, default=0.0, help="seconds between new hot adapters (0: none)")
    src.add_argument("--diurnal", type=float, default=0.0,
                     help="rate x (1 + a sin(2 pi t / duration)): one day's swing over the run (0: flat)")
    src.add_argument("--write-trace", help="write the generated workload here")
    cl = p.add_argument_group("cluster")
    cl.add_argument("--replicas", type=int, default=8)
    cl.add_argument("--replicas-per-node", type=int, default=8)
    cl.add_argument("--gpu", default="h100", help="h100 or h200")
    cl.add_argument("--model-shape", default="8b")
    cl.add_argument("--max-loras", type=int, default=16)
    cl.add_argument("--max-cpu-loras", type=int, default=32)
    cl.add_argument("--max-num-seqs", type=int, default=32)
    cl.add_argument("--max-ongoing", type=int, default=64)
    cl.add_argument("--tier-gb", type=float, default=64.0, help="the shared tier's object-store GiB")
    cl.add_argument("--origin-latency", type=float, default=0.2, help="s per origin download")
    cl.add_argument("--origin-gbps", type=float, default=1.0, help="origin bandwidth, GB/s")
    out = p.add_argument_group("output")
    out.add_argument("--slo-ttft", type=float, default=2.0)
    out.add_argument("--slo-tpot", type=float, default=0.1)
    out.add_argument("--policies", default=",".join(POLICIES))
    out.add_argument("--loads", type=float, nargs="*", default=[0.3, 0.5, 0.7, 0.8, 0.9, 1.0, 1.1],
                     help="shares of capacity for the sweep (none given: no sweep)")
    out.add_argument("--out", default="sim-plots", help="folder for the PNGs")
    out.add_argument("--no-plots", action="store_true")
    out.add_argument("--size", type=float, help="also find the fewest replicas reaching this SLO attainment")
    out.add_argument("--seed", type=int, default=0)
    au = p.add_argument_group("autoscaling (docs/deployment.md#autoscaling)")
    au.add_argument("--autoscale", metavar="MIN:MAX",
                    help="also replay the trace with replicas coming and going between MIN and MAX")
    au.add_argument("--initial-replicas", type=int, help="replicas when the trace starts (default: MIN)")
    au.add_argument("--startup-s", type=float, default=60.0,
                    help="s from a replica asked for to serving: model load, kernels, graphs")
    au.add_argument("--scaler", default="", help="AdapterAwarePolicy's policy_kwargs, key=value,key=value")
    au.add_argument("--serve-target", type=float,
                    help="Serve's target_ongoing_requests (default: half of --max-ongoing, as build_app sets it)")
    au.add_argument("--serve-delays", type=float, nargs=2, default=[30.0, 600.0], metavar=("UP", "DOWN"),
                    help="Serve's upscale_delay_s and downscale_delay_s for its own policy (its defaults: 30 600)")
    au.add_argument("--look-back", type=float, default=30.0, help="Serve's look_back_period_s (both policies)")
    a = p.parse_args(argv)
    try:
        return _run(a)
    except (SimUsageError, ValueError, OSError) as exc:
        print(f"lorafleet-sim: error: {exc}", file=sys.stderr)
        return 2


def _run(a: argparse.Namespace) -> int:
    gpu = calibration_name(a.gpu, a.model_shape)
    policies = [x for x in a.policies.split(",") if x]
    unknown = sorted(set(policies) - set(POLICIES))
    if unknown:
        raise SimUsageError(f"unknown policies {unknown}; choose from {list(POLICIES)}")
    if any(load <= 0 for load in a.loads):
        raise SimUsageError("every --loads share must be > 0")
    bounds = parse_bounds(a.autoscale) if a.autoscale else None
    if bounds and a.initial_replicas is not None and not bounds[0] <= a.initial_replicas <= bounds[1]:
        raise SimUsageError(f"--initial-replicas {a.initial_replicas} lies outside --autoscale {a.autoscale}")
    if (a.serve_target is not None and a.serve_target <= 0) or a.startup_s < 0 or a.look_back <= 0:
        raise SimUsageError("--serve-target and --look-back must be > 0, --startup-s >= 0")
    scaler = parse_scaler(a.scaler)
    cfg = ClusterConfig(replicas=a.replicas, replicas_per_node=a.replicas_per_node, gpu=gpu,
                        replica=ReplicaConfig(max_loras=a.max_loras, max_cpu_loras=a.max_cpu_loras,
                                              max_num_seqs=a.max_num_seqs, max_ongoing=a.max_ongoing),
                        costs=TierCosts(origin_latency_s=a.origin_latency, origin_bw=a.origin_gbps * 1e9),
                        tier_capacity_bytes=int(a.tier_gb * 2**30), slo=SLO(a.slo_ttft, a.slo_tpot))
    if a.trace:
        trace = read_trace(a.trace)
        if not trace:
            raise SimUsageError(f"trace {a.trace} has no requests")
    else:
        trace = generate(WorkloadConfig(duration_s=a.duration, rate=a.rate, num_adapters=a.adapters, zipf_s=a.zipf,
                                        burst_prob=a.burst, churn_every_s=a.churn, diurnal_amplitude=a.diurnal,
                                        diurnal_period_s=a.duration, seed=a.seed))
        if a.write_trace:
            write_trace(trace, a.write_trace)
    print(fit_table(gpu), "\n")
    span = trace[-1].arrival_s - trace[0].arrival_s
    cap = capacity_rps(a.replicas, step_model(gpu), cfg.replica, trace)
    rate = len(trace) / span if span > 0 else float("nan")
    print(f"{len(trace)} requests over {span:.0f} s ({rate:.1f} req/s), "
          f"{len({r.adapter for r in trace if r.adapter})} distinct adapters; {a.replicas} replicas of {gpu}: "
          f"capacity ~{cap:.1f} req/s on these requests, so the trace runs at {rate / cap:.0%} of it")
    rows = [simulate(trace, cfg, pol, a.seed).summary() for pol in (*policies, "bound")]
    print(table(rows))
    if a.size:
        n, s = size_cluster(trace, cfg, a.size, seed=a.seed)
        print(f"\nsize: {n} replicas reach {s['slo']:.2%} SLO attainment (target {a.size:.2%}); "
              f"TTFT p99 {s['ttft_p99']:.2f} s, {s['replica_h']:.1f} replica-hours")
    if a.loads and len(trace) >= 2 and span > 0:
        cap, sweep = load_sweep(trace, cfg, sorted(a.loads), policies, a.seed)
        print(f"\nload sweep (share of ~{cap:.1f} req/s):")
        print("policy          " + " ".join(f"{x['load']:>14.0%}" for x in sweep["bound"]))
        for pol, pts in sweep.items():
            print(f"{pol:<15} " + " ".join(f"{x['goodput']:>7.1f}/{x['ttft_p99']:>6.2f}" for x in pts))
        print("(each cell: goodput req/s / TTFT p99 s)")
        if not a.no_plots:
            from cluster.simulator.plots import plot_load_sweep
            path = plot_load_sweep(sweep, cap, Path(a.out) / "load_sweep.png",
                                   title=f"{a.replicas} x {gpu}, {len(trace)} requests", slo_ttft=a.slo_ttft)
            print(f"wrote {path}")
    if bounds:
        _autoscale(a, trace, cfg, bounds, scaler, next((r for r in rows if r["policy"] == "ours"), None))
    return 0


def _autoscale(a: argparse.Namespace, trace: list[Request], cfg: ClusterConfig, bounds: tuple[int, int],
               scaler: dict, fixed: dict | None) -> None:
    lo, hi = bounds
    initial = lo if a.initial_replicas is None else a.initial_replicas
    target = a.serve_target if a.serve_target is not None else max(1, a.max_ongoing // 2)
    runs = autoscaled(trace, cfg, lo, hi, initial=initial, startup_s=a.startup_s, scaler=scaler,
                      serve_target=target, serve_delays=tuple(a.serve_delays), look_back_s=a.look_back, seed=a.seed)
    rows = [{**fleet_summary(report, log), "policy": name} for name, (report, log) in runs.items()]
    if fixed is not None:  # the policy table's run, for the cost of not scaling
        rows.append({**fixed, "policy": f"fixed {a.replicas}", "peak": a.replicas, "changes": 0,
                     "lost": fixed["requests"] - fixed["completed"]})
    up, down = a.serve_delays
    print(f"\nautoscaling {lo}..{hi} replicas (initial {initial}), start-up {a.startup_s:g} s, behind the "
          f"adapter-affinity router; Serve's delays {up:g} / {down:g} s for its own policy:")
    print(table(rows, AUTOSCALE_COLUMNS))
    print("(slo: share meeting the SLO; goodput: req/s meeting it; replica_h: live replicas integrated, starting and "
          "draining included; lost: requests never answered)")
    print("\nthe adapter-aware run's settings, for replica: in deploy/config.gpu.yaml:")
    print(autoscaling_yaml(lo, hi, initial, a.look_back, scaler, a.max_num_seqs))
    if not a.no_plots:
        from cluster.simulator.plots import plot_replicas_over_time
        # each step line runs on to the end of its run
        series = {name: [*log.changes, (max(report.end_s, log.changes[-1][0]), log.changes[-1][1])]
                  for name, (report, log) in runs.items()}
        path = plot_replicas_over_time(series, Path(a.out) / "replicas_over_time.png", rate=arrival_rate(trace),
                                       title=f"{lo}..{hi} x {cfg.gpu}, {len(trace)} requests")
        print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
