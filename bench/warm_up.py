"""Where a replica's cold start goes: weights, Triton compiles, CUDA-graph captures (GPU).

Why: an autoscaled replica serves nothing until its engine has warmed up, and on a fresh node Triton's disk
cache is empty (bench/engine.py's rank-16 8B engine took 93 s there against 6 s for the base one). This
builds one engine of the Llama-3-8B shape (dummy weights) and splits its construction into the phases of
replicas/warm_up.py, with the time spent inside Triton's compiler and how many variants it built.

    python3 bench/warm_up.py --rank 16 --fresh-cache       # an empty Triton cache, as on a new node
    python3 bench/warm_up.py --rank 16                     # the machine's cache as it is
    python3 bench/warm_up.py --rank 16 --fresh-cache --variant compile_workers=0   # every compile at first launch
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


class Phases:
    """Seconds per named phase, and Triton's compiles (count, seconds) inside each."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.compiles: dict[str, list[float]] = {}
        self.current = "build"
        self.graphs = 0
        self.workers = (0, 0)  # variants sent to compile_ahead's processes, variants it left to this one
        self.dry_steps = 0.0  # of the compile-ahead pass: its steps, launching nothing (then it waits)

    @contextmanager
    def phase(self, name: str):
        outer, self.current = self.current, name
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
            self.current = outer

    def wrap_compile(self, compile_fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return compile_fn(*args, **kwargs)
            finally:
                self.compiles.setdefault(self.current, []).append(time.perf_counter() - start)
        return timed


def instrument(phases: Phases) -> None:
    """Time Triton's compiler in this process (JITFunction binds triton.compiler.compile on its first launch,
    so this runs before any kernel has; with compile workers it only loads from the disk cache) and the
    parts of replicas.warm_up.warm_up: the compile-only pass, the synthetic steps, the captures."""
    import triton.compiler
    from replicas import warm_up

    triton.compiler.compile = phases.wrap_compile(triton.compiler.compile)
    original_ahead = warm_up.compile_ahead

    @contextmanager
    def ahead(workers):
        with phases.phase("compile-ahead pass"):
            with original_ahead(workers) as scope:
                start = time.perf_counter()
                yield scope
                if scope is not None:  # the rest of the pass waits for the workers
                    phases.workers = (len(scope.futures), scope.skipped)
                    phases.dry_steps = time.perf_counter() - start
    warm_up.compile_ahead = ahead
    original_steps = warm_up.synthetic_steps

    def steps(runner):
        if phases.current == "compile-ahead pass":
            return original_steps(runner)
        with phases.phase("synthetic steps"):
            return original_steps(runner)
    warm_up.synthetic_steps = steps
    original_capture = warm_up.capture_graphs

    def capture(runner):
        with phases.phase("graph captures"):
            count = original_capture(runner)
        phases.graphs = count
        return count
    warm_up.capture_graphs = capture


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rank", type=int, default=16, help="max_lora_rank (0: no LoRA)")
    p.add_argument("--max-loras", type=int, default=32)
    p.add_argument("--fresh-cache", action="store_true", help="point TRITON_CACHE_DIR at an empty directory")
    p.add_argument("--variant", action="append", default=[], metavar="FIELD=VALUE",
                   help="an EngineArgs override, e.g. cudagraph_mode=full_decode_only")
    a = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="warm_up_"))
    if a.fresh_cache:
        os.environ["TRITON_CACHE_DIR"] = str(work / "triton")

    import torch
    from bench.engine import _value
    from bench.engine_workload import LLAMA3_8B, write_model_dir
    from replicas.engine import EngineArgs, LLMEngine

    if not torch.cuda.is_available():
        sys.exit("bench/warm_up.py times a GPU warm-up (on CPU the engine compiles and captures nothing)")
    phases = Phases()
    instrument(phases)
    overrides = {k: _value(v) for k, v in (item.split("=", 1) for item in a.variant)}
    args = dict(model=str(write_model_dir(work / "model", LLAMA3_8B)), dtype="bfloat16", load_format="dummy",
                enable_lora=a.rank > 0, max_loras=a.max_loras, max_lora_rank=max(a.rank, 1), max_num_seqs=64,
                num_kv_blocks=64 * 48 + 8, enable_prefix_caching=False) | overrides
    start = time.perf_counter()
    with phases.phase("engine"):
        engine = LLMEngine(EngineArgs(**args))
    total = time.perf_counter() - start
    print(f"{torch.cuda.get_device_name()}  rank {a.rank}  fresh cache {a.fresh_cache}  {overrides or ''}")
    print(f"engine built and warmed up in {total:.1f} s ({phases.graphs} graphs; variants compiled ahead in "
          f"processes {phases.workers[0]}, left to this process {phases.workers[1]})")
    inner = sum(v for k, v in phases.seconds.items() if k != "engine")
    rows = [(k, v) for k, v in phases.seconds.items() if k != "engine"] + [("rest (weights, ...)", total - inner)]
    print(f"{'phase':22} {'s':>7} {'compiles':>9} {'compile s':>10}")
    for name, seconds in rows:
        times = phases.compiles.get(name if not name.startswith("rest") else "engine", [])
        print(f"{name:22} {seconds:7.1f} {len(times):9d} {sum(times):10.1f}")
        if name == "compile-ahead pass" and phases.workers[0]:
            print(f"{'  its steps (dry)':22} {phases.dry_steps:7.1f}")
    engine.shutdown()


if __name__ == "__main__":
    main()
