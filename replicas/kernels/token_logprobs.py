"""replicas/token_logprobs.py's tensor: torch.topk, then two launches.

_partials: a program per (row, split of the vocabulary) makes one pass over its columns with per-lane running
max, rescaled sum of exponentials and count of logits above the drawn token's; it stores the three reduced.
A program per row alone would leave most SMs idle at decode batch sizes (a row of 128 K logits per SM).
_combine: a program per row merges its splits (logsumexp = M + log sum s_i e^(m_i - M)) and writes the row:
token id, its logprob, its rank, then the top k's logprobs and ids.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replicas.sampling_params import MAX_LOGPROBS

BLOCK = 2048
SPLITS = 16  # at most, per row: 128 K columns -> 16 programs of 8 K
BLOCK_K = triton.next_power_of_2(MAX_LOGPROBS)


@triton.jit
def _partials_kernel(logits_ptr, token_ptr, part_ptr, vocab, stride, per_split, SPLIT_SLOTS: tl.constexpr,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0)
    split = tl.program_id(1)
    base = logits_ptr + row.to(tl.int64) * stride
    chosen = tl.load(base + tl.load(token_ptr + row)).to(tl.float32)
    lane_max = tl.full((BLOCK,), -float("inf"), tl.float32)
    lane_sum = tl.zeros((BLOCK,), tl.float32)
    lane_above = tl.zeros((BLOCK,), tl.int32)
    start = split * per_split
    end = tl.minimum(start + per_split, vocab)
    for offset in range(start, end, BLOCK):
        cols = offset + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < end, other=-float("inf")).to(tl.float32)
        new_max = tl.maximum(lane_max, x)
        shift = tl.where(new_max == -float("inf"), 0.0, new_max)  # a lane with only -inf so far: sums stay 0
        lane_sum = lane_sum * tl.exp(lane_max - shift) + tl.exp(x - shift)
        lane_max = new_max
        lane_above += (x > chosen).to(tl.int32)
    top = tl.max(lane_max, axis=0)
    shift = tl.where(top == -float("inf"), 0.0, top)
    out = part_ptr + (row * SPLIT_SLOTS + split) * 3
    tl.store(out, top)
    tl.store(out + 1, tl.sum(lane_sum * tl.exp(lane_max - shift), axis=0))
    tl.store(out + 2, tl.sum(lane_above, axis=0).to(tl.float32))


# k (and the top-k tensor's width) varies by request: left unspecialized (as ints Triton would compile 1 and
# multiples of 16 apart), with BLOCK_K the one width that covers every k a request may ask for, the kernel
# compiles once (at warm-up)
@triton.jit(do_not_specialize=["k", "top_stride"])
def _combine_kernel(logits_ptr, token_ptr, part_ptr, top_ptr, ids_ptr, out_ptr, stride, splits, k, top_stride,
                    SPLIT_SLOTS: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0)
    s = tl.arange(0, SPLIT_SLOTS)
    parts = part_ptr + (row * SPLIT_SLOTS + s) * 3
    used = s < splits
    maxes = tl.load(parts, mask=used, other=-float("inf"))
    top = tl.max(maxes, axis=0)
    shift = tl.where(top == -float("inf"), 0.0, top)
    total = tl.sum(tl.load(parts + 1, mask=used, other=0.0) * tl.exp(maxes - shift), axis=0)
    lse = shift + tl.log(total)
    token = tl.load(token_ptr + row)
    out = out_ptr + row * (3 + 2 * k)
    tl.store(out, token.to(tl.float32))
    tl.store(out + 1, tl.load(logits_ptr + row.to(tl.int64) * stride + token).to(tl.float32) - lse)
    tl.store(out + 2, tl.sum(tl.load(parts + 2, mask=used, other=0.0), axis=0) + 1.0)
    j = tl.arange(0, BLOCK_K)
    first_k = j < k
    tl.store(out + 3 + j, tl.load(top_ptr + row * top_stride + j, mask=first_k).to(tl.float32) - lse, mask=first_k)
    tl.store(out + 3 + k + j, tl.load(ids_ptr + row * top_stride + j, mask=first_k).to(tl.float32), mask=first_k)


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> torch.Tensor:
    """logits [N, V] (any float dtype, computed in float32; rows may be strided), token_ids [N] int64 ->
    [N, 3 + 2k] float32."""
    n, vocab = logits.shape
    if logits.stride(1) != 1 or k > BLOCK_K:
        raise ValueError(f"token_logprobs: rows must be contiguous and k at most {BLOCK_K}, got k = {k}")
    # at least one column: a CUDA tensor of no elements has no address, and Triton refuses such an argument
    top, ids = logits.topk(max(k, 1), dim=-1)
    per_split = BLOCK * triton.cdiv(triton.cdiv(vocab, SPLITS), BLOCK)
    splits = triton.cdiv(vocab, per_split)
    slots = triton.next_power_of_2(splits)
    parts = torch.empty((n, slots, 3), dtype=torch.float32, device=logits.device)
    token_ids = token_ids.contiguous()
    _partials_kernel[(n, splits)](logits, token_ids, parts, vocab, logits.stride(0), per_split, SPLIT_SLOTS=slots,
                                  BLOCK=BLOCK, num_warps=8)
    out = torch.empty((n, 3 + 2 * k), dtype=torch.float32, device=logits.device)
    _combine_kernel[(n,)](logits, token_ids, parts, top.contiguous(), ids.contiguous(), out, logits.stride(0),
                          splits, k, top.shape[1], SPLIT_SLOTS=slots, BLOCK_K=BLOCK_K, num_warps=1)
    return out
