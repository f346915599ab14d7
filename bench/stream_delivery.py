"""What handing a step's outputs to their consumers costs AsyncLLMEngine's thread, per output against per step.

The engine thread gives each step's outputs to the requests' asyncio queues on the server's event loop. A
loop.call_soon_threadsafe per output (_Stream.put) wakes the loop once per output (a write to its self-pipe
each); replicas/async_engine._put_all makes one call per loop and step. This runs both side by side with
--streams consumers on an event loop, --steps steps, and prints the engine thread's microseconds per step,
the time until every consumer has every item, and the ratios:

    python bench/stream_delivery.py --streams 8 32 128
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from replicas.async_engine import _put_all, _Stream  # noqa: E402


async def deliver(streams: int, steps: int, batched: bool) -> tuple[float, float]:
    loop = asyncio.get_running_loop()
    targets = [_Stream(f"r{i}", loop) for i in range(streams)]

    def engine() -> float:
        t = time.perf_counter()
        for step in range(steps):
            if batched:
                _put_all([(s, step) for s in targets])
            else:
                for s in targets:
                    s.put(step)
        return time.perf_counter() - t

    async def consume(s: _Stream) -> None:
        for _ in range(steps):
            await s.queue.get()

    consumers = [asyncio.create_task(consume(s)) for s in targets]
    t = time.perf_counter()
    spent = await asyncio.to_thread(engine)
    await asyncio.gather(*consumers)
    return spent / steps * 1e6, (time.perf_counter() - t) / steps * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--streams", type=int, nargs="+", default=[8, 32, 128])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--repeats", type=int, default=7, help="runs of each, alternated; medians printed")
    a = p.parse_args()
    print(f"us per step, {a.steps} steps, median of {a.repeats} runs; engine = the engine thread's time, all = "
          f"until every consumer has all")
    print(f"{'streams':>7} {'engine per output':>18} {'per step':>9} {'ratio':>6} {'all per output':>15} "
          f"{'per step':>9} {'ratio':>6}")
    for n in a.streams:
        runs = {False: [], True: []}
        for _ in range(a.repeats):  # alternated, so a slow moment of the machine falls on both
            for batched in runs:
                runs[batched].append(asyncio.run(deliver(n, a.steps, batched)))
        old, new = ([statistics.median(r[i] for r in runs[b]) for i in (0, 1)] for b in (False, True))
        print(f"{n:7d} {old[0]:18.1f} {new[0]:9.1f} {old[0] / new[0]:6.1f} {old[1]:15.1f} {new[1]:9.1f} "
              f"{old[1] / new[1]:6.1f}")


if __name__ == "__main__":
    main()
