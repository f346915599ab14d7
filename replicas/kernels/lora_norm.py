"""The add + RMSNorm after o_proj and down_proj, adding the layer's pending LoRA expand first, in one launch.

add_rms_norm_lora(x, residual, weight, eps, lora) is fused.fused_add_rms_norm
after lora.apply() (the expand into x, the layer's output): h = (x + expand) +
residual, y = norm(h). The norm needs a whole row's sum of squares, and a
program per row would stream the row's whole B (rank x hidden) alone: that
first version ran 3-11 us slower than the expand kernel it replaced
(bench/pending_expand.py). Here the grid is (row, column chunk),
as wide as the expand kernel's: each program adds its chunk's expand and
residual, stores h and its chunk's sum of squares, and counts itself in with
an atomic; the row's last program to arrive sums the partials in chunk order
(so every launch gives the same bits, whatever the arrival order) and writes
the row's normed output, then leaves its counter at zero for the next launch.
No program waits on another, so nothing can deadlock however the GPU
schedules them. The counters and partials come from the PunicaWrapper
(arrival_workspace): one pair for all layers, as launches in stream order
never overlap.

add_rms_norm_lora_deferred skips that last pass (1.3-1.6 us per site on an
H200): each program writes weight * h for its chunk and its partial, and the
caller gets a RowScale (replicas/layers/row_scale.py) that the op after the
next linear layer applies. The partials then live in the same workspace until
the next norm's launch, which in stream order follows that op.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lora_core.punica.pending import PendingExpand
from lora_core.punica.row_expand import row_expand, row_slot
from replicas.kernels.fused import _MAX_NORM_BLOCK, _launch_opts, _rows, _rsqrt
from replicas.layers.row_scale import RowScale

# Columns per program: each holds a [block, R] tile of the row's B. H200, 8B o_proj / down_proj, 16-32 rows over
# 1-32 adapters (bench/pending_expand.py --sites o down --blocks 64 128 256 512): 256 saved 0.7-1.2 us per o_proj
# site over the expand kernel + add + RMSNorm; 64 lost up to 1.1.
LORA_NORM_BLOCK = 256
LORA_NORM_WARPS = 4
# Slots of up to this rank fuse (as SiluAndMul's LORA_SILU_MAX_RANK); RMSNorm runs a larger expand first.
LORA_NORM_MAX_RANK = 16


@triton.jit
def _add_rms_norm_lora_kernel(x_ptr, res_ptr, w_ptr, out_ptr, h_ptr, cnt_ptr, part_ptr, eps, inv_n, N,
                              sx, sr, so, sh,
                              slots_ptr, s_ptr, b_ptr, ranks_ptr, ss_t, ss_l, sb_l, sb_n, sr_s, s_slice,
                              BLOCK: tl.constexpr, CHUNKS: tl.constexpr, BLOCK_P: tl.constexpr,
                              ROW_BLOCK: tl.constexpr, BLOCK_R: tl.constexpr, PRECISE: tl.constexpr,
                              DEFER: tl.constexpr):
    """Program (row, c): columns [c * BLOCK, (c + 1) * BLOCK) of one row; the row's last arrival norms it.
    DEFER: no arrival; each program writes w * h and its part of the sum of squares (a RowScale's)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    dtype = x_ptr.dtype.element_ty
    slot, rank = row_slot(slots_ptr, ranks_ptr, row, 0, sr_s)
    x = tl.load(x_ptr + row * sx + offs, mask=mask, other=0.0)
    # rounded to the dtype as the expand kernel stores it into x, then the add as fused_add_rms_norm rounds it
    x = (x.to(tl.float32) + row_expand(s_ptr + row * ss_t + slot * ss_l, b_ptr + slot * sb_l, rank, offs, mask,
                                       sb_n, BLOCK_R)).to(dtype)
    h = (x.to(tl.float32) + tl.load(res_ptr + row * sr + offs, mask=mask, other=0.0).to(tl.float32)).to(dtype)
    h_row = h_ptr + row * sh
    tl.store(h_row + offs, h, mask=mask)
    hf = h.to(tl.float32)
    tl.store(part_ptr + row * CHUNKS + tl.program_id(1), tl.sum(hf * hf, axis=0))
    if DEFER:
        w_chunk = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # not `w`: the loop below's
        tl.store(out_ptr + row * so + offs, (w_chunk * hf).to(out_ptr.dtype.element_ty), mask=mask)
        return
    tl.debug_barrier()  # every thread's stores issued before the release below
    if tl.atomic_add(cnt_ptr + row, 1, sem="acq_rel") == CHUNKS - 1:
        offs_p = tl.arange(0, BLOCK_P)
        # .cg: from L2, where the other programs' stores landed (this SM's L1 may hold stale lines)
        parts = tl.load(part_ptr + row * CHUNKS + offs_p, mask=offs_p < CHUNKS, other=0.0, cache_modifier=".cg")
        inv = _rsqrt(tl.sum(parts, axis=0) * inv_n + eps, PRECISE)
        cols = tl.arange(0, ROW_BLOCK)
        for start in range(0, N, ROW_BLOCK):
            m = start + cols < N
            hh = tl.load(h_row + start + cols, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
            w = tl.load(w_ptr + start + cols, mask=m, other=0.0).to(tl.float32)
            y = w * (hh * inv).to(dtype).to(tl.float32)
            tl.store(out_ptr + row * so + start + cols, y.to(out_ptr.dtype.element_ty), mask=m)
        tl.store(cnt_ptr + row, 0)


def fusable(x: torch.Tensor, residual: torch.Tensor, lora: PendingExpand) -> bool:
    """Whether add_rms_norm_lora takes this expand: one slice as wide as x, owed to x itself (2-D, unit stride
    along columns), a residual of x's shape and dtype."""
    return (x.dim() == 2 and x.stride(1) == 1 and lora.splits_y((x,)) and lora.fusable((x.shape[-1],))
            and residual.shape == x.shape and residual.dtype == x.dtype)


def add_rms_norm_lora(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                      lora: PendingExpand) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, N] (the output lora's one-slice expand is owed to), residual [T, N] -> new (rms_norm(h), h) with
    h = (x + expand, rounded to x.dtype) + residual, as fused_add_rms_norm after lora.apply(); x is left alone."""
    out, h, _ = _launch(x, residual, weight, eps, lora, defer=False)
    return out, h


def add_rms_norm_lora_deferred(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                               lora: PendingExpand) -> tuple[torch.Tensor, torch.Tensor, RowScale]:
    """add_rms_norm_lora with the row's 1 / rms left to the caller: -> new (weight * h, h, RowScale), so that
    rms_norm(h) = weight * h * scale.inv() (replicas/layers/row_scale.py). No second pass over the row."""
    return _launch(x, residual, weight, eps, lora, defer=True)


def _launch(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, lora: PendingExpand,
            defer: bool) -> tuple[torch.Tensor, torch.Tensor, RowScale | None]:
    if not fusable(x, residual, lora):
        raise ValueError(f"add_rms_norm_lora takes a one-slice expand owed to x itself and a residual of x's shape, "
                         f"got slices {lora.output_slices} onto x {tuple(x.shape)}, residual {tuple(residual.shape)}")
    rows, n = x.shape
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    h = torch.empty_like(x, memory_format=torch.contiguous_format)
    if rows == 0:
        return out, h, None
    block = min(triton.next_power_of_2(n), LORA_NORM_BLOCK)
    chunks = triton.cdiv(n, block)
    counters, partials = lora.punica.arrival_workspace(rows, chunks)
    r2 = _rows(residual)
    _add_rms_norm_lora_kernel[(rows, chunks)](
        x, r2, weight.contiguous(), out, h, counters, partials, float(eps), 1.0 / n, n,
        x.stride(0), r2.stride(0), out.stride(0), h.stride(0), *lora.kernel_args(),
        BLOCK=block, CHUNKS=chunks, BLOCK_P=triton.next_power_of_2(chunks),
        ROW_BLOCK=min(triton.next_power_of_2(n), _MAX_NORM_BLOCK // 2),
        BLOCK_R=max(16, triton.next_power_of_2(lora.slice_rank)), PRECISE=x.is_cuda, DEFER=defer,
        num_warps=LORA_NORM_WARPS, **_launch_opts(x))
    return out, h, RowScale(partials, eps, 1.0 / n) if defer else None
