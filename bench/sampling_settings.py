"""What sampling settings cost a batch: greedy against random sampling with penalties, logprobs and stop strings.

`bench/engine.py` samples greedily; real traffic mostly does not. With async scheduling the sampler's kernels
queue behind the running step and the host goes on to the next step, so a setting costs throughput only where
it makes the GPU wait for the host (host work past the GPU's step) or adds GPU work of its own. This runs one
engine (dummy bf16 weights, no LoRA) over the same requests once per setting, side by side:

    greedy     temperature 0
    random     temperature 0.8, top_p 0.95, top_k 50, seeded
    nucleus    temperature 0.8, top_p 0.95, no top_k (the OpenAI clients' form: a sort of the vocabulary)
    penalties  random + repetition 1.1, frequency 0.3, presence 0.3 (they read every row's prompt and output)
    logprobs   random + the top 5 logprobs of every token
    stops      random + two stop strings and a stop token id that never match (the matching is the cost)
    all        all of the above together

    python bench/sampling_settings.py --shape 8b --requests 64 --concurrency 32 --prompt 512 --output 128

Prints, per setting: tokens generated (every request runs to max_tokens: ignore_eos, stops that never match), tok/s, time per output token (p50), the sampler's host time per step, the median step()
of full-batch decode steps, and each one's ratio to greedy.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.closed_loop import run_closed_loop  # noqa: E402
from bench.engine_workload import LLAMA3_8B, LLAMA32_1B, SPECIALS, TINY, write_model_dir  # noqa: E402
from replicas.engine import EngineArgs, LLMEngine  # noqa: E402
from replicas.sampling_params import SamplingParams  # noqa: E402

SHAPES = {"8b": LLAMA3_8B, "1b": LLAMA32_1B, "tiny": TINY}
RANDOM = dict(temperature=0.8, top_p=0.95, top_k=50)
SETTINGS = {
    "greedy": dict(temperature=0.0),
    "random": RANDOM,
    "nucleus": dict(temperature=0.8, top_p=0.95),
    "penalties": dict(RANDOM, repetition_penalty=1.1, frequency_penalty=0.3, presence_penalty=0.3),
    "logprobs": dict(RANDOM, logprobs=5),
    "stops": dict(RANDOM, stop=["\x07never\x07", "zz top zz"], stop_token_ids=[1]),  # 1: BOS, never sampled here
    "all": dict(RANDOM, repetition_penalty=1.1, frequency_penalty=0.3, presence_penalty=0.3, logprobs=5,
                stop=["\x07never\x07", "zz top zz"], stop_token_ids=[1]),
}


def run(engine: LLMEngine, a, setting: str, seed: int) -> dict:
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size

    def make(i: int):
        params = SamplingParams(max_tokens=a.output, ignore_eos=True, seed=seed + i, **SETTINGS[setting])
        return [rng.randrange(len(SPECIALS), vocab) for _ in range(a.prompt)], params

    return run_closed_loop(engine, make, a.requests, a.concurrency, {"sample": (engine.sampler, "sample")})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--output", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2, help="runs of each setting, rotated")
    p.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated, from: " + ", ".join(SETTINGS))
    a = p.parse_args()
    names = a.settings.split(",")
    unknown = sorted(set(names) - set(SETTINGS))
    if unknown or "greedy" not in names:
        p.error(f"unknown settings {unknown}" if unknown else "the settings must include greedy (the baseline)")
    tiny = a.shape == "tiny"
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_dir(Path(tmp) / "model", SHAPES[a.shape])
        engine = LLMEngine(EngineArgs(
            model=str(model_dir), dtype="float32" if tiny else "bfloat16", device="cpu" if tiny else "cuda",
            load_format="dummy", max_num_seqs=a.concurrency,
            num_kv_blocks=a.concurrency * -(-(a.prompt + a.output) // 16) + 16,
            max_num_batched_tokens=max(2048, a.prompt)))
        run(engine, argparse.Namespace(**{**vars(a), "requests": 2, "output": 4}), "all", 999)  # warm
        results: dict[str, list[dict]] = {n: [] for n in names}
        for r in range(a.repeats):
            for k in range(len(names)):
                name = names[(k + r) % len(names)]
                results[name].append(run(engine, a, name, 1000 + 10 * r))
        engine.shutdown()
    print(f"{a.shape}, {a.requests} requests, {a.concurrency} at a time, prompt {a.prompt}, output {a.output}, "
          f"async scheduling {'on' if engine.async_scheduling else 'off'}")
    print(f"{'setting':10} {'tokens':>7} {'tok/s':>9} {'tpot p50':>9} {'sample/step':>12} {'full decode':>12} {'steps':>6} "
          f"{'x greedy tok/s':>15} {'x greedy decode':>16}")
    med = {n: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for n, runs in results.items()}
    g = med["greedy"]
    for name in names:
        m = med[name]
        print(f"{name:10} {m['tokens']:7.0f} {m['tok_s']:9.1f} {m['tpot_ms']:7.2f}ms {m['sample_ms']:10.3f}ms {m['decode_ms']:10.3f}ms "
              f"{m['decode_steps']:6.0f} {m['tok_s'] / g['tok_s']:15.3f} "
              f"{m['decode_ms'] / g['decode_ms'] if g['decode_ms'] else 0:16.3f}")


if __name__ == "__main__":
    main()
