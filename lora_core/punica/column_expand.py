"""A stacked decode step's expand as column tiles that walk the step's slots, their loads pipelined.

After a stacked GEMM (lora_core/stacked_a.py) every row's shrink is in `shrunk`, and the expand is the
site's whole LoRA kernel: y[t, n] += shrunk[t, slot(t)'s columns] @ B[slot(t), n, :]^T. The SGMV expand
(triton_kernels.expand_kernel, one B tile of one adapter per program) makes each program a chain of
dependent loads (tile metadata, then rows, then B, then y): at decode sizes its time is that chain's
latency times the waves of programs, not its bytes (H200, rank 64, 32 rows over 12 adapters: gate_up's
expand 36 us for 10 us of B; bench/stacked_expand.py --columns).

Here a program owns one BLOCK_N column tile of one slice for every row and loops over the slots below
the step's slot bound: each iteration loads that slot's B tile and its rows' shrink columns (other rows
masked to zero) and adds one tl.dot into a [rows, BLOCK_N] accumulator; y is read and written once.
Each B tile is read once per step, as in SGMV, and a slot no row uses reads nothing. Up to 16 slots on
the narrower sites, the slots are split into groups of 4, a program per group and column tile: a row has
one slot, so the groups' programs write disjoint rows (no atomics, the same sums), and four times the
programs share the bytes (o_proj, 32 rows over 12 rank-64 slots: 12.3 -> 10.1 us).

Every address and mask in the loop is arithmetic on the loop variable and on registers loaded before
it: that is what lets Triton's software pipeliner keep NUM_STAGES iterations' loads in flight. A value
looked up in the loop (the slot's rank from memory, or picked out of a register vector by a reduction)
left the loop unpipelined, one DRAM round trip per slot (~1 us), and a mask along the rank (B's and the
shrink's contiguous axis, even one fixed for the loop) kept the loads from vectorizing.
So nothing is masked by rank: the kernel reads each used slot's whole width (max_lora_rank), as the
stacked GEMM reads its A rows, and relies on the slot images' invariant (model_manager, host_adapter):
A and B are zero past each adapter's rank on each slice, so the shrink columns past it are zero and add
nothing. Slots no row uses are masked whole (a bit mask of the step's slots, made before the loop).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from lora_core.punica.triton_kernels import _dot, _pdl_wait

# Rows a program holds in its accumulator (BLOCK_M x BLOCK_N fp32): decode-sized steps only.
COLUMN_EXPAND_MAX_ROWS = 64
# Past 16 slots a program's loop is long, and in steps of up to 32 rows the tile expand's many short programs
# win where the bound's B is small (H200, 32 rows over 32 rank-64 slots: o / down / qkv 13.2 / 13.2 / 18.1 us
# against 16.5 / 16.5 / 20.6); where it holds this many elements or more the loop streams at bandwidth and wins
# (gate_up: 48.5 -> 42.4 us), and so it does in taller steps, whose tiles cost the tile expand more (64 rows
# over 32 slots: qkv r64 25.8 -> 19.3, gate_up r16 36.8 -> 21.8; o / down r16 lose 0.8-1.0 us).
COLUMN_EXPAND_WIDE_ELEMENTS = 1 << 25
# Outputs from which a site takes 128-column tiles (gate_up_proj): wide sites have programs enough.
COLUMN_EXPAND_WIDE_OUTPUTS = 16384


def enabled() -> bool:
    """Whether stacked steps may run this expand: on unless env LORAFLEET_COLUMN_EXPAND=0 (for A/B runs)."""
    return os.environ.get("LORAFLEET_COLUMN_EXPAND", "1") != "0"


def use_column_expand(num_rows: int, slot_bound: int, out_features: int, rank: int, tile_bgmv: bool) -> bool:
    """Whether a stacked step's expand runs here (host values only, so a CUDA graph's key fixes the choice).
    rank: the slots' width (max_lora_rank), a power of two from 16 (tl.dot's smallest K) for this kernel.

    tile_bgmv: the other expand would run one row per program (triton_ops.use_bgmv_stacked: little work),
    which this one does not beat (H200, 32 rows, rank 16, 4-16 slots: o / down / qkv 7.6-9.0 us against
    7.4-10.9)."""
    if (not enabled() or tile_bgmv or not 0 < num_rows <= COLUMN_EXPAND_MAX_ROWS or slot_bound > 64
            or rank < 16 or rank & (rank - 1)):
        return False
    return slot_bound <= 16 or num_rows > 32 or slot_bound * rank * out_features >= COLUMN_EXPAND_WIDE_ELEMENTS


@triton.jit
def _bit_or(a, b):
    return a | b


@triton.jit
def column_expand_kernel(
    s_ptr, b_ptr, y_ptr, slice_off_ptr, slots_ptr,
    num_rows, slot_bound, group, ss_t, ss_slot, ss_s, sb_l, sb_n, sy_t,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    NUM_STAGES: tl.constexpr, USE_PDL: tl.constexpr, IEEE: tl.constexpr,
):
    """y[t, off_s + n] += s[t, slot(t), s, :] @ B[slot(t), off_s + n, :]^T for program (tile, s, g)'s columns
    [tile * BLOCK_N, (tile + 1) * BLOCK_N) of slice s and the rows whose slot is in [g * group, (g + 1) * group).
    Rows with no adapter (slot -1) are not written."""
    s = tl.program_id(1)
    n_lo = tl.load(slice_off_ptr + s)
    n_hi = tl.load(slice_off_ptr + s + 1)
    n_begin = n_lo + tl.program_id(0) * BLOCK_N
    if n_begin >= n_hi:
        _pdl_wait(USE_PDL)
        return
    offs_n = n_begin + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_hi
    offs_m = tl.arange(0, BLOCK_M)
    row_slot = tl.load(slots_ptr + offs_m, mask=offs_m < num_rows, other=-1)
    # Each row has one slot, so the slot groups' programs write disjoint rows: no atomics, the same sums.
    g_lo = tl.program_id(2) * group
    g_hi = tl.minimum(g_lo + group, slot_bound)
    row_slot = tl.where((row_slot >= g_lo) & (row_slot < g_hi), row_slot, -1)
    if tl.max(row_slot, 0) < 0:  # no row in this group
        _pdl_wait(USE_PDL)
        return
    # Slots some row uses, as bits (slot_bound <= 64).
    one = tl.full((BLOCK_M,), 1, tl.int64)
    used = tl.reduce(tl.where(row_slot >= 0, one << tl.maximum(row_slot, 0).to(tl.int64), 0), 0, _bit_or)
    offs_r = tl.arange(0, BLOCK_R)
    s_rows = s_ptr + offs_m[:, None].to(tl.int64) * ss_t + s * ss_s + offs_r[None, :]
    b_cols = b_ptr + g_lo.to(tl.int64) * sb_l + offs_n[None, :].to(tl.int64) * sb_n + offs_r[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    _pdl_wait(USE_PDL)  # the GEMM that wrote shrunk and y has completed from here on
    for slot in tl.range(g_lo, g_hi, num_stages=NUM_STAGES):
        # An idle slot's B masked along the columns (not the rank, B's contiguous axis: see the module doc)
        live = n_mask & (((used >> slot) & 1) + tl.zeros_like(offs_n) != 0)
        sv = tl.load(s_rows + slot * ss_slot, mask=(row_slot == slot)[:, None], other=0.0)
        bt = tl.load(b_cols, mask=live[None, :], other=0.0)
        acc += _dot(sv, bt, IEEE)
        # A pointer step, not slot * sb_l: B's slots are views of one arena a whole adapter apart (~168 M elements
        # at rank 64 on 8B), and that product overflows int32 from the 13th slot.
        b_cols += sb_l
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * sy_t + offs_n[None, :]
    y_mask = (row_slot >= 0)[:, None] & n_mask[None, :]
    acc += tl.load(y_ptrs, mask=y_mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)


def column_expand_config(slot_bound: int, out_features: int, rank: int) -> tuple[int, int, int]:
    """(BLOCK_N, NUM_STAGES, slots per program; 0: the whole bound). H200, 32-64 rows, the four 8B sites at ranks
    16 and 64 (bench/stacked_expand.py --columns):
    gate_up_proj 128-column tiles four stages deep at every bound (32 rows over 12 rank-64 slots: 22.9 us against
    25.1 with 32 columns; 64 rows over 4: 14.4 against 17.6); the narrower sites 32-column tiles up to 4 slots
    (more programs for little work), programs of 4 slots in 64-column tiles up to 16 (32 rows over 12 rank-64
    slots, o_proj: 10.1 us against 12.3 for one program walking all 16: a loop four deep keeps its loads in
    flight, and four times the programs share the bytes), past that one program per column tile walking every
    slot, six stages deep (64 rows over 32 slots: 15.1 against 17.3 in groups of 4). Rank-16 gate_up tiles are a
    quarter the bytes, and eight stages keep enough of them in flight (64 rows over 32 slots: 21.7 -> 19.2 us);
    at rank 64 more than four stages lost (23.8 -> 28.6 us at 64 rows over 12)."""
    if out_features >= COLUMN_EXPAND_WIDE_OUTPUTS:
        return 128, 8 if rank <= 16 else 4, 0
    if slot_bound <= 4:
        return 32, 4, 0
    return (64, 4, 4) if slot_bound <= 16 else (64, 6, 0)


def column_expand(y: torch.Tensor, shrunk: torch.Tensor, lora_b: torch.Tensor, slice_offsets: torch.Tensor,
                  max_slice: int, num_slices: int, slots: torch.Tensor, num_rows: int, slot_bound: int,
                  use_pdl: bool = False, config: tuple[int, int, int] | None = None) -> None:
    """y [T, sum(slices)] += each row's expand: shrunk [T, >= slot_bound * S * R] slot-major as a stacked GEMM
    writes it, lora_b [L, N, R] zero past each slot's rank, slots [T] (-1: no adapter), every slot below
    slot_bound. y, shrunk and lora_b need unit stride along columns (rank for lora_b); T <=
    COLUMN_EXPAND_MAX_ROWS, slot_bound <= 64, R a power of two >= 16. config: (BLOCK_N, NUM_STAGES, slots per
    program, 0 for all), default column_expand_config's."""
    if num_rows == 0:
        return
    rank = lora_b.shape[2]
    if num_rows > COLUMN_EXPAND_MAX_ROWS or slot_bound > 64 or rank < 16 or rank & (rank - 1):
        raise ValueError(f"column_expand takes up to {COLUMN_EXPAND_MAX_ROWS} rows, 64 slots and slots of a "
                         f"power-of-two rank >= 16, got {num_rows} rows, slot bound {slot_bound}, rank {rank}")
    if y.stride(1) != 1 or shrunk.stride(1) != 1 or lora_b.stride(2) != 1:
        raise ValueError("column_expand needs y, shrunk and lora_b with unit stride along columns and rank")
    block_n, stages, group = config or column_expand_config(slot_bound, lora_b.shape[1], rank)
    group = min(group or slot_bound, slot_bound)
    column_expand_kernel[(triton.cdiv(max_slice, block_n), num_slices, triton.cdiv(slot_bound, group))](
        shrunk, lora_b, y, slice_offsets, slots,
        num_rows, slot_bound, group, shrunk.stride(0), num_slices * rank, rank, lora_b.stride(0), lora_b.stride(1),
        y.stride(0), BLOCK_M=max(16, triton.next_power_of_2(num_rows)), BLOCK_N=block_n, BLOCK_R=rank,
        NUM_STAGES=stages, USE_PDL=use_pdl, IEEE=lora_b.dtype == torch.float32, num_warps=4,
        **({"launch_pdl": True} if use_pdl else {}),
    )
