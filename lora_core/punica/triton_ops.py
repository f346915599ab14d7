"""Launchers for the Triton punica kernels (same semantics as torch_ops).

Tile sizes are picked from host-side shapes only (never from device values),
so a launch never waits for the GPU and the same launch can be replayed from
a CUDA graph.
"""

from __future__ import annotations

import functools

import torch
import triton.language as tl

from lora_core.punica.metadata import PunicaMetadata, max_tiles
from lora_core.punica import triton_kernels
from lora_core.punica.triton_kernels import bgmv_expand_kernel, bgmv_shrink_kernel, expand_kernel, shrink_kernel

# Enough programs to keep every SM of an H100/H200 streaming weights.
_TARGET_PROGRAMS = 1024
# SGMV steps with few real tiles (one adapter, a few popular ones): the device deals the grid's
# idle programs to the real tiles up to these totals per launch for 16-row tiles, fewer for taller
# ones (triton_kernels._deal; `bench/punica_kernels.py --deal` sweeps them), and a tile's K splits up to
# SPLIT_ROWS // BLOCK_R (each split is a partial the expand re-reads).
DEAL_SHRINK_PROGRAMS = 256
DEAL_EXPAND_PROGRAMS = 512
SPLIT_ROWS = 256
# Largest A tile (rank x K elements) of a BGMV shrink step (shrink_config): H200, T = 1, down_proj's shrink in
# one step instead of two (r16) or four (r64): 10.2 -> 8.2 us and 12.8 -> 9.7 us with its expand; 8192 gave
# r64 11.97 (bench/punica_kernels.py --bgmv-tile).
BGMV_SHRINK_TILE = 16384
# Most K splits of a BGMV shrink per row: each split is a [rank] float32 partial that every expand program of the
# row reads back (rank 64 at 64 splits: 16 KB per program; `bench/punica_kernels.py --bgmv-splits` sweeps it).
BGMV_MAX_SPLITS = 64
# Most split partials (rank x splits floats) per BGMV row: every expand program of the row reads them all back.
# H100, T = 1, rank 64: qkv 9.98 -> 9.28 us, gate_up 12.86 -> 11.36 at 16 splits instead of 64. Rank 16 plans at
# most 32 splits (its 256-wide K blocks) and is left alone (bench/punica_kernels.py --bgmv-splits).
# 0: no cap.
BGMV_SPLIT_PARTIALS = 1024
# ... unless the launch would then hold fewer programs than this, each taking more than one BGMV_SHRINK_TILE step.
# down_proj (14,336 inputs) at rank 64, H100: T = 1 took 10.4 us at 64 splits (one step), 14.3 at 16 (four steps,
# 16 programs); T = 16 29.7 at 16 splits against 33.8 at 64. H200, T = 2: 11.0 at 32 splits (64 programs) against
# 15.5 at 64 and 14.0 at 16 (bench/punica_kernels.py --bgmv-min-programs).
BGMV_MIN_PROGRAMS = 64


def _deal_target(programs: int, meta: PunicaMetadata) -> int:
    # Taller tiles carry more work each: past 16 rows the kernels are no longer latency-bound.
    return programs * 16 // meta.block_m


def _slot_bound_tiles(meta: PunicaMetadata) -> int:
    """Tiles of the step's rows if every slot could be in it. The grid is bounded by the step's adapters
    (metadata.layout); the work per tile is still planned for this count, as the sweeps behind these
    settings were, and the device deal (_dealt) adds to it when there are fewer tiles."""
    return max_tiles(meta.num_rows, meta.num_slots, meta.block_m)


