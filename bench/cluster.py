"""Adapter-affinity routing against Ray Serve's own routers, side by side in one run (CPU, demo model).

Workload: N requests over A registered adapters (copies of the demo adapters under
distinct names, in a local directory under an allowed root, registered with the
shared adapter tier without fetching), adapter popularity Zipf(s) in a seeded
random order; C clients in a closed loop (each sends its next request when its
previous one returns). Two workloads over the same popularity:

  i.i.d. (--burst 1, the default) -- each request's adapter drawn independently;
  bursty (--burst K)              -- tenants send bursts: every K consecutive requests name one
              adapter drawn by Zipf(s) (a batch job, an agent's fan-out, a chat session's turns).
              The clients take requests in order, so a burst's K requests go out within moments of
              each other and are in flight together, interleaved with other tenants' bursts; the
              requests' adapter shares stay Zipf(s), and the load (C requests in flight) is the same.

3 replicas with a GPU's handful of slots each (max_loras GPU slots, 4 by default; max_cpu_loras host
LRU entries, 8), far fewer than adapters. The same requests, in the same order, go to:

  ours     -- cluster.router.AdapterAffinityRouter (the app's router);
  default  -- Ray Serve's default router with model multiplexing: the replica loads
              adapters through @serve.multiplexed(max_num_models_per_replica=--mux-models,
              default max_loras) and the caller sets handle.options(multiplexed_model_id=adapter),
              Serve's built-in model affinity;
  random   -- a RequestRouter that picks a replica uniformly at random.

Each router gets its own deployment and its own adapter tier (a fresh cache and fetch count); the three
apps start together and are measured one after another (the others sit idle meanwhile). Per router:
  slot hit  -- share of requests whose adapter held a GPU slot of the serving replica
               when the request arrived there (checked in the replica, before it loads anything);
  slot ld   -- adapter writes into GPU slots (LoRAModelManager.activate_adapter filling a slot);
  eng ld    -- adapter loads from disk into an engine's host cache (first use on a replica, and
               reloads after the host LRU dropped it);
  fetches   -- origin fetches of the tier (its metrics), against dist, the distinct adapters requested;
  rep/ad    -- replicas that served an adapter, averaged over adapters; max sh: the busiest replica's
               share of the requests;
  p50/p99   -- client-side latency of a request (ms); req/s over the timed loop.
Our router's decision counts (gpu_hit, pending, host_hit, spread, cold) are printed below the table.
The measurement lives in a bench-only subclass of the replica deployment (cluster code is unchanged);
where LoRAServer has no per-adapter load lock of its own, that subclass serializes concurrent first loads
of one adapter on a replica (see BenchReplica._serialize_adapter_loads; --no-load-lock shows the race).
Prints a table, ratios ours/default and ours/random and the targets (origin fetches == distinct
adapters requested; slot hit rate >= 1.5 x Ray's default), and writes CSV to $OUT (or bench/out).

The workload, the driver and the table live in bench/cluster_workload.py.

Emulated GPU replicas (the same app over an S3 origin, engines that wait the modeled time) are in
bench/emulated_cluster.py.

    python bench/cluster.py [--quick] [--burst K] [--router-kwargs JSON]
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import random
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import ray  # noqa: E402
from ray import serve  # noqa: E402
from ray.serve.config import RequestRouterConfig  # noqa: E402
from ray.serve.request_router import RequestRouter  # noqa: E402

from cluster.deployments import LoRAReplica  # noqa: E402
from cluster.server import GenerateRequest  # noqa: E402
from bench.cluster_workload import (BASE_MODEL, make_adapters, print_table, ratio, run_router,  # noqa: E402
                                    tier_name, top_share, zipf_requests)

ROUTERS = ("ours", "default", "random")


# ---- the replica, instrumented ----------------------------------------------------------------


class BenchReplica(LoRAReplica):
    """LoRAReplica plus counters: GPU-slot hits at arrival, slot writes, engine (host-cache) loads."""

    def __init__(self, server: dict[str, Any], tier: dict[str, Any], serialize_loads: bool = True) -> None:
        super().__init__(server, tier)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.counts: Counter[str] = Counter()
        runner = self.server.engine.engine.executor.runner  # one rank (UniProcExecutor) in this bench
        self._manager = manager = runner.lora_manager
        load, activate = runner.loads.load, manager.activate_adapter

        def counted_load(request):
            self.counts["engine_loads"] += 1
            return load(request)

        def counted_activate(lora_id, *args, **kwargs):
            if manager.slot_of(lora_id) is None:
                self.counts["slot_loads"] += 1
            return activate(lora_id, *args, **kwargs)

        runner.loads.load = counted_load  # loader threads and the engine thread; int increments under the GIL
        manager.activate_adapter = counted_activate
        if serialize_loads and not hasattr(self.server, "_loading"):  # LoRAServer without its own load lock
            self._serialize_adapter_loads()

    def _serialize_adapter_loads(self) -> None:
        """One load at a time per adapter name on this replica (only where LoRAServer does not do it itself).

        Works around a race in LoRAServer._ensure_loaded (cluster code is left as is here): two requests
        for an adapter the replica has not loaded yet, arriving together, both fetch it, the second
        TierCatalog.local_path deletes the directory the first is reading (AdapterFileMissingError) or the
        second engine.add_lora finds the name taken under another id (InvalidRequestError). A cold burst on
        one replica, which the affinity router produces on purpose, hits it every time.
        """
        ensure, locks = self.server._ensure_loaded, {}

        async def ensure_loaded(name: str):
            loaded = self.server._loaded.get(name)
            if loaded is not None:
                return loaded
            async with locks.setdefault(name, asyncio.Lock()):
                return await ensure(name)

        self.server._ensure_loaded = ensure_loaded

    def _in_gpu_slot(self, name: str) -> bool:
        request = self.server._loaded.get(name)
        return request is not None and request.lora_int_id in list(self._manager.lora_index_to_id)

    async def run(self, request: GenerateRequest) -> dict[str, Any]:
        """Serve one request to the end; says where it ran and whether its adapter was in a slot on arrival."""
        adapter = None if request.model == self.server.model_name else request.model
        hit = adapter is not None and self._in_gpu_slot(adapter)
        await self._before(adapter)
        await self._start()
        tokens = 0
        async for out in self.server.generate(request):
            tokens = len(out.outputs[0].token_ids)
        return dict(replica=self.replica_id, adapter=adapter, slot_hit=hit, tokens=tokens, counts=dict(self.counts))

    async def _before(self, adapter: str | None) -> None:
        pass


def multiplexed_replica(max_models: int) -> type:
    """BenchReplica whose adapters go through @serve.multiplexed, so Serve's default router sees them."""

    class MuxBenchReplica(BenchReplica):
        @serve.multiplexed(max_num_models_per_replica=max_models)
        async def get_adapter(self, adapter: str) -> str:
            await self._start()
            await self.server._ensure_loaded(adapter)  # into the engine's host cache, as a model "load"
            return adapter

        async def _before(self, adapter: str | None) -> None:
            model_id = serve.get_multiplexed_model_id()
            if adapter is not None and model_id:
                await self.get_adapter(model_id)

    return MuxBenchReplica


