"""Sampling noise from a counter-based hash: one launch for every row of a step, seeded or not.

Why: the sampler draws argmax(p / q) with q ~ Exp(1) (replicas/sampler.py), and a request with a seed must
draw the same tokens whatever shares its batch. Each seeded row drew its q from a torch.Generator of its
own: one call, with its Python and launch cost, per row and step. On the 1B shape, whose decode step takes
~1.7 ms, 32 seeded rows made random sampling cost 1.9 x a greedy step (bench/sampling_settings.py). Here q is a
function of (seed, the draw's number, the column): the host
turns each row's (seed, draw) into a 64-bit key, and one kernel hashes every (key, column) pair of the step.
Neighbours cannot change a row's noise, and CPU and GPU draw the same noise for a seed. A row without a
seed hashes a fresh random key the same way (replicas/sampler.py), so every row of a step shares one launch;
the draws that fuse it (replicas/kernels/candidate_draw.py, nucleus_draw.py) compute it in place.

    q[i, j] = -log(u),  u = ((h >> 8) + 0.5) / 2^24,  h = mix(mix((j + a_i) mod 2^32) xor b_i)

with a_i, b_i the key's low and high 32 bits and mix a 32-bit integer hash (xor-shift-multiply rounds,
both multipliers below 2^31, so the reference's int64 products cannot overflow). u takes 24 bits: exact in
float32, never 0 or 1. The torch code here is the reference and the CPU path; CUDA runs the Triton kernel
in replicas/kernels/seeded_noise.py, which computes the same integers.
"""

from __future__ import annotations

import torch

M32, M64 = (1 << 32) - 1, (1 << 64) - 1
MIX1, MIX2 = 0x21F0AAAD, 0x735A2D97


def row_key(seed: int, draw: int) -> int:
    """The 64-bit key of a request's draw number `draw` (splitmix64's finalizer over seed and draw)."""
    x = (seed * 0x9E3779B97F4A7C15 + (draw + 1) * 0xD1B54A32D192ED03) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def key_pairs(keys: list[int]) -> list[list[int]]:
    """Each key as [low 32 bits, high 32 bits] (what the kernels read, as int64)."""
    return [[k & M32, k >> 32] for k in keys]


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = (x * MIX1) & M32
    x = x ^ (x >> 15)
    x = (x * MIX2) & M32
    return x ^ (x >> 15)


def exponentials_reference(pairs: torch.Tensor, width: int) -> torch.Tensor:
    """pairs [N, 2] int64 (key_pairs) -> q [N, width] float32, Exp(1) noise."""
    cols = torch.arange(width, dtype=torch.int64, device=pairs.device).unsqueeze(0)
    h = _mix(_mix((cols + pairs[:, :1]) & M32) ^ pairs[:, 1:])
    u = ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    return -torch.log(u)


def exponentials(pairs: torch.Tensor, width: int) -> torch.Tensor:
    """exponentials_reference's noise, by the Triton kernel on CUDA."""
    if pairs.is_cuda:
        from replicas.kernels.seeded_noise import exponentials as kernel  # triton: CUDA only here

        return kernel(pairs, width)
    return exponentials_reference(pairs, width)
