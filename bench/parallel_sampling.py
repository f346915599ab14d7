"""Parallel sampling (n > 1): the later completions wait for the first to compute the prompt, or all start at once.

Since the scheduler holds a request's later completions back until the first has computed the shared prompt
(Sequence.prefix_leader), the prompt is computed once per request instead of n times, at the cost of a step
of latency for the other n - 1 completions. This runs one engine (Llama-3-8B shape, dummy bf16 weights, no
LoRA, prefix caching on) over the same kind of batch twice, side by side: "hold" (the engine as it is) and
"all" (the hold switched off, as before: siblings admitted in one step each compute the prompt). Every request
has a distinct random prompt, and the prefix cache is emptied between runs, so nothing else is shared.

    python bench/parallel_sampling.py --requests 32 --n 4 --prompt 1024 --output 64

Prints, per mode: wall time, generated tok/s, prompt tokens computed, and time to the first token of the first
completion and of the last completion to start (p50 over requests), and the ratios hold / all.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.engine_workload import LLAMA3_8B, TINY, write_model_dir  # noqa: E402
from replicas.engine import EngineArgs, LLMEngine  # noqa: E402
from replicas.sampling_params import SamplingParams  # noqa: E402
from replicas.scheduler import Scheduler  # noqa: E402


def run(engine: LLMEngine, a, seed: int, hold: bool) -> dict:
    bm = engine.scheduler.block_manager
    bm.reset_prefix_cache()
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(n=a.n, temperature=1.0, seed=seed, max_tokens=a.output, ignore_eos=True)
    hits0, queried0 = bm.num_cache_hit_tokens, bm.num_cache_queried_tokens
    first: dict[str, float] = {}  # request -> first token of any completion
    last_start: dict[str, float] = {}  # request -> the moment every completion had a token
    generated = 0
    # "all": the behaviour before the hold, every sibling admitted as soon as the scheduler can
    off = mock.patch.object(Scheduler, "_waits_for_leader", staticmethod(lambda seq: False))
    with contextlib.nullcontext() if hold else off:
        t0 = time.perf_counter()
        for i in range(a.requests):
            prompt = [rng.randrange(4, vocab) for _ in range(a.prompt)]
            engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                now = time.perf_counter() - t0
                counts = [len(c.token_ids) for c in out.outputs]
                if any(counts):
                    first.setdefault(out.request_id, now)
                if all(counts):
                    last_start.setdefault(out.request_id, now)
                if out.finished:
                    generated += sum(counts)
        wall = time.perf_counter() - t0
    hits, queried = bm.num_cache_hit_tokens - hits0, bm.num_cache_queried_tokens - queried0
    return dict(wall=wall, tok_s=generated / wall, computed=queried - hits, hits=hits,
                ttft_first=statistics.median(first.values()), ttft_all=statistics.median(last_start.values()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--output", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2, help="runs of each mode, alternated")
    p.add_argument("--tiny", action="store_true", help="a tiny model (CPU smoke run)")
    a = p.parse_args()
    shape = TINY if a.tiny else LLAMA3_8B
    device = "cpu" if a.tiny else "cuda"
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_dir(Path(tmp) / "model", shape)
        seqs = a.requests * a.n
        engine = LLMEngine(EngineArgs(
            model=str(model_dir), dtype="float32" if a.tiny else "bfloat16", device=device, load_format="dummy",
            max_num_seqs=seqs, num_kv_blocks=seqs * -(-(a.prompt + a.output) // 16) + 16,
            max_num_batched_tokens=max(2048, a.prompt), enable_prefix_caching=True))
        run(engine, argparse.Namespace(**{**vars(a), "requests": 2, "output": 4}), 999, True)  # warm
        results: dict[str, list[dict]] = {"hold": [], "all": []}
        for r in range(a.repeats):
            for mode in ("all", "hold") if r % 2 else ("hold", "all"):
                results[mode].append(run(engine, a, 1000 + 2 * r + (mode == "all"), mode == "hold"))
        engine.shutdown()
    print(f"{a.requests} requests x n = {a.n}, prompt {a.prompt}, output {a.output}, {'tiny' if a.tiny else '8B'}")
    print(f"{'mode':6} {'wall s':>8} {'tok/s':>9} {'prompt computed':>16} {'cache hits':>11} "
          f"{'ttft first':>11} {'ttft all n':>11}")
    med = {}
    for mode, runs in results.items():
        med[mode] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        m = med[mode]
        print(f"{mode:6} {m['wall']:8.2f} {m['tok_s']:9.1f} {m['computed']:16.0f} {m['hits']:11.0f} "
              f"{m['ttft_first'] * 1e3:9.1f}ms {m['ttft_all'] * 1e3:9.1f}ms")
    h, o = med["hold"], med["all"]
    print(f"hold / all: tok/s {h['tok_s'] / o['tok_s']:.3f}  prompt computed {h['computed'] / o['computed']:.3f}  "
          f"ttft first {h['ttft_first'] / o['ttft_first']:.3f}  ttft all n {h['ttft_all'] / o['ttft_all']:.3f}")


if __name__ == "__main__":
    main()
