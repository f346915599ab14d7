"""Rotary embedding that first adds qkv_proj's pending LoRA expand (lora_core/punica/pending.py), on CUDA.

rotary_lora(positions, q, k, v, inv_freq, head_dim, lora) is rotary.rotary of
q and k after lora.apply() (the expand into the qkv output q, k, v are views of),
in one launch: program (t, j) adds row t's expand to BLOCK_H heads of q, k or v
(v in place, q and k into the rotated outputs), reading the row's B columns for
them, each sum rounded to the activation dtype as the expand kernel stores it.
It replaces the qkv expand kernel of a stacked decode step, whose few
microseconds are mostly one more dependent launch (bench/pending_expand.py
--site qkv).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lora_core.punica.pending import PendingExpand
from lora_core.punica.row_expand import cols_expand, row_slot
from replicas.kernels.fused import _launch_opts, _row_inv, _scale_args, _scale_consts
from replicas.kernels.rotary import NEVER_LONG, rope_cos_sin, rope_launch_args, rotated_like, turn
from replicas.layers.row_scale import RowScale

# heads per program: each holds [heads, head_dim, R] of B. 1 saved the most on an H100 (8B qkv, 32 rows over 1-32
# adapters: 2.1-2.6 us per site against 1.6-2.2 with 2 heads and 0.9-1.6 with 4; bench/pending_expand.py --sites qkv)
LORA_ROTARY_HEADS = 1
LORA_ROTARY_WARPS = 4


@triton.jit
def _with_delta(row, cols, b_cols, mask, s_row, b_slot, rank, sb_n, BLOCK_R: tl.constexpr):
    """row[cols] plus the row's expand over B rows b_cols, rounded to the dtype as the expand kernel stores it."""
    x = tl.load(row + cols, mask=mask, other=0.0)
    return (x.to(tl.float32) + cols_expand(s_row, b_slot, rank, b_cols, mask, sb_n, BLOCK_R)).to(x.dtype)


@triton.jit
def _rotary_lora_kernel(pos_ptr, inv_freq_ptr, long_from, factor, y_ptr, q_out_ptr, k_out_ptr, num_q_heads,
                        num_k_heads, sy, sqo, sko,
                        slots_ptr, s_ptr, b_ptr, ranks_ptr, ss_t, ss_l, sb_l, sb_n, sr_s, s_slice,
                        part_ptr, sp, eps, inv_n,
                        HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                        Q_PROGRAMS: tl.constexpr, K_PROGRAMS: tl.constexpr, BLOCK_R: tl.constexpr,
                        PRECISE: tl.constexpr, CHUNKS: tl.constexpr, BLOCK_P: tl.constexpr, HEAD_DIM: tl.constexpr,
                        BLOCK_PASS: tl.constexpr, TWO_SETS: tl.constexpr, SCALED: tl.constexpr):
    """y [T, (Hq + 2 Hk) * D] = [q | k | v]. Program (t, j): BLOCK_H heads of q (j < Q_PROGRAMS), of k, then of v.
    CHUNKS > 0: a RowScale's factor after the expand (v's part too), rounded as RowScale.apply_ rounds it.
    A head's first 2 * HALF dimensions turn; the rest (BLOCK_PASS > 0) take the expand and the scale only."""
    tok = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    is_q = j < Q_PROGRAMS
    is_k = (j >= Q_PROGRAMS) & (j < Q_PROGRAMS + K_PROGRAMS)
    part = tl.where(is_q, 0, tl.where(is_k, 1, 2))  # the expand's slice: q, k, v
    head0 = (j - tl.where(is_q, 0, tl.where(is_k, Q_PROGRAMS, Q_PROGRAMS + K_PROGRAMS))) * BLOCK_H
    num_heads = tl.where(is_q, num_q_heads, num_k_heads)
    col0 = tl.where(is_q, 0, tl.where(is_k, num_q_heads, num_q_heads + num_k_heads)) * HEAD_DIM
    slot, rank = row_slot(slots_ptr, ranks_ptr, tok, part, sr_s)
    s_row, b_slot = s_ptr + tok * ss_t + slot * ss_l + part * s_slice, b_ptr + slot * sb_l
    offs = tl.arange(0, BLOCK_HALF)
    heads = head0 + tl.arange(0, BLOCK_H)
    mask = (heads < num_heads)[:, None] & (offs < HALF)[None, :]
    idx = heads[:, None] * HEAD_DIM + offs[None, :]  # within the slice
    y_row = y_ptr + tok * sy + col0
    x1 = _with_delta(y_row, idx, col0 + idx, mask, s_row, b_slot, rank, sb_n, BLOCK_R)
    x2 = _with_delta(y_row, idx + HALF, col0 + idx + HALF, mask, s_row, b_slot, rank, sb_n, BLOCK_R)
    inv = 1.0
    if CHUNKS > 0:
        inv = _row_inv(part_ptr, tok, sp, eps, inv_n, CHUNKS, BLOCK_P, PRECISE)
        x1 = (x1.to(tl.float32) * inv).to(x1.dtype)
        x2 = (x2.to(tl.float32) * inv).to(x2.dtype)
    if part == 2:  # v: the expand only, in place
        tl.store(y_row + idx, x1, mask=mask)
        tl.store(y_row + idx + HALF, x2, mask=mask)
    else:
        cos, sin = rope_cos_sin(pos_ptr, tok, inv_freq_ptr, long_from, factor, x1.dtype, HALF, BLOCK_HALF, PRECISE,
                                TWO_SETS, SCALED)
        o1, o2 = turn(x1, x2, cos, sin)
        if part == 0:
            tl.store(q_out_ptr + tok * sqo + idx, o1, mask=mask)
            tl.store(q_out_ptr + tok * sqo + idx + HALF, o2, mask=mask)
        else:
            tl.store(k_out_ptr + tok * sko + idx, o1, mask=mask)
            tl.store(k_out_ptr + tok * sko + idx + HALF, o2, mask=mask)
    if BLOCK_PASS > 0:  # the dimensions that do not turn: expanded (and scaled), into place (v) or the output
        cols = 2 * HALF + tl.arange(0, BLOCK_PASS)
        passed = (heads < num_heads)[:, None] & (cols < HEAD_DIM)[None, :]
        at = heads[:, None] * HEAD_DIM + cols[None, :]
        xp = _with_delta(y_row, at, col0 + at, passed, s_row, b_slot, rank, sb_n, BLOCK_R)
        if CHUNKS > 0:
            xp = (xp.to(tl.float32) * inv).to(xp.dtype)
        if part == 0:
            tl.store(q_out_ptr + tok * sqo + at, xp, mask=passed)
        elif part == 1:
            tl.store(k_out_ptr + tok * sko + at, xp, mask=passed)
        else:
            tl.store(y_row + at, xp, mask=passed)


