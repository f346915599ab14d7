"""One launch per LoRA site at decode sizes: y = x @ W^T + per row x @ A[slot]^T @ B[slot]^T.

Why: a decode step runs every LoRA linear as a cuBLAS GEMM and at least one
LoRA kernel after it (an 8B model: 128 of them, 0.6-0.9 ms per step on an
H200 even when their bytes take 0.1 ms). Here one
Triton kernel does both, and reads each active adapter's A and B once:

    phase A  (the first MAXA x A_SPLITS tickets)  a K-split of s[j] = x @ A[active[j]]^T for every row,
             [M, S*R] fp32 partials (the reader sums the splits, so the sum order never varies)
    phase W  (the other tickets)  one N-tile of y = x @ W^T over a K-split; the program that completes
             the tile adds, per row m of slot active[j], s[j][m, slice's R] @ B[slot][tile]^T

Tickets (an atomic counter taken when a program starts) order the phases:
a program that waits for phase A holds a later ticket than every program of
phase A, which is therefore running already and waits for nothing, so the
kernel cannot deadlock whatever order the GPU starts programs in. The program
that takes the last exit ticket zeroes the counters for the next launch, and
the last K-split of a tile to arrive sums every split's partial in split
order (no second kernel, and the same bits every launch).

The expand gathers each row's B tile [BN, R] (rows of one adapter hit L2;
the loads are issued before the K loop unless prefetch_b is off), so the
step's A and B bytes are read once. A dense form (one tl.dot over every
active adapter's R columns) was tried: it costs MAXA x R x BN registers and
lost at 14 adapters and more (bench/lora_gemm.py).

The engine calls it through PunicaWrapper.add_lora_gemm for small steps of
few adapters, with tiling()'s settings; bench/lora_gemm.py measures it per site
and in situ. Requires: rank a power of two >= 16, block_n dividing every
output slice, block_k dividing K.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lora_core.punica.triton_kernels import _dot  # float32 products in float32, as cuBLAS computes them

# The expand adds a row's LoRA term this many ranks at a time: each row's B tile is gathered into registers
# (rows x block_n x chunk), which the tilings measured at rank 16 hold.
RANK_CHUNK = 16


@triton.jit
def lora_gemm_kernel(
    x_ptr, w_ptr, y_ptr, a_ptr, b_ptr, slots_ptr, row_act_ptr, active_ptr, num_active_ptr, slice_off_ptr,
    s_ws_ptr, y_ws_ptr, cnt_ptr, tile_cnt_ptr,
    M, N, K,
    sx_m, sw_n, sy_m, sa_l, sa_q, sb_l, sb_n,
    SR: tl.constexpr, SRP: tl.constexpr, R: tl.constexpr, RC: tl.constexpr, S: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BKA: tl.constexpr,
    SPLIT_W: tl.constexpr, MAXA: tl.constexpr, A_SPLITS: tl.constexpr, PREFETCH_B: tl.constexpr,
    IEEE: tl.constexpr,
):
    grid = tl.num_programs(0)
    ticket = tl.atomic_add(cnt_ptr, 1)
    offs_m = tl.arange(0, BM)
    m_mask = offs_m < M
    if ticket < MAXA * A_SPLITS:
        j = ticket // A_SPLITS
        a_split = ticket % A_SPLITS
        if j < tl.load(num_active_ptr):
            slot = tl.load(active_ptr + j)
            offs_q = tl.arange(0, SRP)
            q_mask = offs_q < SR
            acc_s = tl.zeros((BM, SRP), dtype=tl.float32)
            a_rows = a_ptr + slot.to(tl.int64) * sa_l + offs_q[None, :] * sa_q
            ka_chunk = tl.cdiv(K, A_SPLITS * BKA) * BKA
            for k in range(a_split * ka_chunk, tl.minimum(a_split * ka_chunk + ka_chunk, K), BKA):
                offs_k = k + tl.arange(0, BKA)
                k_mask = offs_k < K
                xt = tl.load(x_ptr + offs_m[:, None] * sx_m + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                             other=0.0)
                at = tl.load(a_rows + offs_k[:, None], mask=k_mask[:, None] & q_mask[None, :], other=0.0)
                acc_s += _dot(xt, at, IEEE)
            tl.store(s_ws_ptr + (a_split * MAXA + j) * BM * SRP + offs_m[:, None] * SRP + offs_q[None, :], acc_s)
        tl.debug_barrier()
        tl.atomic_add(cnt_ptr + 1, 1, sem="release")
    else:
        t = ticket - MAXA * A_SPLITS
        tile = t // SPLIT_W
        split = t % SPLIT_W
        n0 = tile * BN
        offs_n = n0 + tl.arange(0, BN)
        if MAXA > 0:
            # Everything the LoRA epilogue needs but phase A's output, loaded before the K loop: each row's
            # slot and active index, the tile's slice, and each row's B tile (rows of one adapter hit L2).
            row_slot = tl.load(slots_ptr + offs_m, mask=m_mask, other=-1)
            row_act = tl.load(row_act_ptr + offs_m, mask=m_mask, other=-1)
            sl = 0
            for i in tl.static_range(1, S):
                sl += (n0 >= tl.load(slice_off_ptr + i)).to(tl.int32)
            offs_r = tl.arange(0, RC)
            if PREFETCH_B:
                bg = tl.load(b_ptr + row_slot[:, None, None].to(tl.int64) * sb_l
                             + offs_n[None, :, None].to(tl.int64) * sb_n + offs_r[None, None, :],
                             mask=(row_slot >= 0)[:, None, None], other=0.0)
        k_chunk = tl.cdiv(K, SPLIT_W * BK) * BK
        k_lo = split * k_chunk
        k_hi = tl.minimum(k_lo + k_chunk, K)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        w_rows = w_ptr + offs_n[:, None].to(tl.int64) * sw_n
        for k in range(k_lo, k_hi, BK):
            offs_k = k + tl.arange(0, BK)
            xt = tl.load(x_ptr + offs_m[:, None] * sx_m + offs_k[None, :], mask=m_mask[:, None], other=0.0)
            wt = tl.load(w_rows + offs_k[None, :])
            acc += _dot(xt, tl.trans(wt), IEEE)
        last = True
        if SPLIT_W > 1:
            part = y_ws_ptr + tile * (SPLIT_W * BM * BN) + offs_m[:, None] * BN + tl.arange(0, BN)[None, :]
            tl.store(part + split * BM * BN, acc)
            tl.debug_barrier()
            arrived = tl.atomic_add(tile_cnt_ptr + tile, 1, sem="acq_rel")
            last = arrived == SPLIT_W - 1
            if last:  # every partial summed in split order, so launches agree bit for bit
                acc = tl.zeros((BM, BN), dtype=tl.float32)
                for other in range(SPLIT_W):
                    acc += tl.load(part + other * BM * BN, cache_modifier=".cg")
                tl.store(tile_cnt_ptr + tile, 0)
        if last:
            if MAXA > 0:
                done = tl.atomic_add(cnt_ptr + 1, 0, sem="acquire")
                while done < MAXA * A_SPLITS:
                    done = tl.atomic_add(cnt_ptr + 1, 0, sem="acquire")
                # RC of the rank at a time (the whole rank where PREFETCH_B holds it): the gathered B tiles take
                # BM x BN x RC registers.
                for r0 in tl.static_range(0, R, RC):
                    if not PREFETCH_B:
                        bg = tl.load(b_ptr + row_slot[:, None, None].to(tl.int64) * sb_l
                                     + offs_n[None, :, None].to(tl.int64) * sb_n + r0 + offs_r[None, None, :],
                                     mask=(row_slot >= 0)[:, None, None], other=0.0)
                    s_rows = (s_ws_ptr + row_act[:, None] * (BM * SRP) + offs_m[:, None] * SRP + sl * R + r0
                              + offs_r[None, :])
                    srow = tl.zeros((BM, RC), dtype=tl.float32)
                    for sp in tl.static_range(A_SPLITS):
                        srow += tl.load(s_rows + sp * (MAXA * BM * SRP), mask=(row_act >= 0)[:, None], other=0.0,
                                        cache_modifier=".cg")
                    acc += tl.sum(bg.to(tl.float32) * srow[:, None, :], axis=2)
            tl.store(y_ptr + offs_m[:, None] * sy_m + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
                     mask=m_mask[:, None])
    tl.debug_barrier()
    if tl.atomic_add(cnt_ptr + 2, 1, sem="acq_rel") == grid - 1:
        tl.store(cnt_ptr, 0)
        tl.store(cnt_ptr + 1, 0)
        tl.store(cnt_ptr + 2, 0)


class LoRAGemm:
    """Workspaces and launch of lora_gemm_kernel for one site shape. Launches in stream order may share one
    (each leaves its counters at zero for the next: PunicaWrapper shares one across a model's layers);
    launches that may overlap must not."""

    def __init__(self, n: int, k: int, slices: tuple[int, ...], rank: int, max_rows: int, max_active: int,
                 device, block_n: int = 64, block_k: int = 128, split_w: int = 1, block_ka: int = 128,
                 num_warps: int = 4, num_stages: int = 4, a_splits: int = 1, prefetch_b: bool | None = None) -> None:
        if rank < 16 or rank & (rank - 1):
            raise ValueError(f"rank {rank}: LoRAGemm needs a power of two >= 16 (pad the slots)")
        prefetch_b = rank <= RANK_CHUNK if prefetch_b is None else prefetch_b  # default: where registers allow
        if prefetch_b and rank > RANK_CHUNK:
            raise ValueError(f"prefetch_b holds each row's whole B tile (rank {rank}) in registers: rank "
                             f"<= {RANK_CHUNK} only")
        if n % block_n or any(width % block_n for width in slices) or k % block_k:
            raise ValueError(f"block_n {block_n} must divide N {n} and every slice {slices}; block_k {block_k} K {k}")
        self.n, self.k, self.slices, self.rank = n, k, slices, rank
        self.rank_chunk = min(rank, RANK_CHUNK)
        self.block_m = max(16, triton.next_power_of_2(max_rows))
        self.block_n, self.block_k, self.split_w, self.block_ka = block_n, block_k, split_w, block_ka
        self.num_warps, self.num_stages = num_warps, num_stages
        self.a_splits, self.prefetch_b = a_splits, prefetch_b
        self.max_active = max_active
        sr = len(slices) * rank
        self.srp = max(16, triton.next_power_of_2(sr))
        self.tiles = n // block_n
        self.s_ws = torch.empty(a_splits * max(1, max_active) * self.block_m * self.srp, dtype=torch.float32,
                                device=device)
        self.y_ws = torch.empty(self.tiles * split_w * self.block_m * block_n if split_w > 1 else 1,
                                dtype=torch.float32, device=device)
        self.cnt = torch.zeros(3, dtype=torch.int32, device=device)
        self.tile_cnt = torch.zeros(self.tiles, dtype=torch.int32, device=device)
        offsets = [0]
        for width in slices:
            offsets.append(offsets[-1] + width)
        self.slice_off = torch.tensor(offsets, dtype=torch.int32, device=device)

    def __call__(self, y, x, w, a, b, slots, row_active, active, num_active, max_active: int | None = None) -> None:
        """y [M, N] = x [M, K] @ w [N, K]^T + LoRA. a [L, S*R, K] rows per slot (stride sa_q), b [L, N, R];
        slots [M] each row's slot (-1 none), row_active [M] its index in active (-1 none); active
        [>= num_active] the step's distinct slots, num_active [1], at most max_active (a device value: the
        caller's to guarantee; PunicaMetadata's arrays are these)."""
        maxa = self.max_active if max_active is None else max_active
        m = x.shape[0]
        if maxa > self.max_active or m > self.block_m:
            raise ValueError(f"{m} rows and {maxa} adapters exceed the {self.block_m} rows and {self.max_active} "
                             "adapters this LoRAGemm's workspaces hold")
        if any(t.stride(-1) != 1 for t in (x, w, y, a, b)):
            raise ValueError("x, w, y, a and b must be contiguous along their last dimension")
        grid = (maxa * self.a_splits + self.tiles * self.split_w,)
        lora_gemm_kernel[grid](
            x, w, y, a, b, slots, row_active, active, num_active, self.slice_off,
            self.s_ws, self.y_ws, self.cnt, self.tile_cnt,
            m, self.n, self.k,
            x.stride(0), w.stride(0), y.stride(0), a.stride(0), a.stride(1), b.stride(0), b.stride(1),
            SR=len(self.slices) * self.rank, SRP=self.srp, R=self.rank, RC=self.rank_chunk, S=len(self.slices),
            BM=self.block_m, BN=self.block_n, BK=self.block_k, BKA=self.block_ka,
            SPLIT_W=self.split_w, MAXA=maxa, A_SPLITS=self.a_splits, PREFETCH_B=self.prefetch_b,
            IEEE=x.dtype == torch.float32,
            num_warps=self.num_warps, num_stages=self.num_stages,
        )


def tiling(n: int, k: int, slices: tuple[int, ...], rank: int) -> dict | None:
    """LoRAGemm settings for a site at decode sizes (<= 32 rows), or None where the kernel does not apply.

    From bench/lora_gemm.py on an H100, 32 rows, 8B sites: 32-column tiles but
    64 for gate_up-sized outputs (more programs than SMs either way), 256-deep K steps when there are at
    most 128 tiles (o, down), else 128 (shallower where K needs it), phase A split 4 ways. Rank 16 only: at
    rank 64 the best tilings of a sweep (bench/lora_gemm.py --rank 64) ran 1.08-1.27 x cuBLAS per site with one
    adapter, and in situ one adapter cost +1025 us per step against the stacked path's +868, Zipf-14 +3629
    against +3076 (H100).
    """
    if rank != 16:
        return None
    block_n = 64 if n >= 16384 else 32
    if n % block_n or any(width % block_n for width in slices):
        return None
    depths = (256, 128, 64, 32) if n // block_n <= 128 else (128, 64, 32)
    block_k = next((d for d in depths if k % d == 0), None)
    return dict(block_n=block_n, block_k=block_k, a_splits=4) if block_k else None


def reference(x, w, a, b, slots, slices, rank) -> torch.Tensor:
    """The plain-torch meaning: x @ w^T, plus for each row of slot s>=0 and slice i:
    (x @ A[s, i*R:(i+1)*R]^T) @ B[s, slice i cols]^T."""
    y = x.float() @ w.float().t()
    start = 0
    for i, width in enumerate(slices):
        for row, slot in enumerate(slots.tolist()):
            if slot < 0:
                continue
            s = x[row].float() @ a[slot, i * rank:(i + 1) * rank].float().t()
            y[row, start:start + width] += s @ b[slot, start:start + width].float().t()
        start += width
    return y
