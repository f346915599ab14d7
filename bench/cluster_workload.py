"""bench/cluster.py's workload, driver and report: adapters, Zipf requests, closed-loop clients, one
router's measurement, the table.

Runs in the driver process only; the instrumented replicas and the random router stay in
bench/cluster.py, whose classes Serve ships to the replica actors by value.
"""

from __future__ import annotations

import asyncio
import math
import random
import shutil
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

import ray

from cluster.server import GenerateRequest

BASE_MODEL = "lorafleet-demo"
PROMPTS = ("The quick brown fox", "SELECT name FROM users WHERE", "Summarize the report:",
           "def add(a, b):", "Translate to French: good morning", "Once upon a time")


# ---- workload -----------------------------------------------------------------------------------


def make_adapters(root: Path, count: int) -> dict[str, str]:
    """count copies of the demo adapters under distinct names in root: name -> directory."""
    from replicas.demo_checkpoint import ensure_demo_checkpoint

    demo = ensure_demo_checkpoint()
    sources = [demo.adapters[name] for name in sorted(demo.adapters)]
    adapters = {}
    for i in range(count):
        dest = root / f"bench-{i:03d}"
        if not dest.exists():
            shutil.copytree(sources[i % len(sources)], dest)
        adapters[dest.name] = str(dest)
    return adapters


def zipf_requests(names: list[str], n: int, s: float, max_tokens: int, seed: int,
                  burst: int = 1) -> list[GenerateRequest]:
    """n requests; every `burst` consecutive ones name one adapter drawn by Zipf(s) (burst 1: i.i.d.).

    The closed-loop clients take requests in this order, so a burst's requests go out together
    and are in flight at once, interleaved with the neighbouring bursts of other adapters.
    """
    if burst < 1:
        raise ValueError(f"burst must be >= 1, got {burst}")
    rng = random.Random(seed)
    ranked = list(names)
    rng.shuffle(ranked)  # popularity rank -> adapter, so the hot ones are not all copies of one demo adapter
    weights = [1.0 / (k + 1) ** s for k in range(len(ranked))]
    tenants = rng.choices(ranked, weights=weights, k=-(-n // burst))
    picks = [a for a in tenants for _ in range(burst)][:n]  # burst 1 draws exactly the i.i.d. sequence
    return [GenerateRequest(model=a, sampling=dict(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                            prompt=rng.choice(PROMPTS), request_id=f"bench-{i}") for i, a in enumerate(picks)]


def top_share(requests: list[GenerateRequest], k: int) -> float:
    """Share of the requests for the k most requested adapters: the slot hit rate of a placement that
    kept exactly those in the k GPU slots and never had to load another."""
    counts = Counter(r.model for r in requests)
    return sum(n for _, n in counts.most_common(k)) / max(1, len(requests))


async def closed_loop(handle, requests: list[GenerateRequest], clients: int, multiplexed: bool
                      ) -> tuple[list[dict], list[float], float]:
    results: list[dict | None] = [None] * len(requests)
    latencies: list[float] = [0.0] * len(requests)
    next_index = iter(range(len(requests)))

    async def client() -> None:
        for i in next_index:
            req = requests[i]
            h = handle.options(multiplexed_model_id=req.model) if multiplexed and req.model != BASE_MODEL else handle
            t0 = time.perf_counter()
            results[i] = await h.run.remote(req)
            latencies[i] = time.perf_counter() - t0

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return results, latencies, time.perf_counter() - t0


def find_actor(name: str):
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["name"] == name:
            return ray.get_actor(name, namespace=entry["namespace"])
    raise RuntimeError(f"no actor named {name!r}")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


# ---- one router's measurement -------------------------------------------------------------------


def tier_name(router: str) -> str:
    return f"lorafleet-bench-tier-{router}"


def run_router(router: str, handle, args, adapters: dict[str, str], requests: list[GenerateRequest],
               warmup: list[GenerateRequest]) -> dict[str, Any]:
    """Register the adapters with the router's tier, warm up on the base model, run the timed loop."""
    t0 = time.perf_counter()
    tier_actor = find_actor(tier_name(router))
    ray.get([tier_actor.register.remote(name, path) for name, path in adapters.items()])  # no fetch yet
    asyncio.run(closed_loop(handle, warmup, args.clients, False))  # base model: every replica started
    before = ray.get(tier_actor.metrics.remote())
    decisions_before = affinity_decisions()
    setup_s = time.perf_counter() - t0
    results, latencies, wall = asyncio.run(closed_loop(handle, requests, args.clients, router == "default"))
    after = ray.get(tier_actor.metrics.remote())
    decisions = affinity_decisions() - decisions_before if router == "ours" else Counter()

    counts: dict[str, Counter] = {}
    for r in results:  # each answer carries its replica's running counters
        c = counts.setdefault(r["replica"], Counter())
        for key, value in r["counts"].items():
            c[key] = max(c[key], value)
    per_replica = Counter(r["replica"] for r in results)
    holders: dict[str, set] = {}
    for r in results:
        holders.setdefault(r["adapter"], set()).add(r["replica"])
    return dict(
        router=router, requests=len(results), adapters=len(adapters),
        distinct=len({r.model for r in requests}),
        slot_hit=sum(r["slot_hit"] for r in results) / len(results),
        slot_loads=sum(c["slot_loads"] for c in counts.values()),
        engine_loads=sum(c["engine_loads"] for c in counts.values()),
        origin_fetches=after["origin_fetches"] - before["origin_fetches"],
        tier_hits=after["hits"] - before["hits"],
        replicas_per_adapter=statistics.mean(len(v) for v in holders.values()),
        max_replica_share=max(per_replica.values()) / len(results),
        p50_ms=1e3 * pct(latencies, 0.50), p99_ms=1e3 * pct(latencies, 0.99),
        req_per_s=len(results) / wall, wall_s=wall, setup_s=setup_s,
        decisions=" ".join(f"{k}:{v}" for k, v in sorted(decisions.items()) if v))


def affinity_decisions() -> Counter:
    """Decision counts of the AdapterAffinityRouter(s) in this process (Serve routes in the caller's process)."""
    import gc

    from cluster.router import AdapterAffinityRouter

    total: Counter = Counter()
    for obj in gc.get_objects():
        if isinstance(obj, AdapterAffinityRouter):
            total.update(obj.decisions)
    return total

# ---- report -------------------------------------------------------------------------------------

COLUMNS = (("router", "{:8}", 8), ("requests", "{:>6d}", 6), ("distinct", "{:>5d}", 5), ("slot_hit", "{:>9.3f}", 9),
           ("slot_loads", "{:>8d}", 8), ("engine_loads", "{:>7d}", 7), ("origin_fetches", "{:>8d}", 8),
           ("replicas_per_adapter", "{:>8.2f}", 8), ("max_replica_share", "{:>7.2f}", 7),
           ("p50_ms", "{:>9.1f}", 9), ("p99_ms", "{:>9.1f}", 9), ("req_per_s", "{:>8.1f}", 8))
HEADERS = ("router", "reqs", "dist", "slot hit", "slot ld", "eng ld", "fetches", "rep/ad", "max sh", "p50 ms",
           "p99 ms", "req/s")


def print_table(rows: list[dict]) -> None:
    print("".join(f"{h:<{w}}" if i == 0 else f"{h:>{w}}" for i, (h, (_, _, w)) in enumerate(zip(HEADERS, COLUMNS))))
    for row in rows:
        print("".join(fmt.format(row[key]) for key, fmt, _ in COLUMNS), flush=True)


def ratio(a: float, b: float) -> float:
    return a / b if b else (math.inf if a else 1.0)
