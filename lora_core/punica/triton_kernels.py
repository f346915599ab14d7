"""Punica Triton kernels: multi-slice SGMV shrink and expand over slot-sorted tiles.

Each program owns one M-tile (up to BLOCK_M tokens of ONE adapter slot, see
metadata.py), so an adapter's weights are read once per tile instead of once
per token, and decode batches where every token has its own adapter reduce to
BGMV (one token per tile). Rows of A and columns of B past the slot's real
rank are masked (B's to the next multiple of RANK_MASK_GROUP ranks, see
rank_mask), so a low-rank adapter in a slot sized for max_lora_rank costs
almost no extra bandwidth. Only Triton features present in 3.0 are used.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

# Ranks a rank mask covers at a time (rank_mask): 8 lets bf16 loads along the rank, B's contiguous axis, take
# 16 bytes at once (H200, bench/punica_kernels.py: gate_up rank 64, T = 64 distinct 147.5 -> 103.6 us). Env
# LORAFLEET_RANK_MASK_GROUP=1 masks each rank exactly (for A/B runs).
RANK_MASK_GROUP = tl.constexpr(int(os.environ.get("LORAFLEET_RANK_MASK_GROUP", "8")))


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    # float32 inputs get true float32 products: Triton's default for them is TF32.
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _tile(tile_lora_ptr, tile_start_ptr, tile_end_ptr, tile):
    # Three independent loads issued together: on a cold L2 every extra level
    # of dependent loads costs a DRAM round trip, which is most of a decode op.
    return tl.load(tile_lora_ptr + tile), tl.load(tile_start_ptr + tile), tl.load(tile_end_ptr + tile)


@triton.jit
def _deal(num_tiles, per_tile, num_slices, plane, target, cap):
    """Programs per real tile: at least the host's per_tile (planned for the worst-case tile count),
    more when few tiles are real, towards target programs per launch (at most cap, and never more
    than the (tile, per-tile) plane of the grid holds)."""
    n = tl.maximum(num_tiles, 1)
    wanted = tl.minimum(tl.cdiv(target, n * num_slices), cap)
    return tl.maximum(1, tl.minimum(plane // n, tl.maximum(per_tile, wanted)))


@triton.jit
def _pdl_wait(USE_PDL: tl.constexpr):
    """A shrink launched under programmatic dependent launch waits here for the kernel before it (the
    base GEMM, or whatever wrote x). Every program waits, also those that exit early: the shrink must
    not complete before that kernel has, since the expand it triggers reads y after waiting for it."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()


# _UNTARGETED: an expand program whose adapter has rank 0 on its slice (it does not target the module) leaves
# before reading B or y when the expand only adds: e.g. the LM head's expand over the whole vocabulary, run
# whenever a step has adapters, is a no-op unless one of them targets lm_head (8B, 32 rows: ~35 us per step).
# Under PDL it still waits, so the kernel never completes before the shrink it follows.


@triton.jit
def rank_mask(offs_r, rank, GROUP: tl.constexpr):
    """offs_r < rank, rounded up to a multiple of GROUP: a mask constant over GROUP ranks, so that loads along
    the rank (B's and the shrink partials' contiguous axis) vectorize; a mask that changes at every rank kept
    them to one element each. Sound because both operands are zero past each rank: slot images are
    (model_manager, host_adapter) and the shrinks write their whole width, zeros past the rank."""
    return offs_r // GROUP < (rank + GROUP - 1) // GROUP


@triton.jit
def _tile_tokens(sorted_ptr, start, end, BLOCK_M: tl.constexpr):
    offs = start + tl.arange(0, BLOCK_M)
    m_mask = offs < end
    tok = tl.load(sorted_ptr + offs, mask=m_mask, other=0)
    return tok, m_mask


