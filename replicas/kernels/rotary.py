"""The rotary embedding (neox rotate-half) in one Triton launch, on CUDA; with qkv_proj's pending LoRA expand
folded in: replicas/kernels/lora_rotary.py.

    rotary(positions [T], q [T, Hq*D], k [T, Hk*D], inv_freq, D, ...) -> (q', k'), new tensors
        (replicas.layers.rotary.RotaryEmbedding.forward_native)

cos and sin of positions x inv_freq are computed in float32 (libdevice on CUDA, as torch's own kernels) and
rounded to q's dtype before the multiply, each product rounded as the torch code rounds it, so the outputs
match it up to ~1 ulp of the libm. Options, each a constexpr so a model without it compiles none of it:
  - a head's first rotary_dim dimensions turn and the rest pass through (Phi-4-mini: 96 of 128), copied;
  - cos and sin times cos_sin_factor before the rounding (longrope's attention factor on a partly turned head:
    the attention scale cannot take it there, the passed dimensions must stay unscaled);
  - two rows of frequencies (longrope's short and long factors): rope_freqs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replicas.kernels.fused import _cos, _launch_opts, _rows, _sin
from replicas.rope_config import LONG_ROPE, NEVER_LONG

LONG_ROPE_OFFSET: tl.constexpr = tl.constexpr(LONG_ROPE)  # a kernel reads module globals only as constexprs


@triton.jit
def rope_cos_sin(pos_ptr, tok, inv_freq_ptr, long_from, factor, dtype: tl.constexpr, HALF: tl.constexpr,
                 BLOCK_HALF: tl.constexpr, PRECISE: tl.constexpr, TWO_SETS: tl.constexpr, SCALED: tl.constexpr):
    """Token tok's cos and sin [1, BLOCK_HALF], rounded to dtype (held as float32). TWO_SETS (longrope):
    inv_freq's second row at or past long_from, and for a position encoded as p + LONG_ROPE
    (replicas/layers/rotary.py); a constexpr, as the choice cost every other model's rotary 0.1-0.2 us a
    launch (H200, bench/fused_ops.py). SCALED: both times factor first."""
    offs = tl.arange(0, BLOCK_HALF)
    pos = tl.load(pos_ptr + tok)
    row = 0
    if TWO_SETS:
        row = (pos >= long_from).to(tl.int32)
        pos = tl.where(pos >= LONG_ROPE_OFFSET, pos - LONG_ROPE_OFFSET, pos)
    freqs = pos.to(tl.float32) * tl.load(inv_freq_ptr + row * HALF + offs, mask=offs < HALF, other=0.0)
    cos = _cos(freqs, PRECISE)
    sin = _sin(freqs, PRECISE)
    if SCALED:
        cos = cos * factor
        sin = sin * factor
    return cos.to(dtype).to(tl.float32)[None, :], sin.to(dtype).to(tl.float32)[None, :]


@triton.jit
def turn(x1, x2, cos, sin):
    """(x1 cos - x2 sin, x2 cos + x1 sin) in x1's dtype, every product rounded to it as torch rounds it."""
    dtype = x1.dtype
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    o1 = (f1 * cos).to(dtype).to(tl.float32) + (-f2 * sin).to(dtype).to(tl.float32)
    o2 = (f2 * cos).to(dtype).to(tl.float32) + (f1 * sin).to(dtype).to(tl.float32)
    return o1.to(dtype), o2.to(dtype)


@triton.jit
def _rotate_heads(in_row, out_row, head0, num_heads, cos, sin, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                  BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_PASS: tl.constexpr):
    """Heads head0.. of one token: the first 2 * HALF dimensions turned, the rest (BLOCK_PASS > 0) copied."""
    heads = head0 + tl.arange(0, BLOCK_H)
    offs = tl.arange(0, BLOCK_HALF)
    mask = (heads < num_heads)[:, None] & (offs < HALF)[None, :]
    idx = heads[:, None] * HEAD_DIM + offs[None, :]
    o1, o2 = turn(tl.load(in_row + idx, mask=mask, other=0.0), tl.load(in_row + idx + HALF, mask=mask, other=0.0),
                  cos, sin)
    tl.store(out_row + idx, o1, mask=mask)
    tl.store(out_row + idx + HALF, o2, mask=mask)
    if BLOCK_PASS > 0:
        cols = 2 * HALF + tl.arange(0, BLOCK_PASS)
        passed = (heads < num_heads)[:, None] & (cols < HEAD_DIM)[None, :]
        at = heads[:, None] * HEAD_DIM + cols[None, :]
        tl.store(out_row + at, tl.load(in_row + at, mask=passed), mask=passed)


