"""Where an adapter load's time goes (issue 3): disk -> validated LoRAModel -> pinned host copy -> GPU slot.

Builds the engine of bench/engine.py (Llama-3-8B shape, dummy weights, one
GPU) and, for each rank, times on the calling thread, per adapter (median of
--count adapters, each its own directory over a few shared weight files, so
the page cache holds them as in the engine benchmark):
  read     LoRAModel.from_local_checkpoint: safetensors read, key mapping,
           validation (shapes, NaN/Inf), scaling
  prepare  LoRAModelManager.prepare_adapter: slot layout, one pinned slab
  to GPU   activate_adapter (host-to-device into a slot), synchronized
then --count fresh adapters through the engine's loader threads
(start_lora_load / finish_lora_load), the path a request takes: adapters per
second and MB/s; and read + prepare rates over 1-8 loader threads, with
torch's intra-op threads at their default and at 1. Ends with cProfile's top functions of one read + prepare.

    python bench/adapter_load.py [--ranks 16 64] [--count 8]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.engine import make_engine  # noqa: E402
from bench.engine_workload import LLAMA3_8B, TINY, AdapterPools, adapter_bytes, write_model_dir  # noqa: E402


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def process_path(loads, pools: AdapterPools, rank: int, count: int, processes: int, mb: float) -> None:
    """Loads through the worker processes, one at a time, both ways: through a shared slab of the worker's
    (read + prepare there, as the loader thread waits for it, then the copy into this process's pinned pool),
    and written by the worker into a block of the shared pool; then `processes` at once."""
    loader = loads.process_loader
    worker, adopt, direct = [], [], []
    for req, req2 in zip(pools.pool("process", rank, count), pools.pool("process-pool", rank, count)):
        t0 = time.perf_counter()
        _, shared = loader.load_shared(req)
        t1 = time.perf_counter()
        loads.manager.adopt_shared(shared)
        t2 = time.perf_counter()
        _, adapter = loader.load(req2)
        direct.append(time.perf_counter() - t2)
        worker.append(t1 - t0)
        adopt.append(t2 - t1)
        del adapter  # its block back to the pool
    reqs = pools.pool("process-many", rank, 2 * processes)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(processes) as pool:
        list(pool.map(loads.load_prepared, reqs))
    rate = len(reqs) / (time.perf_counter() - t0)
    w, c, d = (1e3 * statistics.median(v) for v in (worker, adopt, direct))
    shared_pool = loads.manager.host_pool is not None and loads.manager.host_pool.shared
    print(f"r{rank} through {processes} loader processes, one at a time: via the worker's slab {w:.1f} ms + copy "
          f"into pinned {c:.1f} ms = {w + c:.1f} ms; into a block of the {'shared' if shared_pool else 'PRIVATE'} "
          f"pool {d:.1f} ms ({(w + c) / d:.2f} x); {processes} at once {rate:.1f} adapters/s "
          f"({rate * mb / 1e3:.2f} GB/s)", flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[16, 64])
    p.add_argument("--count", type=int, default=8)
    p.add_argument("--tiny", action="store_true", help="tiny model on CPU (a smoke run)")
    p.add_argument("--processes", type=int, default=0,
                   help="also time loads through this many loader processes (EngineArgs.lora_load_processes)")
    a = p.parse_args(argv)
    shape = TINY if a.tiny else LLAMA3_8B
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    work = Path(tempfile.mkdtemp(prefix="lorafleet-load-"))
    model_dir = write_model_dir(work / "model", shape)
    pools = AdapterPools(work, shape, dtype)
    a.tp, a.dtype = 1, "auto"
    rows = []
    for rank in a.ranks:
        engine = make_engine(model_dir, a, rank, max_loras=a.count, max_seqs=8, max_len=256,
                             max_cpu_loras=8 * a.count, overrides={"lora_load_processes": a.processes})
        runner = engine.executor.runner
        manager = runner.lora_manager
        mb = adapter_bytes(shape, rank, torch.empty((), dtype=dtype).element_size()) / 1e6
        phases: dict[str, list[float]] = {"read": [], "prepare": [], "to GPU": []}
        for req in pools.pool("phase", rank, a.count):
            t0 = time.perf_counter()
            lora = runner.loads.load(req)
            t1 = time.perf_counter()
            manager.add_prepared(manager.prepare_adapter(lora))
            t2 = time.perf_counter()
            manager.activate_adapter(req.lora_int_id)
            _sync()
            t3 = time.perf_counter()
            for name, dt in zip(phases, (t1 - t0, t2 - t1, t3 - t2)):
                phases[name].append(dt)
        reqs = pools.pool("threads", rank, a.count)
        t0 = time.perf_counter()
        for req in reqs:
            runner.start_lora_load(req)
        for req in reqs:
            runner.finish_lora_load(req.lora_int_id)
        threaded = time.perf_counter() - t0
        sweep = []
        default_threads = torch.get_num_threads()
        for intra in sorted({default_threads, 1}, reverse=True):
            torch.set_num_threads(intra)
            for workers in (1, 2, 4, 8):
                reqs = pools.pool(f"sweep{intra}-{workers}", rank, 2 * a.count)
                t0 = time.perf_counter()
                with ThreadPoolExecutor(workers) as pool:
                    list(pool.map(runner.loads.load_prepared, reqs))
                sweep.append((intra, workers, len(reqs) / (time.perf_counter() - t0)))
        torch.set_num_threads(default_threads)
        print(f"r{rank} read + prepare, adapters/s by (torch intra-op threads, loader threads): "
              + "  ".join(f"({i}, {w}) {r:.1f}" for i, w, r in sweep), flush=True)
        med = {k: 1e3 * statistics.median(v) for k, v in phases.items()}
        rows.append((rank, mb, med, a.count / threaded))
        print(f"r{rank}: {mb:.0f} MB  " + "  ".join(f"{k} {v:.1f} ms ({mb / v:.2f} GB/s)" for k, v in med.items())
              + f"  |  loader {'processes' if a.processes else 'threads'}: {a.count / threaded:.1f} adapters/s "
              f"({a.count * mb / threaded / 1e3:.2f} GB/s)",
              flush=True)
        if a.processes:
            process_path(runner.loads, pools, rank, a.count, a.processes, mb)
        prof = cProfile.Profile()
        req = pools.pool("profile", rank, 1)[0]
        prof.enable()
        manager.prepare_adapter(runner.loads.load(req))
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(14)
        print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[:3000], flush=True)
        engine.shutdown()
        del engine, runner, manager
    print("\nrank     MB   read ms  prepare ms  to-GPU ms  total ms  loader adapters/s")
    for rank, mb, med, rate in rows:
        print(f"{rank:>4} {mb:>6.0f} {med['read']:>9.1f} {med['prepare']:>11.1f} {med['to GPU']:>10.1f} "
              f"{sum(med.values()):>9.1f} {rate:>18.1f}")


if __name__ == "__main__":
    main()
