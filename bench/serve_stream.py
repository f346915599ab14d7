"""Streaming through the Serve application: every engine step's output against coalesced ones, side by side.

Two apps of one CPU replica each (the demo model), alike but for ServerConfig.stream_interval_ms (0: an item
per engine step; 50 by default), started together and measured one after the other with the same requests:
--streams concurrent streaming requests through the ingress's Python handle, --tokens each (ignore_eos,
greedy), repeated --rounds times. Per app: generated tokens per second at the client, the items a request
received, time to its first item p50 / p99 and to its last, and the ratios of the two apps. A first row runs
the same requests on the engine alone (AsyncLLMEngine in this process, no Ray): what Serve costs.

    python bench/serve_stream.py --streams 16 --tokens 128

The CPU demo model's step is short, as a GPU's is beside a Serve item's host cost (~0.5 ms on two cores:
cluster/output_stream.py), so what the items cost shows here as it would on a GPU replica.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


async def one_stream(handle, tokens: int, prompt: str) -> dict:
    start = time.perf_counter()
    first, items, last = None, 0, None
    async for item in handle.options(stream=True).generate.remote(prompt=prompt, max_tokens=tokens, stream=True,
                                                                   temperature=0, ignore_eos=True):
        items += 1
        first = first or time.perf_counter() - start
        last = item
    return dict(first_s=first, total_s=time.perf_counter() - start, items=items,
                tokens=len(last["outputs"][0]["token_ids"]))


async def one_engine_stream(engine, tokens: int, prompt: str) -> dict:
    from replicas.sampling_params import SamplingParams

    start = time.perf_counter()
    first, items, last = None, 0, None
    async for out in engine.generate(prompt, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True),
                                     f"{prompt} {start}"):
        items += 1
        first = first or time.perf_counter() - start
        last = out
    return dict(first_s=first, total_s=time.perf_counter() - start, items=items,
                tokens=len(last.outputs[0].token_ids))


async def run_app(call, args) -> dict:
    """call(tokens, prompt) -> one request's stats, through an app's handle or the engine alone."""
    await call(4, "warm up")  # the first request builds graphs and caches
    results, wall = [], 0.0
    for r in range(args.rounds):
        t = time.perf_counter()
        results += await asyncio.gather(*[call(args.tokens, f"Request {r}-{i}: once upon a time")
                                          for i in range(args.streams)])
        wall += time.perf_counter() - t
    firsts = sorted(x["first_s"] for x in results)
    return dict(tok_s=sum(x["tokens"] for x in results) / wall, items=statistics.mean(x["items"] for x in results),
                first_p50=firsts[len(firsts) // 2] * 1e3, first_p99=firsts[int(0.99 * (len(firsts) - 1))] * 1e3,
                total_p50=statistics.median(x["total_s"] for x in results) * 1e3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--interval-ms", type=float, default=50.0, help="the coalesced app's stream_interval_ms")
    p.add_argument("--num-cpus", type=int, default=2)
    args = p.parse_args()

    import ray
    from ray import serve

    from cluster.app import build_app

    apps = {"every step": 0.0, f"{args.interval_ms:g} ms": args.interval_ms}
    engine_settings = dict(max_num_seqs=max(16, args.streams), enable_prefix_caching=False)
    rows = {"engine alone": asyncio.run(engine_alone(engine_settings, args))}
    ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    try:
        serve.start(proxy_location="Disabled")
        targets = []
        for i, interval in enumerate(apps.values()):
            server = dict(model="demo", stream_interval_ms=interval, engine=engine_settings)
            replica = dict(num_replicas=1, max_ongoing_requests=4 * args.streams,
                           ray_actor_options={"num_cpus": 0.5})
            app = build_app(dict(server=server, replica=replica, ingress={"ray_actor_options": {"num_cpus": 0.25}},
                                 tier={"registry_dir": f"/tmp/lorafleet-serve-stream-{os.getpid()}-{i}"}))
            targets.append(serve.RunTarget(app, name=f"stream-{i}", route_prefix=None))
        handles = serve.run_many(targets)
        for name, handle in zip(apps, handles):
            rows[name] = asyncio.run(run_app(lambda tokens, prompt: one_stream(handle, tokens, prompt), args))
    finally:
        ray.shutdown()

    print(f"{args.streams} streams x {args.tokens} tokens x {args.rounds} rounds, one CPU replica (demo model)")
    print(f"{'app':12} {'tok/s':>8} {'items/req':>10} {'first p50 ms':>13} {'first p99 ms':>13} {'last p50 ms':>12}")
    for name, r in rows.items():
        print(f"{name:12} {r['tok_s']:8.1f} {r['items']:10.1f} {r['first_p50']:13.1f} {r['first_p99']:13.1f} "
              f"{r['total_p50']:12.1f}")
    alone, every, coalesced = rows.values()
    ratios = {key: coalesced[key] / every[key] for key in ("tok_s", "items", "first_p50", "total_p50")}
    print(f"coalesced / every step: tok/s x{ratios['tok_s']:.2f}  items x{ratios['items']:.2f}  "
          f"first p50 x{ratios['first_p50']:.2f}  last p50 x{ratios['total_p50']:.2f}")
    print(f"coalesced / engine alone: tok/s x{coalesced['tok_s'] / alone['tok_s']:.2f}  "
          f"first p50 x{coalesced['first_p50'] / alone['first_p50']:.2f}")


async def engine_alone(settings: dict, args) -> dict:
    """The same requests on AsyncLLMEngine in this process, with the engine settings a replica gets."""
    from cluster.server_config import ServerConfig
    from replicas.async_engine import AsyncLLMEngine
    from replicas.demo_checkpoint import ensure_demo_checkpoint

    torch.set_num_threads(1)  # as the replicas' OMP_NUM_THREADS=1
    engine = AsyncLLMEngine.from_engine_args(
        ServerConfig(engine=settings).engine_args(str(ensure_demo_checkpoint().model_dir)))
    try:
        return await run_app(lambda tokens, prompt: one_engine_stream(engine, tokens, prompt), args)
    finally:
        await engine.shutdown()


if __name__ == "__main__":
    main()
