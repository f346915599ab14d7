"""Structured outputs: what a grammar's per-step token masks cost a batch, side by side with free text.

Every step, each constrained sequence's xgrammar matcher fills a bitmask of its allowed next tokens on the host
(replicas/grammar.py) and the sampler applies the masks on the device. With async scheduling the host fills
while the GPU runs the step, so the masks should cost little until the host's work outgrows the GPU's. This
runs one engine (Llama-3-8B shape, dummy bf16 weights, no LoRA) over the same requests three ways: "free" (no
constraint), "half" (every other request holds to a JSON Schema) and "json" (every request does).

The masks' cost depends on the vocabulary, so the model gets a real byte-level BPE tokenizer of 128,000
tokens, trained here on the Python sources of the installed packages (a word-level tokenizer cannot spell
JSON). The schema (nested objects, integers, enums, bounded strings) keeps the matchers moving through many
grammar states; with random weights a constrained output may end early, once its object is complete.

    python bench/structured_outputs.py --requests 64 --concurrency 32 --prompt 256 --output 128

Prints, per mode: generated tokens, wall time, tok/s, time per output token (p50 over requests), host time
per step (mean): filling masks, the sampler's call (launching its kernels, the masks' copy among them) and
the whole step() call; and the median step() of the steps that decoded a full batch with no prompt tokens
(with async scheduling, the step's period: the fairest figure, as constrained outputs that end early bring
more prompts into the other steps); then the ratios to "free". --fill-threads sets replicas.grammar.FILL_THREADS.
"""

from __future__ import annotations

import argparse
import cProfile
import glob
import os
import pstats
import random
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.closed_loop import run_closed_loop  # noqa: E402
from bench.engine_workload import LLAMA3_8B, SPECIALS, TINY, write_model_dir  # noqa: E402
from replicas import grammar  # noqa: E402
from replicas.engine import EngineArgs, LLMEngine  # noqa: E402
from replicas.sampling_params import SamplingParams  # noqa: E402
from replicas.structured_outputs import StructuredOutputsParams  # noqa: E402

