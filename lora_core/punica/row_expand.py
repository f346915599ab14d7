"""One row's LoRA expand, for kernels that fuse it into a pointwise op (lora_core/punica/pending.py).

A fused consumer (SiluAndMul, the rotary embedding, the add + RMSNorm in
replicas/kernels) adds row t's expand shrunk[t, slot(t)] @ B[slot(t)]^T to the
columns it reads, with these helpers.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lora_core.punica.triton_kernels import RANK_MASK_GROUP, rank_mask


@triton.jit
def row_slot(slots_ptr, ranks_ptr, row, slice_idx, sr_s):
    """(slot as int64, clamped to 0 for a row without an adapter; its rank for slice_idx, 0 for such a row)."""
    slot = tl.load(slots_ptr + row)
    live = tl.maximum(slot, 0)
    rank = tl.load(ranks_ptr + slice_idx * sr_s + live)
    return live.to(tl.int64), tl.where(slot >= 0, rank, 0)


@triton.jit
def row_expand(s_row, b_slot, rank, offs_n, n_mask, sb_n, BLOCK_R: tl.constexpr):
    """[BLOCK_N] float32: sum over r < rank of s_row[r] * b_slot[n, r] for n in offs_n (masked by n_mask).

    s_row: the row's shrink columns of one slice; b_slot: that slot's B at the slice's first output row;
    both unit stride along r. Rank 0 (no adapter) reads no memory and gives zeros; past the rank, up to the next
    multiple of triton_kernels.RANK_MASK_GROUP, it reads the slot's zeros (so the loads vectorize)."""
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = rank_mask(offs_r, rank, RANK_MASK_GROUP)
    s = tl.load(s_row + offs_r, mask=r_mask, other=0.0).to(tl.float32)
    w = tl.load(b_slot + offs_n[:, None].to(tl.int64) * sb_n + offs_r[None, :],
                mask=n_mask[:, None] & r_mask[None, :], other=0.0)
    return tl.sum(w.to(tl.float32) * s[None, :], axis=1)


@triton.jit
def cols_expand(s_row, b_slot, rank, cols, mask, sb_n, BLOCK_R: tl.constexpr):
    """row_expand over a 2-D block of output columns: [H, W] float32, cols [H, W] the B rows (masked by mask)."""
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = rank_mask(offs_r, rank, RANK_MASK_GROUP)
    s = tl.load(s_row + offs_r, mask=r_mask, other=0.0).to(tl.float32)
    w = tl.load(b_slot + cols[:, :, None].to(tl.int64) * sb_n + offs_r[None, None, :],
                mask=mask[:, :, None] & r_mask[None, None, :], other=0.0)
    return tl.sum(w.to(tl.float32) * s[None, None, :], axis=2)
