"""Where an engine step's time goes: torch.profiler over a window of steps of the engine benchmark's workload.

Builds the same engine as bench/engine.py (Llama-3-8B shape, dummy weights, one
adapter of rank R for every request, --adapters N cycled through, or none with
--rank 0), runs the
closed-loop workload until it is steady, then profiles --steps steps and prints
the mixed (prefill + decode) and pure-decode step times and the top operators
by device and by host time.

    python bench/profile_step.py --rank 16 --steps 40
    python bench/profile_step.py --rank 16 --steps 40 --adapters 200   # every request its own adapter
    python bench/profile_step.py --rank 16 --steps 80 --adapters 100 --load-processes 4   # > slots and host cache
    python bench/profile_step.py --rank 16 --steps 40 --adapters 10 --fused-max-adapters 16   # one launch per site
    python bench/profile_step.py --rank 16 --steps 60 --tp 2 --warm-steps 0    # a TP engine's first steps (rank 0)
    python bench/profile_step.py --rank 16 --set lora_merge_steps=0 --set lora_load_switch_interval=0
    python bench/profile_step.py --model gemma3-1b --rank 16 --steps 60 --adapters 100   # a small model's shape
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.engine import MODELS, parse_variant  # noqa: E402
from bench.engine_workload import TINY, AdapterPools, make_requests, write_model_dir  # noqa: E402
from replicas.engine import EngineArgs, LLMEngine  # noqa: E402
from replicas.sampling_params import SamplingParams  # noqa: E402


def _named(fn, label):
    def run(*args, **kwargs):
        with torch.profiler.record_function(label):
            return fn(*args, **kwargs)
    return run


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--model", choices=sorted(MODELS), default="llama3-8b", help="the model's shape (without --tiny)")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--adapters", type=int, default=1,
                   help="adapters the requests cycle through (1: one for all; e.g. 200: distinct, with loads)")
    p.add_argument("--load-processes", type=int, default=None,
                   help="EngineArgs.lora_load_processes (default: the engine's, 4 on CUDA hosts)")
    p.add_argument("--fused-max-adapters", type=int, default=None,
                   help="EngineArgs.lora_fused_max_adapters (one launch per LoRA site; default: the engine's)")
    p.add_argument("--pending-min-adapters", type=int, default=5,
                   help="EngineArgs.lora_pending_min_adapters (expands fused into the next op from this many)")
    p.add_argument("--tp", type=int, default=1, help="tensor_parallel_size (the profile is rank 0's process)")
    p.add_argument("--warm-steps", type=int, default=60,
                   help="steps before the profiled window (0: from the engine's first step, after its warm-up)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="any other EngineArgs field, as bench/engine.py's --variant takes it")
    p.add_argument("--trace", default=None, help="also write the profile as a gzipped Chrome trace here")
    a = p.parse_args(argv)
    overrides = parse_variant("set:" + ",".join(a.set))[1] if a.set else {}
    shape = TINY if a.tiny else MODELS[a.model]
    work = Path(tempfile.mkdtemp())
    model_dir = write_model_dir(work / "model", shape)
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    loras = AdapterPools(work / "lora", shape, dtype, 4).pool("p", a.rank, a.adapters) if a.rank else [None]
    engine = LLMEngine(EngineArgs(model=str(model_dir), enable_lora=a.rank > 0, max_loras=a.concurrency,
                                  max_lora_rank=max(a.rank, 1), num_kv_blocks=a.concurrency * 64 + 8,
                                  max_num_seqs=max(64, a.concurrency), enable_prefix_caching=False,
                                  load_format="dummy", enforce_eager=a.enforce_eager,
                                  lora_load_processes=a.load_processes,
                                  lora_fused_max_adapters=a.fused_max_adapters,
                                  lora_pending_min_adapters=a.pending_min_adapters,
                                  tensor_parallel_size=a.tp, **overrides))
    reqs = make_requests(8 * a.concurrency, (8, 512), (8, 512), shape["vocab_size"], None, seed=0)
    it = iter(enumerate(reqs))
    kinds: dict[str, list[float]] = {"mixed": [], "decode": []}
    make_input = engine._step_input
    last = {}

    def recording(out, previous):
        last["prefill"] = any(s.is_prefill for s in out.scheduled)
        return make_input(out, previous)

    engine._step_input = recording
    runner = getattr(engine.executor, "runner", None)
    if runner is not None:  # named ranges in the trace for the host phases of a step
        adapters = ((runner, "_register"), (runner, "prefetch_loras"), (runner, "finish_lora_load"),
                    (runner.lora_manager, "activate_adapter"), (runner.lora_manager, "add_prepared")) \
            if runner.lora_manager is not None else ()
        for obj, name in ((runner, "execute"), (runner, "_set_lora_mapping"), (runner.model, "forward"),
                          (engine, "_step_input"), (engine, "_read_back")) + adapters:
            if hasattr(obj, name):
                setattr(obj, name, _named(getattr(obj, name), f"lf::{name}"))

    # A step's time is from the end of the previous step() to the end of this one, without a sync in
    # between: with async scheduling step() launches the next step before it waits for the last, so a
    # sync before each step would time the host's part only.
    clock = {"end": None}

    def step() -> None:
        while len(engine._requests) < a.concurrency:  # live requests, those waiting for a load too
            i, r = next(it)
            engine.add_request(str(i), {"prompt_token_ids": r.prompt_ids},
                               SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True),
                               loras[i % len(loras)])
        start = clock["end"] or time.perf_counter()
        engine.step()
        clock["end"] = time.perf_counter()
        kinds["mixed" if last.get("prefill") else "decode"].append(clock["end"] - start)

    for _ in range(a.warm_steps):
        step()
    kinds = {"mixed": [], "decode": []}
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                    if torch.cuda.is_available() else [])
    with torch.profiler.profile(activities=acts) as prof:
        clock["end"] = None  # the profiler's start-up is no step's time
        for _ in range(a.steps):
            step()
    for kind, times in kinds.items():
        if times:
            times.sort()
            print(f"{kind:7} steps {len(times):3}  median {1e3 * times[len(times) // 2]:8.2f} ms  "
                  f"sum {1e3 * sum(times):8.1f} ms")
    if torch.cuda.is_available():
        # Kernel time the GPU spent against the steps' wall time: the gap is host work the GPU waited for
        # (the profiler's own overhead included, so an upper bound on the host share).
        busy_ms = sum(e.self_device_time_total for e in prof.key_averages()) / 1e3
        wall_ms = 1e3 * sum(sum(times) for times in kinds.values())
        print(f"GPU busy {busy_ms:.1f} ms of {wall_ms:.1f} ms wall ({100 * busy_ms / wall_ms:.0f}%) "
              f"over {a.steps} steps")
    pool = getattr(getattr(runner, "lora_manager", None), "host_pool", None)
    if pool is not None:
        print(f"host pool: {pool.num_blocks} blocks of {pool.block_bytes / 2**20:.1f} MiB, {pool.free_blocks} free, "
              f"{pool.fallbacks} allocations fell back to pinning their own slab")
    key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))
    if a.trace:
        import gzip
        import shutil

        raw = a.trace.removesuffix(".gz")
        prof.export_chrome_trace(raw)
        with open(raw, "rb") as src, gzip.open(raw + ".gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.remove(raw)
    engine.shutdown()


if __name__ == "__main__":
    main()
