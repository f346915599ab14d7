"""replicas/token_logprobs.py's tensor in two launches.

_partials: a program per (row, split of the vocabulary) makes one pass over its columns with per-lane running
max, rescaled sum of exponentials and count of logits above the drawn token's; it stores the three reduced.
Then k more passes over the same columns (from L2) each take the split's next most likely token: its top k,
ordered by logit, ties by id. A program per row alone would leave most SMs idle at decode batch sizes (a row
of 128 K logits per SM).
_combine: a program per row merges its splits (logsumexp = M + log sum s_i e^(m_i - M)), takes the row's top k
out of the splits' (k passes over them in registers) and writes the row: token id, its logprob, its rank, then
the top k's logprobs and ids.

Why not torch.topk: over a 128 K vocabulary it cost 122 us of host time a call on an H200 (5.5 x an empty
Triton launch; bench/launch_overhead.py), half of the whole function's, for k <= 20 of 128 K values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replicas.sampling_params import MAX_LOGPROBS

BLOCK = 2048
SPLITS = 16  # at most, per row: 128 K columns -> 16 programs of 8 K
BLOCK_K = triton.next_power_of_2(MAX_LOGPROBS)


NO_ID = tl.constexpr(2147483647)  # a candidate slot that holds no token (a split of fewer than k columns)


@triton.jit
def _next_best(values, ids, eligible):
    """(the largest of values where eligible, the smallest of ids among those that equal it), as 0-d tensors;
    (-inf, NO_ID) where none is eligible."""
    top = tl.max(tl.where(eligible, values, -float("inf")))
    return top, tl.min(tl.where(eligible & (values == top), ids, NO_ID))


@triton.jit
def _after(values, ids, last_value, last_id):
    """values / ids that come after (last_value, last_id) in the order logit descending, then id ascending."""
    return (values < last_value) | ((values == last_value) & (ids > last_id))


@triton.jit(do_not_specialize=["k"])
def _partials_kernel(logits_ptr, token_ptr, part_ptr, cand_value_ptr, cand_id_ptr, vocab, stride, per_split, k,
                     SPLIT_SLOTS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK: tl.constexpr):
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
    # the split's top k, one per pass: the best after the previous one
    cand = (row * SPLIT_SLOTS + split) * BLOCK_K
    last_value = tl.full([], float("inf"), tl.float32)
    last_id = tl.full([], -1, tl.int32)
    for i in range(0, k):
        best_value = tl.full([], -float("inf"), tl.float32)
        best_id = tl.full([], NO_ID, tl.int32)
        for offset in range(start, end, BLOCK):
            cols = offset + tl.arange(0, BLOCK)
            x = tl.load(base + cols, mask=cols < end, other=-float("inf")).to(tl.float32)
            value, id = _next_best(x, cols, (cols < end) & _after(x, cols, last_value, last_id))
            better = (value > best_value) | ((value == best_value) & (id < best_id))
            best_value = tl.where(better, value, best_value)
            best_id = tl.where(better, id, best_id)
        tl.store(cand_value_ptr + cand + i, best_value)
        tl.store(cand_id_ptr + cand + i, best_id)
        last_value, last_id = best_value, best_id


# k (and the top-k tensor's width) varies by request: left unspecialized (as ints Triton would compile 1 and
# multiples of 16 apart), with BLOCK_K the one width that covers every k a request may ask for, the kernel
# compiles once (at warm-up)
@triton.jit(do_not_specialize=["k"])
def _combine_kernel(logits_ptr, token_ptr, part_ptr, cand_value_ptr, cand_id_ptr, out_ptr, stride, splits, k,
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
    # the row's top k out of the splits' k each: [SPLIT_SLOTS, BLOCK_K] candidates in registers
    j = tl.arange(0, BLOCK_K)
    cands = (row * SPLIT_SLOTS + s[:, None]) * BLOCK_K + j[None, :]
    valid = used[:, None] & (j[None, :] < k)
    values = tl.load(cand_value_ptr + cands, mask=valid, other=-float("inf"))
    ids = tl.load(cand_id_ptr + cands, mask=valid, other=NO_ID)
    valid = valid & (ids != NO_ID)
    last_value = tl.full([], float("inf"), tl.float32)
    last_id = tl.full([], -1, tl.int32)
    for i in range(0, k):
        last_value, last_id = _next_best(values, ids, valid & _after(values, ids, last_value, last_id))
        tl.store(out + 3 + i, last_value - lse)
        tl.store(out + 3 + k + i, last_id.to(tl.float32))


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> torch.Tensor:
    """logits [N, V] (any float dtype, computed in float32; rows may be strided), token_ids [N] int64 ->
    [N, 3 + 2k] float32."""
    n, vocab = logits.shape
    if logits.stride(1) != 1 or k > BLOCK_K:
        raise ValueError(f"token_logprobs: rows must be contiguous and k at most {BLOCK_K}, got k = {k}")
    per_split = BLOCK * triton.cdiv(triton.cdiv(vocab, SPLITS), BLOCK)
    splits = triton.cdiv(vocab, per_split)
    slots = triton.next_power_of_2(splits)
    parts = torch.empty((n, slots, 3), dtype=torch.float32, device=logits.device)
    cand_values = torch.empty((n, slots, BLOCK_K), dtype=torch.float32, device=logits.device)
    cand_ids = torch.empty((n, slots, BLOCK_K), dtype=torch.int32, device=logits.device)
    token_ids = token_ids.contiguous()
    _partials_kernel[(n, splits)](logits, token_ids, parts, cand_values, cand_ids, vocab, logits.stride(0), per_split,
                                  k, SPLIT_SLOTS=slots, BLOCK_K=BLOCK_K, BLOCK=BLOCK, num_warps=8)
    out = torch.empty((n, 3 + 2 * k), dtype=torch.float32, device=logits.device)
    _combine_kernel[(n,)](logits, token_ids, parts, cand_values, cand_ids, out, logits.stride(0), splits, k,
                          SPLIT_SLOTS=slots, BLOCK_K=BLOCK_K, num_warps=1)
    return out
