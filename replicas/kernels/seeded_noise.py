"""Seeded rows' Exp(1) noise in one launch: replicas/seeded_noise.py's hash, in uint32 arithmetic.

exponentials(pairs [N, 2] int64, width) -> q [N, width] float32 equals
replicas.seeded_noise.exponentials_reference: the same integers (uint32 products wrap mod 2^32 as the
reference's masked int64 ones), then -log of the same float32 u (libdevice's log on CUDA, numpy's in the
interpreter, within an ulp of torch's). No host read-back, a grid from shapes only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replicas import seeded_noise

BLOCK = 1024
MIX1: tl.constexpr = tl.constexpr(seeded_noise.MIX1)  # a kernel reads module globals only as constexprs
MIX2: tl.constexpr = tl.constexpr(seeded_noise.MIX2)


@triton.jit
def _mix(x):
    x = x ^ (x >> 16)
    x = x * MIX1
    x = x ^ (x >> 15)
    x = x * MIX2
    return x ^ (x >> 15)


@triton.jit
def exp_noise(cols, low, high):
    """q = -log(u) of columns `cols` (uint32) for the key (low, high): the reference's noise, for any kernel
    that draws (replicas/kernels/candidate_draw.py too)."""
    h = _mix(_mix(cols + low) ^ high)
    u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
    return -tl.log(u)


@triton.jit
def _exponentials_kernel(pairs_ptr, out_ptr, width, out_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    low = tl.load(pairs_ptr + row * 2).to(tl.uint32)
    high = tl.load(pairs_ptr + row * 2 + 1).to(tl.uint32)
    tl.store(out_ptr + row * out_stride + cols, exp_noise(cols.to(tl.uint32), low, high), mask=cols < width)


def exponentials(pairs: torch.Tensor, width: int) -> torch.Tensor:
    out = torch.empty((pairs.shape[0], width), dtype=torch.float32, device=pairs.device)
    if pairs.shape[0] and width:
        _exponentials_kernel[(pairs.shape[0], triton.cdiv(width, BLOCK))](pairs, out, width, out.stride(0),
                                                                          BLOCK=BLOCK)
    return out