def fusable(lora: PendingExpand, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether rotary_lora can take this expand for these q, k, v: 2-D views of its output y = [q | k | v]
    (unit stride along columns), its three slices their widths."""
    return (lora.y.dim() == 2 and lora.y.stride(1) == 1 and lora.splits_y((q, k, v))
            and lora.fusable((q.shape[-1], k.shape[-1], v.shape[-1])))


def rotary_lora(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inv_freq: torch.Tensor,
                head_dim: int, lora: PendingExpand, row_scale: RowScale | None = None, long_from: int = NEVER_LONG,
                rotary_dim: int | None = None, cos_sin_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq*D], k, v [T, Hk*D], views of lora.y (fusable) -> new rotated (q', k') with lora's expand added
    first, as rotary.rotary (its long_from, rotary_dim, cos_sin_factor) after lora.apply() (and
    row_scale.apply_(q, k, v), if given); v gets both in place."""
    if not fusable(lora, q, k, v):
        raise ValueError(f"rotary_lora takes the q, k, v views of the output a three-slice expand is owed to, got "
                         f"slices {lora.output_slices} for q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    num_tokens = positions.numel()
    q_out, k_out = rotated_like(q, k)
    if num_tokens == 0:
        return q_out, k_out
    freq_args, consts = rope_launch_args(inv_freq, head_dim, long_from, rotary_dim, cos_sin_factor)
    num_q_heads, num_k_heads = q.shape[1] // head_dim, k.shape[1] // head_dim
    block_h = LORA_ROTARY_HEADS
    q_programs, k_programs = triton.cdiv(num_q_heads, block_h), triton.cdiv(num_k_heads, block_h)
    _rotary_lora_kernel[(num_tokens, q_programs + 2 * k_programs)](
        positions.reshape(-1), *freq_args, lora.y, q_out, k_out, num_q_heads, num_k_heads,
        lora.y.stride(0), q_out.stride(0), k_out.stride(0), *lora.kernel_args(), *_scale_args(row_scale, lora.y),
        BLOCK_H=block_h, Q_PROGRAMS=q_programs, K_PROGRAMS=k_programs,
        BLOCK_R=max(16, triton.next_power_of_2(lora.slice_rank)), PRECISE=q.is_cuda, **consts,
        **_scale_consts(row_scale), num_warps=LORA_ROTARY_WARPS, **_launch_opts(q))
    return q_out, k_out
