"""replicas/nucleus_draw.py's draw in one launch: a program per row, passing over the row in blocks.

Pass 1 finds the row's largest scaled logit (min_p's floor is relative to it); pass 2 sums the kept mass S
and finds the argmax w of l / T - ln(q) over the kept tokens; then each round sums the mass above w (is w in
the nucleus: mass < top_p * S?) and, in the same pass, the argmax over the tokens above w (the next round's
w, used only if this one is out). Masses are sums of exp(l / T - max), so S's scale cancels. Sums run in
another order than torch's: a token sitting on the nucleus's boundary to the last bit may be judged apart.
A program per row leaves most SMs idle at small batches; splitting a row would need a second launch or a
grid-wide wait, for a draw that is already a few percent of a decode step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replicas.kernels.seeded_noise import exp_noise

BLOCK = 4096  # with 16 warps: 0.20 ms for 32 rows x 128 K on an H200, against 0.28 at 2048 with 8 (RESULTS.md)
NO_COLUMN: tl.constexpr = tl.constexpr(2 ** 31 - 1)  # a kernel reads module globals only as constexprs


@triton.jit
def _lane_argmax(best, winner, scores, cols):
    """Each lane's running (best score, its column): a lane sees its columns in order, so > keeps the first."""
    better = scores > best
    return tl.where(better, scores, best), tl.where(better, cols, winner)


@triton.jit
def _first_argmax(best, winner):
    """The lanes' (best score, its column) -> the row's: the first column holding the largest score."""
    top = tl.max(best, axis=0)
    return tl.min(tl.where(best == top, winner, NO_COLUMN), axis=0)


@triton.jit
def _pass(base, vocab, temperature, top, threshold, low, high, STRICT: tl.constexpr, BLOCK: tl.constexpr):
    """One pass over the row, over the tokens whose scaled logit is above threshold (at or above it unless
    STRICT): their mass (sum of exp(l / T - top)) and the first argmax of their scores l / T - ln(q).
    Per-lane partial sums and argmaxes, reduced once at the end: a reduction across the block at every step
    would cost more than the step's loads."""
    offsets = tl.arange(0, BLOCK)
    lane_mass = tl.zeros((BLOCK,), tl.float32)
    lane_best = tl.full((BLOCK,), -float("inf"), tl.float32)
    lane_winner = tl.zeros((BLOCK,), tl.int32)
    for start in range(0, vocab, BLOCK):
        cols = start + offsets
        scaled = tl.load(base + cols, mask=cols < vocab, other=-float("inf")) / temperature
        if STRICT:
            counted = (cols < vocab) & (scaled > threshold)
        else:
            counted = (cols < vocab) & (scaled >= threshold)
        lane_mass += tl.where(counted, tl.exp(scaled - top), 0.0)
        scores = tl.where(counted, scaled - tl.log(exp_noise(cols.to(tl.uint32), low, high)), -float("inf"))
        lane_best, lane_winner = _lane_argmax(lane_best, lane_winner, scores, cols)
    return tl.sum(lane_mass, axis=0), _first_argmax(lane_best, lane_winner)


@triton.jit
def _nucleus_kernel(logits_ptr, settings_ptr, pairs_ptr, out_ptr, vocab, stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride
    temperature = tl.load(settings_ptr + row * 3)
    top_p = tl.load(settings_ptr + row * 3 + 1)
    log_min_p = tl.load(settings_ptr + row * 3 + 2)
    low = tl.load(pairs_ptr + row * 2).to(tl.uint32)
    high = tl.load(pairs_ptr + row * 2 + 1).to(tl.uint32)
    offsets = tl.arange(0, BLOCK)

    lane_top = tl.full((BLOCK,), -float("inf"), tl.float32)
    for start in range(0, vocab, BLOCK):
        cols = start + offsets
        lane_top = tl.maximum(lane_top, tl.load(base + cols, mask=cols < vocab, other=-float("inf")) / temperature)
    top = tl.max(lane_top, axis=0)

    # the kept mass S and the first w: every token min_p keeps
    total, winner = _pass(base, vocab, temperature, top, top + log_min_p, low, high, False, BLOCK)
    inside = False
    while not inside:
        pivot = tl.load(base + winner) / temperature
        above, after = _pass(base, vocab, temperature, top, pivot, low, high, True, BLOCK)
        # Nothing above w: w is the most likely token, always inside, so every row ends, a row of NaN or -inf
        # logits too (its total is NaN, no comparison with it holds). Else the next w is strictly above this one.
        inside = (above == 0.0) | (above < top_p * total)
        winner = tl.where(inside, winner, after)
    tl.store(out_ptr + row, winner.to(tl.int64))


def draw_nucleus(logits: torch.Tensor, settings: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    rows, vocab = logits.shape
    logits = logits if logits.stride(1) == 1 else logits.contiguous()  # the kernel steps along a row by 1
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        _nucleus_kernel[(rows,)](logits, settings, pairs, out, vocab, logits.stride(0), BLOCK=BLOCK, num_warps=16)
    return out