@triton.jit
def _rotary_kernel(pos_ptr, inv_freq_ptr, long_from, factor, q_ptr, k_ptr, q_out_ptr, k_out_ptr, num_q_heads,
                   num_k_heads, sq, sk, sqo, sko,
                   HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr, Q_PROGRAMS: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_PASS: tl.constexpr, PRECISE: tl.constexpr, TWO_SETS: tl.constexpr,
                   SCALED: tl.constexpr):
    """Program (t, j) rotates BLOCK_H heads of token t: q heads for j < Q_PROGRAMS, then k heads."""
    tok = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    cos, sin = rope_cos_sin(pos_ptr, tok, inv_freq_ptr, long_from, factor, q_ptr.dtype.element_ty, HALF,
                            BLOCK_HALF, PRECISE, TWO_SETS, SCALED)
    if j < Q_PROGRAMS:
        _rotate_heads(q_ptr + tok * sq, q_out_ptr + tok * sqo, j * BLOCK_H, num_q_heads, cos, sin,
                      HALF, BLOCK_HALF, BLOCK_H, HEAD_DIM, BLOCK_PASS)
    else:
        _rotate_heads(k_ptr + tok * sk, k_out_ptr + tok * sko, (j - Q_PROGRAMS) * BLOCK_H, num_k_heads, cos, sin,
                      HALF, BLOCK_HALF, BLOCK_H, HEAD_DIM, BLOCK_PASS)


def rotated_like(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """New (q', k') for a rotary kernel's outputs: q's and k's shapes, contiguous (q and k may be views)."""
    return (torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype, device=k.device))


def rope_launch_args(inv_freq: torch.Tensor, head_dim: int, long_from: int, rotary_dim: int | None,
                     cos_sin_factor: float) -> tuple[tuple, dict]:
    """(the frequency arguments, the shape and option constexprs) both kernels take."""
    rotary_dim = rotary_dim or head_dim
    half, passed = rotary_dim // 2, head_dim - rotary_dim
    if inv_freq.shape[-1] != half:
        raise ValueError(f"inv_freq has {inv_freq.shape[-1]} frequencies for {rotary_dim} turned dimensions")
    consts = dict(HALF=half, BLOCK_HALF=triton.next_power_of_2(half), HEAD_DIM=head_dim,
                  BLOCK_PASS=triton.next_power_of_2(passed) if passed else 0, TWO_SETS=inv_freq.dim() == 2,
                  SCALED=cos_sin_factor != 1.0)
    return (inv_freq.float().contiguous(), long_from, float(cos_sin_factor)), consts


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, inv_freq: torch.Tensor, head_dim: int,
           long_from: int = NEVER_LONG, rotary_dim: int | None = None,
           cos_sin_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T], q [T, Hq*head_dim], k [T, Hk*head_dim] (row strides free, e.g. views of a packed qkv),
    inv_freq [rotary_dim/2] float32 (or [2, rotary_dim/2] with long_from: rope_cos_sin) -> new (q', k') of q's
    and k's shapes. rotary_dim: the dimensions of a head that turn (None: all)."""
    if k.dtype != q.dtype:
        raise ValueError(f"q is {q.dtype} but k is {k.dtype}")
    num_tokens = positions.numel()
    q2, k2 = _rows(q.reshape(num_tokens, -1)), _rows(k.reshape(num_tokens, -1))
    q_out, k_out = rotated_like(q, k)
    if num_tokens == 0:
        return q_out, k_out
    freq_args, consts = rope_launch_args(inv_freq, head_dim, long_from, rotary_dim, cos_sin_factor)
    num_q_heads, num_k_heads = q2.shape[1] // head_dim, k2.shape[1] // head_dim
    block_h = max(1, min(triton.next_power_of_2(max(num_q_heads, num_k_heads)), 256 // consts["BLOCK_HALF"]))
    q_programs = triton.cdiv(num_q_heads, block_h)
    grid = (num_tokens, q_programs + triton.cdiv(num_k_heads, block_h))
    _rotary_kernel[grid](
        positions.reshape(-1), *freq_args, q2, k2, q_out, k_out, num_q_heads, num_k_heads,
        q2.stride(0), k2.stride(0), q2.shape[1], k2.shape[1],
        BLOCK_H=block_h, Q_PROGRAMS=q_programs, PRECISE=q.is_cuda, **consts, num_warps=2, **_launch_opts(q))
    return q_out, k_out