SCHEMA = {
    "type": "object", "required": ["items"], "additionalProperties": False,
    "properties": {"items": {"type": "array", "items": {
        "type": "object", "required": ["id", "name", "kind", "tags"], "additionalProperties": False,
        "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 16},
                       "kind": {"enum": ["red", "green", "blue"]},
                       "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}}}}}}}


def train_tokenizer(path: Path, vocab_size: int, corpus_mb: float) -> None:
    """A byte-level BPE (Llama 3's kind) trained on installed Python sources, written as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    files, total = [], 0
    for name in sorted(glob.glob(os.path.join(sysconfig.get_paths()["purelib"], "**", "*.py"), recursive=True)):
        size = os.path.getsize(name)
        if total + size > corpus_mb * 1e6:
            break
        files.append(name)
        total += size
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train(files, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS), show_progress=False,
                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path))


def run(engine: LLMEngine, a, mode: str, seed: int) -> dict:
    rng = random.Random(seed)
    vocab = engine.tokenizer.vocab_size
    constraint = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)

    def make(i: int):
        constrained = mode == "json" or (mode == "half" and i % 2 == 0)
        params = SamplingParams(temperature=1.0, seed=seed + i, max_tokens=a.output, ignore_eos=True,
                                structured_outputs=constraint if constrained else None)
        return [rng.randrange(len(SPECIALS), vocab) for _ in range(a.prompt)], params

    # Rows whose mask a step filled: what the fill's time is spent on, counted so that a smoke run can check the
    # modes apart without comparing times.
    real, masked = engine.grammars.token_masks, [0]

    def counting(grammars, pin):
        masked[0] += sum(g is not None and not g.is_terminated for g in grammars)
        return real(grammars, pin)

    engine.grammars.token_masks = counting
    try:
        row = run_closed_loop(engine, make, a.requests, a.concurrency,
                              {"fill": (engine.grammars, "token_masks"), "sample": (engine.sampler, "sample")})
    finally:
        engine.grammars.token_masks = real
    return {**row, "masked_rows": masked[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--output", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2, help="runs of each mode, rotated")
    p.add_argument("--vocab", type=int, default=128000, help="tokenizer vocabulary (BPE tokens trained)")
    p.add_argument("--corpus-mb", type=float, default=30.0, help="Python sources the tokenizer is trained on")
    p.add_argument("--fill-threads", type=int, default=None, help="xgrammar threads per fill (default: the engine's)")
    p.add_argument("--profile", choices=("free", "half", "json"), help="then one more run of this mode under "
                   "cProfile: the host's functions by own time")
    p.add_argument("--tiny", action="store_true", help="a tiny model and vocabulary (CPU smoke run)")
    a = p.parse_args()
    if a.fill_threads is not None:
        grammar.FILL_THREADS = a.fill_threads
    shape = dict(TINY, vocab_size=max(TINY["vocab_size"], a.vocab)) if a.tiny else LLAMA3_8B
    device = "cpu" if a.tiny else "cuda"
    modes = ("free", "half", "json")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_dir(Path(tmp) / "model", shape)
        t = time.perf_counter()
        train_tokenizer(model_dir / "tokenizer.json", min(a.vocab, shape["vocab_size"]), a.corpus_mb)
        trained = time.perf_counter() - t
        blocks = a.concurrency * -(-(a.prompt + a.output) // 16) + 16
        engine = LLMEngine(EngineArgs(
            model=str(model_dir), dtype="float32" if a.tiny else "bfloat16", device=device, load_format="dummy",
            max_num_seqs=a.concurrency, num_kv_blocks=blocks, max_num_batched_tokens=max(2048, a.prompt)))
        warm = argparse.Namespace(**{**vars(a), "requests": 2, "output": 4})
        t = time.perf_counter()
        run(engine, warm, "json", 999)  # the vocabulary's scan and the schema's compile happen here
        first_use = time.perf_counter() - t
        results: dict[str, list[dict]] = {m: [] for m in modes}
        for r in range(a.repeats):
            for k in range(len(modes)):
                mode = modes[(k + r) % len(modes)]
                results[mode].append(run(engine, a, mode, 1000 + 10 * r))
        if a.profile:
            profiler = cProfile.Profile()
            profiler.runcall(run, engine, a, a.profile, 7)
            pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
        engine.shutdown()
    print(f"{a.requests} requests, {a.concurrency} at a time, prompt {a.prompt}, output <= {a.output}, "
          f"{'tiny' if a.tiny else '8B'}; tokenizer {engine.tokenizer.vocab_size} tokens (trained in {trained:.1f} s); "
          f"first structured request's set-up {first_use:.2f} s")
    print(f"{'mode':6} {'tokens':>7} {'wall s':>8} {'tok/s':>9} {'tpot p50':>9} {'fill/step':>10} "
          f"{'sample/step':>12} {'step() host':>12} {'steps':>6} {'full decode':>12} {'steps':>6} {'masked rows':>12}")
    med = {}
    for mode in modes:
        runs = results[mode]
        med[mode] = m = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(f"{mode:6} {m['tokens']:7.0f} {m['wall']:8.2f} {m['tok_s']:9.1f} {m['tpot_ms']:7.2f}ms "
              f"{m['fill_ms']:8.3f}ms {m['sample_ms']:10.3f}ms {m['step_ms']:10.3f}ms {m['steps']:6.0f} "
              f"{m['decode_ms']:10.3f}ms {m['decode_steps']:6.0f} {m['masked_rows']:12.0f}")
    f = med["free"]
    for mode in modes[1:]:
        m = med[mode]
        print(f"{mode} / free: tok/s {m['tok_s'] / f['tok_s']:.3f}  tpot {m['tpot_ms'] / f['tpot_ms']:.3f}  "
              f"full-batch decode step {m['decode_ms'] / f['decode_ms']:.3f}")


if __name__ == "__main__":
    main()
