"""The host time one launch costs, Triton kernels against torch ops, on the sampler's shapes (CUDA only).

bench/sampler_host.py found Sampler.sample's logprobs path 0.14 ms slower on the host after its dozen torch
ops became torch.topk and two Triton launches (thirty-second session), though its GPU time fell by a third.
This times the host side alone of each call: N calls queued behind a sleep kernel that holds the GPU, so no
call waits for the GPU; per call, microseconds, p50 of --repeats:

    python bench/launch_overhead.py --rows 32 --vocab 128256

Rows: an empty Triton kernel (the floor of a Triton launch: argument binding, the cache lookup, the driver
call), token_logprobs' partials and combine kernels, the whole token_logprobs, its torch reference, and torch
ops for scale (an add, a topk, a log_softmax).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
HOLD_CYCLES = 50_000_000  # ~25 ms at 2 GHz: longer than any row's N calls take to queue


@triton.jit
def _empty_kernel(x_ptr, n, BLOCK: tl.constexpr):
    pass


def host_us(fn, calls: int, repeats: int) -> float:
    """Host microseconds per call of fn, the GPU held meanwhile."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        torch.cuda._sleep(HOLD_CYCLES)
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t) / calls * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--vocab", type=int, default=128_256)
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--repeats", type=int, default=20)
    a = p.parse_args()
    from replicas.kernels import token_logprobs as kernels
    from replicas.token_logprobs import token_logprobs, token_logprobs_reference

    logits = torch.randn(a.rows, a.vocab, device="cuda").to(torch.bfloat16)
    tokens = logits.argmax(dim=-1)
    n, vocab = logits.shape
    per_split = kernels.BLOCK * triton.cdiv(triton.cdiv(vocab, kernels.SPLITS), kernels.BLOCK)
    splits = triton.cdiv(vocab, per_split)
    slots = triton.next_power_of_2(splits)
    parts = torch.empty((n, slots, 3), dtype=torch.float32, device="cuda")
    cand_values = torch.empty((n, slots, kernels.BLOCK_K), dtype=torch.float32, device="cuda")
    cand_ids = torch.empty((n, slots, kernels.BLOCK_K), dtype=torch.int32, device="cuda")
    out = torch.empty((n, 3 + 2 * a.k), dtype=torch.float32, device="cuda")
    small = torch.zeros(16, device="cuda")

    rows = {
        "triton: empty kernel": lambda: _empty_kernel[(1,)](small, 16, BLOCK=16),
        "triton: partials": lambda: kernels._partials_kernel[(n, splits)](
            logits, tokens, parts, cand_values, cand_ids, vocab, logits.stride(0), per_split, a.k,
            SPLIT_SLOTS=slots, BLOCK_K=kernels.BLOCK_K, BLOCK=kernels.BLOCK, num_warps=8),
        "triton: combine": lambda: kernels._combine_kernel[(n,)](
            logits, tokens, parts, cand_values, cand_ids, out, logits.stride(0), splits, a.k, SPLIT_SLOTS=slots,
            BLOCK_K=kernels.BLOCK_K, num_warps=1),
        "token_logprobs (2 launches)": lambda: token_logprobs(logits, tokens, a.k),
        "token_logprobs_reference (torch)": lambda: token_logprobs_reference(logits.float(), tokens, a.k),
        "torch: add": lambda: small.add(1.0),
        "torch: topk": lambda: logits.topk(a.k, dim=-1),
        "torch: log_softmax": lambda: logits.log_softmax(dim=-1),
    }
    floor = None
    print(f"host us per call, {a.rows} x {a.vocab} bf16 logits, k {a.k}, p50 of {a.repeats} x {a.calls} calls")
    for name, fn in rows.items():
        us = host_us(fn, a.calls, a.repeats)
        floor = floor or us
        print(f"{name:38} {us:8.1f}  x empty {us / floor:5.2f}")


if __name__ == "__main__":
    main()