class RandomRouter(RequestRouter):
    """Uniformly random replica (the rest in random order, taken when the first is full)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.initialize_state()

    def initialize_state(self, seed: int | None = None, **_: Any) -> None:
        self._rng = random.Random(seed)

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        order = list(candidate_replicas)
        self._rng.shuffle(order)
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True
        return [[r] for r in order]


# ---- one router ---------------------------------------------------------------------------------


def build_router_app(router: str, args, root: Path):
    """The replica deployment for one router, with its own adapter tier (a fresh cache and fetch count)."""
    server = {"model": "demo", "default_max_tokens": args.max_tokens,
              "engine": {"dtype": "float32", "max_loras": args.max_loras, "max_cpu_loras": args.max_cpu_loras,
                         "max_lora_rank": 32, "num_kv_blocks": 256}}
    tier = {"name": tier_name(router), "capacity_bytes": 1 << 30, "registry_dir": None,
            "sources": {"allowed_local_roots": [str(root)]}}
    options: dict[str, Any] = dict(num_replicas=args.replicas, max_ongoing_requests=args.max_ongoing,
                                   ray_actor_options={"num_cpus": 0})
    cls: type = BenchReplica
    if router == "ours":
        options["request_router_config"] = RequestRouterConfig(
            request_router_class="cluster.router.AdapterAffinityRouter",
            request_router_kwargs={"seed": args.seed, **json.loads(args.router_kwargs)},
            request_routing_stats_period_s=args.stats_period)
    elif router == "random":
        options["request_router_config"] = RequestRouterConfig(
            request_router_class=RandomRouter, request_router_kwargs={"seed": args.seed})
    else:
        cls = multiplexed_replica(args.mux_models or args.max_loras)
    deployment = serve.deployment(cls, name="LoRAReplica").options(**options)
    return deployment.bind(server, tier, not args.no_load_lock)

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny version (the test's)")
    parser.add_argument("--adapters", type=int, help="registered adapters (default 96; quick 24)")
    parser.add_argument("--requests", type=int, help="requests per router (default 600; quick 60)")
    parser.add_argument("--clients", type=int, help="closed-loop clients (default 12; quick 6)")
    parser.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of adapter popularity")
    parser.add_argument("--burst", type=int, default=1,
                        help="consecutive requests per adapter draw (1: i.i.d.; K: tenants' bursts of K)")
    parser.add_argument("--router-kwargs", default="{}",
                        help="JSON request_router_kwargs for our router (e.g. '{\"busy_fraction\": 0.75}')")
    parser.add_argument("--max-tokens", type=int, help="tokens generated per request (default 16; quick 8)")
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--max-loras", type=int, default=4, help="GPU slots per replica")
    parser.add_argument("--max-cpu-loras", type=int, default=8, help="host-cache entries per replica")
    parser.add_argument("--max-ongoing", type=int, default=16,
                        help="Serve max_ongoing_requests per replica (deploy/config.yaml's)")
    parser.add_argument("--mux-models", type=int, default=0,
                        help="max_num_models_per_replica for the default router (0: max_loras)")
    parser.add_argument("--stats-period", type=float, default=1.0, help="routing-stats period of our router (s)")
    parser.add_argument("--routers", default=",".join(ROUTERS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-load-lock", action="store_true",
                        help="leave concurrent first loads of one adapter on a replica unserialized "
                             "(reproduces the LoRAServer._ensure_loaded race)")
    parser.add_argument("--num-cpus", type=int, default=None, help="Ray CPUs (default: all)")
    args = parser.parse_args()
    quick = args.quick
    args.adapters = args.adapters or (24 if quick else 96)
    args.requests = args.requests or (60 if quick else 600)
    args.clients = args.clients or (6 if quick else 12)
    args.max_tokens = args.max_tokens or (8 if quick else 16)
    routers = [r for r in args.routers.split(",") if r]
    if unknown := set(routers) - set(ROUTERS):
        parser.error(f"unknown routers {sorted(unknown)}")
    if args.burst < 1:
        parser.error("--burst must be >= 1")
    try:
        if not isinstance(json.loads(args.router_kwargs), dict):
            raise ValueError("not an object")
    except ValueError as e:
        parser.error(f"--router-kwargs must be a JSON object: {e}")

    root = Path(tempfile.mkdtemp(prefix="lorafleet-bench-adapters-"))
    adapters = make_adapters(root, args.adapters)
    requests = zipf_requests(sorted(adapters), args.requests, args.zipf, args.max_tokens, args.seed, args.burst)
    warmup = [GenerateRequest(model=BASE_MODEL, sampling=dict(max_tokens=2, temperature=0.0), prompt="Hi",
                              request_id=f"warm-{i}") for i in range(4 * args.replicas)]
    env = {"OMP_NUM_THREADS": "1"}
    if os.environ.get("LORAFLEET_CACHE"):
        env["LORAFLEET_CACHE"] = os.environ["LORAFLEET_CACHE"]
    print(f"{args.replicas} replicas x (max_loras {args.max_loras}, max_cpu_loras {args.max_cpu_loras}, "
          f"max_ongoing {args.max_ongoing}); {args.adapters} adapters, Zipf({args.zipf}), "
          f"{'i.i.d.' if args.burst == 1 else f'bursts of {args.burst}'}, {args.requests} requests, "
          f"{args.clients} closed-loop clients, {args.max_tokens} tokens each; seed {args.seed}; "
          f"default router: multiplexed, {args.mux_models or args.max_loras} models per replica; "
          f"ours' kwargs {args.router_kwargs}", flush=True)
    rows = []
    ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False, namespace="lorafleet-bench",
             runtime_env={"env_vars": env})
    try:
        serve.start(proxy_location="Disabled")
        t0 = time.perf_counter()
        # All apps start together (replica start-up is most of the setup); they are measured one at a time.
        handles = serve.run_many([serve.RunTarget(build_router_app(r, args, root), name=f"bench-{r}",
                                                  route_prefix=None) for r in routers])
        print(f"  {len(routers)} x {args.replicas} replicas up in {time.perf_counter() - t0:.1f} s", flush=True)
        for router, handle in zip(routers, handles):
            rows.append({**run_router(router, handle, args, adapters, requests, warmup), "burst": args.burst})
            print(f"  {router}: done in {rows[-1]['wall_s']:.1f} s (+{rows[-1]['setup_s']:.1f} s setup)", flush=True)
    finally:
        t0 = time.perf_counter()
        ray.shutdown()  # ends Serve with it
        print(f"  ray shut down in {time.perf_counter() - t0:.1f} s", flush=True)
        shutil.rmtree(root, ignore_errors=True)

    print()
    print_table(rows)
    slots = args.replicas * args.max_loras
    print(f"ceiling: the {slots} most requested adapters (one per GPU slot) carry "
          f"{top_share(requests, slots):.3f} of the requests")
    by = {r["router"]: r for r in rows}
    ours = by.get("ours")
    if ours:
        for other in ("default", "random"):
            if other in by:
                o = by[other]
                print(f"ours/{other}: slot hit x{ratio(ours['slot_hit'], o['slot_hit']):.2f}  "
                      f"slot loads x{ratio(ours['slot_loads'], o['slot_loads']):.2f}  "
                      f"engine loads x{ratio(ours['engine_loads'], o['engine_loads']):.2f}  "
                      f"p50 x{ratio(ours['p50_ms'], o['p50_ms']):.2f}  p99 x{ratio(ours['p99_ms'], o['p99_ms']):.2f}  "
                      f"req/s x{ratio(ours['req_per_s'], o['req_per_s']):.2f}")
        print(f"ours' routing decisions: {ours['decisions']}")
    print("targets:")
    for r in rows:
        ok = r["origin_fetches"] == r["distinct"]
        print(f"  {r['router']}: origin fetches {r['origin_fetches']} == distinct adapters requested "
              f"{r['distinct']}: {'MET' if ok else 'MISSED'}")
    if ours and "default" in by:
        x = ratio(ours["slot_hit"], by["default"]["slot_hit"])
        print(f"  slot hit rate ours/default {x:.2f} >= 1.5: {'MET' if x >= 1.5 else 'MISSED'}")

    out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "out")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "cluster_quick.csv" if quick else "cluster.csv")
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"csv: {path}")


if __name__ == "__main__":
    main()