@triton.jit
def shrink_kernel(
    x_ptr, a_ptr, out_ptr, ranks_ptr,
    sorted_ptr, tile_lora_ptr, tile_start_ptr, tile_end_ptr, num_tiles_ptr,
    K, scale, split_cap, target,
    sx_t, sx_k,
    sa_s, sa_l, sa_r, sa_k,
    so_split, so_s, so_t, so_r,
    sr_s,
    R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    ACCUMULATE: tl.constexpr, USE_PDL: tl.constexpr, IEEE: tl.constexpr, PREFETCH_A: tl.constexpr,
):
    """out[split, s, tok, :R] (+)= scale * x[tok, k-range] @ A[s, slot, :rank, k-range]^T.

    The grid's first two axes form a plane of (tile, split) programs sized on
    the host for the worst case of tiles (every slot in use). The real tile
    count is only known on the device (metadata.py), so the programs are
    dealt out there (_deal): with few real tiles each gets more K splits (at
    most split_cap, out's first axis), and the rest of the plane exits. No
    host value changes with the popularity, so one CUDA graph serves all.
    """
    if USE_PDL:
        # Let the expand launch now: it loads everything but our output while we run.
        tl.extra.cuda.gdc_launch_dependents()
    num_tiles = tl.load(num_tiles_ptr)
    split_k = _deal(num_tiles, tl.num_programs(1), tl.num_programs(2), tl.num_programs(0) * tl.num_programs(1),
                    target, split_cap)
    pid = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    if pid >= num_tiles * split_k:
        _pdl_wait(USE_PDL)
        return
    tile = pid // split_k
    split = pid % split_k
    s = tl.program_id(2)
    lora, start, end = _tile(tile_lora_ptr, tile_start_ptr, tile_end_ptr, tile)
    if lora < 0:
        _pdl_wait(USE_PDL)
        return
    tok, m_mask = _tile_tokens(sorted_ptr, start, end, BLOCK_M)
    # ranks hold the adapter's full rank; a fully-sharded A holds only R rows of it.
    rank = tl.minimum(tl.load(ranks_ptr + s * sr_s + lora), R)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    k_chunk = tl.cdiv(tl.cdiv(K, split_k), BLOCK_K) * BLOCK_K
    k_lo = split * k_chunk
    k_hi = tl.minimum(k_lo + k_chunk, K)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    x_rows = x_ptr + tok[:, None].to(tl.int64) * sx_t
    a_rows = a_ptr + s.to(tl.int64) * sa_s + lora.to(tl.int64) * sa_l + offs_r[None, :] * sa_r
    # Launched under the previous kernel (PDL): the metadata (and, for one or two K steps, the first
    # A tile: as in the BGMV shrink, peeling a longer loop costs more than it saves) are read before
    # waiting for it, x (which it may have written) after.
    if PREFETCH_A:
        offs_k = k_lo + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_hi
        at = tl.load(a_rows + offs_k[:, None] * sa_k, mask=k_mask[:, None] & r_mask[None, :], other=0.0)
        _pdl_wait(USE_PDL)
        if rank > 0:
            xt = tl.load(x_rows + offs_k[None, :] * sx_k, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            acc += _dot(xt, at, IEEE)
        k_first = k_lo + BLOCK_K
    else:
        _pdl_wait(USE_PDL)
        k_first = k_lo
    if rank > 0:
        for k in range(k_first, k_hi, BLOCK_K):
            offs_k = k + tl.arange(0, BLOCK_K)
            k_mask = offs_k < k_hi
            xt = tl.load(x_rows + offs_k[None, :] * sx_k, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            at = tl.load(a_rows + offs_k[:, None] * sa_k, mask=k_mask[:, None] & r_mask[None, :], other=0.0)
            acc += _dot(xt, at, IEEE)
    acc = acc * scale
    out_ptrs = (out_ptr + split * so_split + s * so_s + tok[:, None].to(tl.int64) * so_t
                + offs_r[None, :] * so_r)
    o_mask = m_mask[:, None] & (offs_r[None, :] < R)
    if ACCUMULATE:
        acc += tl.load(out_ptrs, mask=o_mask, other=0.0)
    tl.store(out_ptrs, acc, mask=o_mask)


@triton.jit
def _zero_base_rows(y_ptr, sorted_ptr, tile_start_ptr, num_tiles, num_rows, block, y_col_offset, n_lo, n_hi, n_per_prog,
                    sy_t, sy_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Zeros to block `block` of the rows with no adapter, over this program's column chunk of one slice.

    Slot -1 sorts first, so those rows are sorted_idx[:n] with n the first real tile's start (every row
    when no tile is real)."""
    n_base = tl.where(num_tiles > 0, tl.load(tile_start_ptr), num_rows)
    start = block * BLOCK_M
    if start >= n_base:
        return
    tok, m_mask = _tile_tokens(sorted_ptr, start, n_base, BLOCK_M)
    n_begin = n_lo + tl.program_id(1) * n_per_prog
    n_end = tl.minimum(n_begin + n_per_prog, n_hi)
    y_rows = y_ptr + tok[:, None].to(tl.int64) * sy_t
    zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=y_ptr.dtype.element_ty)
    for n in range(n_begin, n_end, BLOCK_N):
        offs_n = n + tl.arange(0, BLOCK_N)
        mask = m_mask[:, None] & (offs_n < n_end)[None, :]
        tl.store(y_rows + (y_col_offset + offs_n[None, :]) * sy_n, zeros, mask=mask)


@triton.jit
def expand_kernel(
    buf_ptr, b_ptr, y_ptr, ranks_ptr, slice_off_ptr, bias_ptr,
    sorted_ptr, tile_lora_ptr, tile_start_ptr, tile_end_ptr, num_tiles_ptr,
    y_col_offset, shrink_splits, split_cap, shrink_target, n_blocks, target, planned_tiles, num_rows,
    sb_split, sb_s, sb_t, sb_r, sb_l,
    sw_l, sw_n, sw_r,
    sy_t, sy_n,
    sr_s, sbias_l,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    HAS_BIAS: tl.constexpr, ADD_INPUTS: tl.constexpr, USE_PDL: tl.constexpr,
    IEEE: tl.constexpr, ZERO_BASE: tl.constexpr, RANK_GROUP: tl.constexpr,
):
    """y[tok, off + n] (+)= sum_split buf[split, s, tok, :rank] @ B[slot, n, :rank]^T (+ bias).

    As in the shrink, the (tile, chunk) plane of programs (planned_tiles x the
    grid's second axis) is dealt out over the real tiles on the device: each
    real tile's n_blocks column blocks split into chunks, a program streaming
    its chunk's B tiles in BLOCK_N steps after one metadata look-up. The
    shrink's split count is dealt again from its launch (shrink_splits per
    tile, split_cap; both 1 when buf holds one partial, as from add_expand).
    ZERO_BASE: the grid's first axis holds cdiv(num_rows, BLOCK_M) more
    programs, which write zeros to the rows with no adapter, so that y holds
    the whole delta for a base GEMM to add into (PunicaWrapper.lora_linear).
    """
    num_tiles = tl.load(num_tiles_ptr)
    num_slices = tl.num_programs(2)
    s = tl.program_id(2)
    n_lo = tl.load(slice_off_ptr + s)
    n_hi = tl.load(slice_off_ptr + s + 1)
    if ZERO_BASE:
        if tl.program_id(0) >= planned_tiles:
            # y is new memory: the allocator may have just freed it from a tensor that the kernel before the
            # shrink (which may still run beside us) reads. Tile programs wait before their writes too.
            _pdl_wait(USE_PDL)
            _zero_base_rows(y_ptr, sorted_ptr, tile_start_ptr, num_tiles, num_rows, tl.program_id(0) - planned_tiles,
                            y_col_offset, n_lo, n_hi, BLOCK_N * tl.cdiv(n_blocks, tl.num_programs(1)), sy_t, sy_n,
                            BLOCK_M, BLOCK_N)
            return
    chunks = _deal(num_tiles, tl.num_programs(1), num_slices, planned_tiles * tl.num_programs(1), target, n_blocks)
    pid = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    if pid >= num_tiles * chunks:
        return
    tile = pid // chunks
    chunk = pid % chunks
    n_per_prog = BLOCK_N * tl.cdiv(n_blocks, chunks)
    split_k = _deal(num_tiles, shrink_splits, num_slices, planned_tiles * shrink_splits, shrink_target, split_cap)
    lora, start, end = _tile(tile_lora_ptr, tile_start_ptr, tile_end_ptr, tile)
    if lora < 0:
        return
    n_begin = n_lo + chunk * n_per_prog
    if n_begin >= n_hi:
        return
    n_end = tl.minimum(n_begin + n_per_prog, n_hi)
    tok, m_mask = _tile_tokens(sorted_ptr, start, end, BLOCK_M)
    rank = tl.load(ranks_ptr + s * sr_s + lora)
    if ADD_INPUTS and not HAS_BIAS:
        if rank == 0:  # the adapter leaves this slice alone: nothing to add, B and y unread (_UNTARGETED)
            _pdl_wait(USE_PDL)
            return
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = rank_mask(offs_r, rank, RANK_GROUP)
    xb = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    buf_ptrs = (buf_ptr + lora.to(tl.int64) * sb_l + s * sb_s + tok[:, None].to(tl.int64) * sb_t
                + offs_r[None, :] * sb_r)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the shrink's output is complete and visible from here on
    for sp in range(split_k):
        xb += tl.load(buf_ptrs + sp * sb_split, mask=m_mask[:, None] & r_mask[None, :], other=0.0)
    b_rows = b_ptr + lora.to(tl.int64) * sw_l + offs_r[:, None] * sw_r
    y_rows = y_ptr + tok[:, None].to(tl.int64) * sy_t
    for n in range(n_begin, n_end, BLOCK_N):
        offs_n = n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < n_end
        y_ptrs = y_rows + (y_col_offset + offs_n[None, :]) * sy_n
        y_mask = m_mask[:, None] & n_mask[None, :]
        w = tl.load(b_rows + offs_n[None, :].to(tl.int64) * sw_n, mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        acc = _dot(xb.to(w.dtype), w, IEEE)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + lora.to(tl.int64) * sbias_l + offs_n, mask=n_mask, other=0.0)
            acc += bias[None, :].to(tl.float32)
        if ADD_INPUTS:
            acc += tl.load(y_ptrs, mask=y_mask, other=0.0).to(tl.float32)
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)


@triton.jit
def bgmv_shrink_kernel(
    x_ptr, a_ptr, out_ptr, ranks_ptr, slots_ptr,
    K, scale, split_k,
    sx_t, sx_k,
    sa_s, sa_l, sa_r, sa_k,
    so_split, so_s, so_t, so_r,
    sr_s,
    R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr, PREFETCH_A: tl.constexpr,
):
    """Decode shrink, one token per program: out[split, s, t, :R] = scale * x[t, k-range] @ A[s, slot_t]^T.

    No sorting and no tl.dot: one slot look-up, then the A rows stream through
    FMAs. A token whose adapter is shared with others re-reads it from L2.
    """
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0)
    split = tl.program_id(1)
    s = tl.program_id(2)
    slot = tl.load(slots_ptr + t)
    if slot < 0:
        _pdl_wait(USE_PDL)
        return
    rank = tl.minimum(tl.load(ranks_ptr + s * sr_s + slot), R)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    k_chunk = tl.cdiv(tl.cdiv(K, split_k), BLOCK_K) * BLOCK_K
    k_lo = split * k_chunk
    k_hi = tl.minimum(k_lo + k_chunk, K)
    a_rows = a_ptr + s.to(tl.int64) * sa_s + slot.to(tl.int64) * sa_l + offs_r[:, None] * sa_r
    x_row = x_ptr + t.to(tl.int64) * sx_t
    if PREFETCH_A:
        # As in shrink_kernel: the first A tile before waiting for the previous kernel, x after. Only
        # for one or two K steps: peeling a longer loop slowed it more than the early tile saved.
        offs_k = k_lo + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_hi
        a = tl.load(a_rows + offs_k[None, :] * sa_k, mask=r_mask[:, None] & k_mask[None, :], other=0.0)
        _pdl_wait(USE_PDL)
        xk = tl.load(x_row + offs_k * sx_k, mask=k_mask, other=0.0).to(tl.float32)
        acc = a.to(tl.float32) * xk[None, :]
        k_first = k_lo + BLOCK_K
    else:
        _pdl_wait(USE_PDL)
        acc = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
        k_first = k_lo
    for k in range(k_first, k_hi, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_hi
        xk = tl.load(x_row + offs_k * sx_k, mask=k_mask, other=0.0).to(tl.float32)
        a = tl.load(a_rows + offs_k[None, :] * sa_k, mask=r_mask[:, None] & k_mask[None, :], other=0.0)
        acc += a.to(tl.float32) * xk[None, :]
    out = tl.sum(acc, axis=1) * scale
    tl.store(out_ptr + split * so_split + s * so_s + t.to(tl.int64) * so_t + offs_r * so_r, out, mask=offs_r < R)


@triton.jit
def bgmv_expand_kernel(
    buf_ptr, b_ptr, y_ptr, ranks_ptr, slice_off_ptr, bias_ptr, slots_ptr,
    y_col_offset, n_per_prog,
    sb_split, sb_s, sb_t, sb_r, sb_l,
    sw_l, sw_n, sw_r,
    sy_t, sy_n,
    sr_s, sbias_l,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, ADD_INPUTS: tl.constexpr, USE_PDL: tl.constexpr,
    RANK_GROUP: tl.constexpr,
):
    """Decode expand, one token per program: y[t, off + n] (+)= sum_split buf[., s, t, :rank] @ B[slot_t, n, :rank]^T.

    Under programmatic dependent launch (USE_PDL) this kernel starts while the
    shrink still runs: the slot and its first B tile are loaded before
    gdc_wait, so their DRAM latency hides behind the shrink; y after it (the
    shrink itself may have started under the kernel that writes y).
    """
    t = tl.program_id(0)
    chunk = tl.program_id(1)
    s = tl.program_id(2)
    slot = tl.load(slots_ptr + t)
    n_lo = tl.load(slice_off_ptr + s)
    n_hi = tl.load(slice_off_ptr + s + 1)
    if slot < 0:
        return
    n_begin = n_lo + chunk * n_per_prog
    if n_begin >= n_hi:
        return
    n_end = tl.minimum(n_begin + n_per_prog, n_hi)
    rank = tl.load(ranks_ptr + s * sr_s + slot)
    if ADD_INPUTS and not HAS_BIAS:
        if rank == 0:  # the adapter leaves this slice alone: nothing to add, B and y unread (_UNTARGETED)
            _pdl_wait(USE_PDL)
            return
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = rank_mask(offs_r, rank, RANK_GROUP)
    b_rows = b_ptr + slot.to(tl.int64) * sw_l + offs_r[None, :] * sw_r
    y_row = y_ptr + t.to(tl.int64) * sy_t
    offs_n = n_begin + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_end
    w = tl.load(b_rows + offs_n[:, None].to(tl.int64) * sw_n, mask=n_mask[:, None] & r_mask[None, :], other=0.0)
    y_ptrs = y_row + (y_col_offset + offs_n) * sy_n
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    y_old = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if ADD_INPUTS:  # after the wait: the shrink's wait covers the kernel that wrote y
        y_old = tl.load(y_ptrs, mask=n_mask, other=0.0).to(tl.float32)
    offs_sp = tl.arange(0, SPLIT_K)
    parts = tl.load(buf_ptr + slot.to(tl.int64) * sb_l + offs_sp[:, None] * sb_split + s * sb_s
                    + t.to(tl.int64) * sb_t + offs_r[None, :] * sb_r, mask=r_mask[None, :], other=0.0)
    xb = tl.sum(parts, axis=0)
    acc = tl.sum(w.to(tl.float32) * xb[None, :], axis=1) + y_old
    if HAS_BIAS:
        acc += tl.load(bias_ptr + slot.to(tl.int64) * sbias_l + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=n_mask)
    for n in range(n_begin + BLOCK_N, n_end, BLOCK_N):
        offs_n = n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < n_end
        w = tl.load(b_rows + offs_n[:, None].to(tl.int64) * sw_n, mask=n_mask[:, None] & r_mask[None, :], other=0.0)
        acc = tl.sum(w.to(tl.float32) * xb[None, :], axis=1)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + slot.to(tl.int64) * sbias_l + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        y_ptrs = y_row + (y_col_offset + offs_n) * sy_n
        if ADD_INPUTS:
            acc += tl.load(y_ptrs, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=n_mask)

