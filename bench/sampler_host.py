"""What one Sampler.sample call costs the host and the GPU, per sampling setting, side by side.

With async scheduling the sampler's host time is spent while the GPU runs the step, so on a small model
(whose step is short) it can set the pace; its GPU time adds to every step. bench/sampling_settings.py sees
both through a whole engine; this times the call alone, on the logits of one decode step (rows x vocab,
bf16 as the model writes them), each sequence with `--outputs` tokens generated (what the penalties read)
and, as in the engine, each call's tokens appended to its outputs:

    python bench/sampler_host.py --rows 32 --vocab 128256

Prints, per setting (bench/sampling_settings.py's SETTINGS): the host time of the call (p50 over --iters,
nothing waited for after it), the GPU time of its kernels (CUDA events around the call, p50: a sleep kernel
queued first holds the GPU until the host has queued them all, so launch gaps do not count), and each one's
ratio to greedy. On CPU (--device cpu) the host time includes the work.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.sampling_settings import SETTINGS  # noqa: E402
from replicas.sampler import Sampler  # noqa: E402
from replicas.sampling_params import SamplingParams  # noqa: E402
from replicas.sequence import Sequence  # noqa: E402


def sequences(setting: str, rows: int, prompt: int, outputs: int) -> list[Sequence]:
    seqs = []
    for i in range(rows):
        seq = Sequence(f"r{i}", list(range(3, 3 + prompt)),
                       SamplingParams(max_tokens=outputs + 1_000, ignore_eos=True, seed=i, **SETTINGS[setting]))
        seq.output_token_ids = list(range(5, 5 + outputs))
        seqs.append(seq)
    return seqs


# ~10 ms at 2 GHz: longer than any setting's host time, so the GPU starts the call's kernels once all are queued
HOLD_CYCLES = 20_000_000


def time_setting(sampler: Sampler, logits: torch.Tensor, seqs: list[Sequence], iters: int) -> dict[str, float]:
    cuda = logits.is_cuda
    host, gpu = [], []
    for i in range(iters + 5):  # the first few build kernels and caches
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(HOLD_CYCLES)
            start.record()
        t = time.perf_counter()
        out = sampler.sample(logits, seqs)
        spent = time.perf_counter() - t
        if cuda:
            end.record()
            end.synchronize()
        out.logprobs  # noqa: B018 - read back, as the engine does
        for seq, token in zip(seqs, out.token_ids.tolist()):  # and appended: the penalties' counts follow them
            seq.append_token(token)
        if i >= 5:
            host.append(spent * 1e3)
            gpu.append(start.elapsed_time(end) if cuda else 0.0)
    return {"host_ms": statistics.median(host), "gpu_ms": statistics.median(gpu)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--vocab", type=int, default=128_256)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--outputs", type=int, default=64, help="tokens each sequence has generated")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated, from: " + ", ".join(SETTINGS))
    a = p.parse_args()
    names = a.settings.split(",")
    if set(names) - set(SETTINGS) or "greedy" not in names:
        p.error(f"settings from {', '.join(SETTINGS)}, greedy (the baseline) among them")
    logits = torch.randn(a.rows, a.vocab, generator=torch.Generator().manual_seed(0)).to(a.device, torch.bfloat16)
    sampler = Sampler()
    results = {n: time_setting(sampler, logits, sequences(n, a.rows, a.prompt, a.outputs), a.iters) for n in names}
    g = results["greedy"]
    print(f"Sampler.sample on {a.device}: {a.rows} rows x {a.vocab} vocab, {a.outputs} tokens generated, "
          f"p50 of {a.iters} calls")
    print(f"{'setting':10} {'host ms':>8} {'gpu ms':>8} {'x greedy host':>14} {'x greedy gpu':>13}")
    for name in names:
        r = results[name]
        gpu_ratio = f"{r['gpu_ms'] / g['gpu_ms']:13.2f}" if g["gpu_ms"] else f"{'-':>13}"
        print(f"{name:10} {r['host_ms']:8.3f} {r['gpu_ms']:8.3f} {r['host_ms'] / g['host_ms']:14.2f} {gpu_ratio}")


if __name__ == "__main__":
    main()