def _dealt(programs: int, meta: PunicaMetadata, num_slices: int, cap: int) -> int:
    """What triton_kernels._deal gives each of max_tiles real tiles, at most cap: the host's share when
    every tile the grid holds is real."""
    return min(cap, -(-_deal_target(programs, meta) // (meta.max_tiles * num_slices)))


@functools.lru_cache(maxsize=None)
def pdl_supported(device_index: int) -> bool:
    """Programmatic dependent launch: Hopper or newer, and a Triton that has gdc_wait."""
    if not torch.cuda.is_available() or not hasattr(tl.extra.cuda, "gdc_wait"):
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def _pdl_kwargs(use_pdl: bool) -> dict:
    # Only named when on: Triton's interpreter does not know the option.
    return {"launch_pdl": True} if use_pdl else {}


def use_bgmv(meta: PunicaMetadata) -> bool:
    """One-token-per-program BGMV for small steps of barely shared adapters, SGMV tiles otherwise."""
    return meta.use_bgmv


# Small steps that plan SGMV (rows sharing adapters) still run a site as BGMV when its inputs outnumber its outputs
# this many times at rank <= 16 (down_proj: 14,336 -> 4,096): BGMV splits the long K over many programs per row,
# and re-reading a rank-16 B of 4,096 outputs per row costs less than SGMV's tiles. H200, down_proj rank 16,
# shrink + expand: 4 / 8 / 16 rows of one adapter 13.5 / 13.3 / 14.0 -> 10.5 / 10.9 / 11.8 us, 16 rows over 4
# adapters 14.0 -> 12.1; qkv and gate_up (more outputs than inputs) and rank 64 lose with BGMV (bench/punica_kernels.py
# --bgmv-rows-per-adapter). 0: off.
BGMV_SITE_K_OVER_N = 2


def use_bgmv_site(meta: PunicaMetadata, hidden: int, outputs: int, rank: int) -> bool:
    """use_bgmv for one site: `hidden` inputs, `outputs` outputs over all its slices, slots of `rank`."""
    if meta.use_bgmv:
        return True
    return (bool(BGMV_SITE_K_OVER_N) and meta.num_rows <= meta.bgmv_max_rows and _block_r(rank) <= 16
            and hidden >= BGMV_SITE_K_OVER_N * outputs)


# A stacked step's expand runs one program per row (BGMV) while rows x outputs x rank stays under this, even
# when rows share adapters: with no shrink left to share A reads, SGMV's tile-metadata chain costs more than
# re-reading B from L2 (H200, 16 rows of one rank-16 adapter: o 5.4 -> 2.8 us, down 7.1 -> 4.8) until B's
# bytes per row dominate (gate_up, 32 rows: 6.3 -> 13.4 us; bench/lora_site.py).
BGMV_EXPAND_WORK = 1 << 22


def use_bgmv_stacked(meta: PunicaMetadata, out_features: int, rank: int) -> bool:
    """Whether a stacked step's expand over out_features outputs runs BGMV (host values only: no sync)."""
    return meta.num_rows <= meta.bgmv_max_rows and meta.num_rows * out_features * rank <= BGMV_EXPAND_WORK


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def _block_r(rank: int) -> int:
    return max(16, 1 << (rank - 1).bit_length())


def _k_steps(hidden: int, split_k: int, block_k: int) -> int:
    """BLOCK_K steps of the K loop of a program that owns one of split_k chunks of hidden."""
    return -(-(-(-hidden // split_k)) // block_k)


# Most K splits for tiles of 32 rows or more (prompt-sized steps): each split leaves a partial that every expand
# program of the tile reads back in turn, and such steps have tiles enough to fill the GPU with fewer splits.
# H200, rank 16, Zipf, the four 8B sites' lora_linear extra per layer at 512 / 1,024 / 2,048 rows: 126.4 / 154.6 /
# 274.3 us with 32, 118.2 / 145.8 / 272.8 with 8 (4: 121.6 / 151.6 / 306.8; bench/delta_first.py).
# 0: 32.
SGMV_TALL_MAX_SPLITS = 8


def shrink_config(meta: PunicaMetadata, hidden: int, num_slices: int, rank: int,
                  bgmv: bool | None = None) -> tuple[int, int, int]:
    """(BLOCK_K, grid splits, split cap) for a shrink: split H so decode launches fill the GPU.

    BGMV splits exactly grid-splits ways. SGMV launches max_tiles x grid-splits
    programs per slice and deals them out over the real tiles on the device, up
    to split-cap splits each: the partials buffer's first axis. bgmv: the path (None: use_bgmv(meta)).
    """
    if use_bgmv(meta) if bgmv is None else bgmv:
        block_k = max(16, 4096 // _block_r(rank))
        k_blocks = _pow2_floor(max(1, hidden // block_k))
        wanted = -(-_TARGET_PROGRAMS // (meta.num_rows * num_slices))
        split_k = min(k_blocks, 1 << (wanted - 1).bit_length(), BGMV_MAX_SPLITS)
        if BGMV_SPLIT_PARTIALS:
            one_step = -(-hidden // max(1, BGMV_SHRINK_TILE // _block_r(rank)))
            to_fill = -(-BGMV_MIN_PROGRAMS // (meta.num_rows * num_slices))
            floor = 1 << (max(1, min(one_step, to_fill)) - 1).bit_length()
            split_k = min(split_k, max(BGMV_SPLIT_PARTIALS // _block_r(rank), floor))
        # Each program's K chunk in one step where a tile of BGMV_SHRINK_TILE elements holds it: a second
        # step's A loads wait behind the first (down_proj: 14,336 / 32 splits took two 256-wide steps).
        chunk = 1 << (-(-hidden // split_k) - 1).bit_length()
        block_k = max(block_k, min(chunk, BGMV_SHRINK_TILE // _block_r(rank)))
        return block_k, split_k, split_k
    # 256-wide K steps of 32-64-row tiles hold one program per SM (3 stages of a 32 KB x tile): at prompt
    # sizes the shrink then waits on each wave's loads. H200, T = 2,048 Zipf, rank 16: o_proj 35.5 -> 14.5 us
    # (bench/sgmv_plans.py).
    block_k = 128 if _block_r(rank) >= 64 or meta.block_m >= 32 else 256
    k_blocks = max(1, -(-hidden // block_k))
    most = 32 if meta.block_m < 32 or not SGMV_TALL_MAX_SPLITS else SGMV_TALL_MAX_SPLITS
    cap = max(1, min(k_blocks, most, SPLIT_ROWS // _block_r(rank)))
    planned = max(1, min(k_blocks, -(-_TARGET_PROGRAMS // (_slot_bound_tiles(meta) * num_slices)), most))
    split_k = max(planned, _dealt(DEAL_SHRINK_PROGRAMS, meta, num_slices, cap))
    return block_k, split_k, max(split_k, cap)


# SGMV expand columns per step for tiles of 32 rows or more (prompt-sized steps): {reads y back: BLOCK_N}. y's loads
# are not pipelined, so where the expand reads y each step waits for them, and narrow steps keep more of them in
# flight; a write-only expand streams its stores best in wide steps. H200, rank 16, Zipf rows, 8B sites, per site:
# T = 1,024 qkv 39.7 -> 28.2 us (read back, 128 -> 64 columns), gate_up 125.1 -> 52.1 (written, 256), T = 2,048
# gate_up 198.8 -> 94.3 (bench/sgmv_plans.py).
_SGMV_EXPAND_BLOCK_N = {True: 64, False: 256}


def expand_config(meta: PunicaMetadata, max_slice: int, num_slices: int, bgmv: bool | None = None,
                  add_inputs: bool = True) -> tuple[int, int]:
    """(BLOCK_N, N_PER_PROG): enough programs to fill the GPU, each streaming several B tiles.

    SGMV: the grid holds max_slice / N_PER_PROG chunks for each of max_tiles tiles (planned as if
    every slot could be in the step, _slot_bound_tiles); the device deals that plane out over the
    real tiles (expand_kernel). Tiles of 32 rows or more take 64 columns where y is read back and 256
    where it is only written (_SGMV_EXPAND_BLOCK_N)."""
    bgmv = use_bgmv(meta) if bgmv is None else bgmv
    if bgmv:
        block_n = 64
    elif meta.block_m >= 32:
        block_n = _SGMV_EXPAND_BLOCK_N[add_inputs]
    else:
        block_n = 128
    n_blocks = -(-max_slice // block_n)
    programs = (meta.num_rows if bgmv else _slot_bound_tiles(meta)) * num_slices
    chunks = max(1, min(n_blocks, -(-2 * _TARGET_PROGRAMS // programs)))
    if not bgmv:
        chunks = max(chunks, _dealt(DEAL_EXPAND_PROGRAMS, meta, num_slices, n_blocks))
    return block_n, block_n * -(-n_blocks // chunks)


def stacked_expand_config(rank: int) -> tuple[int, int]:
    """(BLOCK_N, N_PER_PROG) of a stacked step's expand: one B tile of about 4096 elements per program.

    With no shrink before it to overlap, the expand's time is its B reads' latency: more programs each
    holding one larger tile keep more bytes in flight than a few streaming several small ones. H200, 32
    rows, rank 16, 1-32 adapters: o / down 8.6-8.9 -> 7.6-8.4 us, gate_up over 27 adapters 20.6 -> 17.7;
    rank 64 with 64-column tiles: o / down 9.7-12.1 -> 8.7-10.5 (bench/stacked_expand.py)."""
    block_n = max(64, min(256, 4096 // _block_r(rank)))
    return block_n, block_n


# Ranks an expand's rank mask covers at a time (triton_kernels.rank_mask); a plan setting, so that
# bench/punica_kernels.py --rank-mask-group can sweep it side by side.
RANK_MASK_GROUP = triton_kernels.RANK_MASK_GROUP.value


def shrink(out: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, ranks: torch.Tensor,
           meta: PunicaMetadata, scale: float, accumulate: bool, split_k: int, block_k: int,
           use_pdl: bool = False, bgmv: bool | None = None) -> None:
    """out [cap, S, T, R] fp32 (+)= scale * x [T, H] @ lora_a [S, L, R, H]^T (partials per K split).

    split_k: the grid's splits (shrink_config); SGMV uses up to out.shape[0] splits per real tile.
    use_pdl: launched under the kernel before it (programmatic dependent launch), reading its
    metadata and first A tile while that kernel finishes, and triggering the expand after it.
    bgmv: the path, as shrink_config planned it (None: use_bgmv(meta)).
    """
    num_slices, _, rank, hidden = lora_a.shape
    if meta.num_rows == 0:
        return
    if (use_bgmv(meta) if bgmv is None else bgmv) and not accumulate:
        bgmv_shrink_kernel[(meta.num_rows, split_k, num_slices)](
            x, lora_a, out, ranks, meta.slots,
            hidden, float(scale), split_k,
            x.stride(0), x.stride(1),
            *lora_a.stride(),
            *out.stride(),
            ranks.stride(0),
            R=rank, BLOCK_R=_block_r(rank), BLOCK_K=block_k, USE_PDL=use_pdl,
            PREFETCH_A=_k_steps(hidden, split_k, block_k) <= 2,
            num_warps=4, num_stages=2, **_pdl_kwargs(use_pdl),
        )
        return
    grid = (meta.max_tiles, split_k, num_slices)
    shrink_kernel[grid](
        x, lora_a, out, ranks,
        meta.sorted_idx, meta.tile_lora, meta.tile_start, meta.tile_end, meta.num_tiles,
        hidden, float(scale), out.shape[0], _deal_target(DEAL_SHRINK_PROGRAMS, meta),
        x.stride(0), x.stride(1),
        *lora_a.stride(),
        *out.stride(),
        ranks.stride(0),
        R=rank, BLOCK_M=meta.block_m, BLOCK_R=_block_r(rank), BLOCK_K=block_k,
        ACCUMULATE=accumulate, USE_PDL=use_pdl, IEEE=x.dtype == torch.float32,
        # Dealing only adds splits per tile, so the grid's split bounds every program's K steps.
        PREFETCH_A=_k_steps(hidden, split_k, block_k) <= 2,
        num_warps=4, num_stages=3, **_pdl_kwargs(use_pdl),
    )


def expand(y: torch.Tensor, buf: torch.Tensor, lora_b: torch.Tensor, ranks: torch.Tensor,
           slice_offsets: torch.Tensor, max_slice: int, meta: PunicaMetadata, offset_start: int,
           bias: torch.Tensor | None, add_inputs: bool, use_pdl: bool = False, shrink_splits: int = 1,
           buf_slot_stride: int = 0, bgmv: bool | None = None, one_tile: bool = False,
           zero_base: bool = False) -> None:
    """y[:, offset_start + slice] (+)= sum over splits of buf [split, S, T, R] @ lora_b [L, N, R]^T.

    use_pdl: launched right after this step's shrink, which triggered it. shrink_splits: that
    shrink's grid splits (shrink_config), from which SGMV knows how many partials it wrote.
    one_tile: a program per B tile (stacked_expand_config), for a stacked step's expand.
    zero_base (SGMV, with add_inputs False): rows with no adapter get zeros, so y is the whole delta.
    """
    split_k, num_slices, _, rank = buf.shape
    if meta.num_rows == 0:
        return
    bgmv = use_bgmv(meta) if bgmv is None else bgmv
    if zero_base and (bgmv or one_tile or add_inputs):
        raise ValueError("zero_base is for SGMV expands that write y (add_inputs=False)")
    block_n, n_per_prog = stacked_expand_config(rank) if one_tile else expand_config(
        meta, max_slice, num_slices, bgmv, add_inputs)
    if bgmv and split_k == _pow2_floor(split_k):
        bgmv_expand_kernel[(meta.num_rows, -(-max_slice // n_per_prog), num_slices)](
            buf, lora_b, y, ranks, slice_offsets, bias if bias is not None else lora_b, meta.slots,
            offset_start, n_per_prog,
            *buf.stride(), buf_slot_stride,
            *lora_b.stride(),
            y.stride(0), y.stride(1),
            ranks.stride(0), bias.stride(0) if bias is not None else 0,
            BLOCK_N=block_n, BLOCK_R=_block_r(rank),
            SPLIT_K=split_k, HAS_BIAS=bias is not None, ADD_INPUTS=add_inputs, USE_PDL=use_pdl,
            RANK_GROUP=RANK_MASK_GROUP, num_warps=4, num_stages=3, **_pdl_kwargs(use_pdl),
        )
        return
    zero_blocks = -(-meta.num_rows // meta.block_m) if zero_base else 0
    grid = (meta.max_tiles + zero_blocks, -(-max_slice // n_per_prog), num_slices)
    expand_kernel[grid](
        buf, lora_b, y, ranks, slice_offsets, bias if bias is not None else lora_b,
        meta.sorted_idx, meta.tile_lora, meta.tile_start, meta.tile_end, meta.num_tiles,
        offset_start, shrink_splits, split_k, _deal_target(DEAL_SHRINK_PROGRAMS, meta), -(-max_slice // block_n),
        _deal_target(DEAL_EXPAND_PROGRAMS, meta), meta.max_tiles, meta.num_rows,
        *buf.stride(), buf_slot_stride,
        *lora_b.stride(),
        y.stride(0), y.stride(1),
        ranks.stride(0), bias.stride(0) if bias is not None else 0,
        BLOCK_M=meta.block_m, BLOCK_N=block_n, BLOCK_R=_block_r(rank),
        HAS_BIAS=bias is not None, ADD_INPUTS=add_inputs, USE_PDL=use_pdl,
        IEEE=lora_b.dtype == torch.float32, ZERO_BASE=zero_base, RANK_GROUP=RANK_MASK_GROUP,
        num_warps=4, num_stages=3, **_pdl_kwargs(use_pdl),
    )
