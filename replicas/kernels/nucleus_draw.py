"""replicas/nucleus_draw.py's draw in one launch: a program per row, passing over the row in blocks.

Pass 1 finds the row's largest scaled logit (min_p's floor is relative to it); pass 2 sums the kept mass S
and finds the argmax w of l / T - ln(q) over the kept tokens; then each round sums the mass above w (is w in
the nucleus: mass < top_p * S?) and, in the same pass, the argmax over the tokens above w (the next round's
w, used only if this one is out). Masses are sums of exp(l / T - max), so S's scale cancels. Sums run in
another order than torch's: a token sitting on the nucleus's boundary to the last bit may be judged apart.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replicas.kernels.seeded_noise import exp_noise

BLOCK = 2048


@triton.jit
def _argmax_update(best, winner, scores, start, BLOCK: tl.constexpr):
    """The running (best score, its column) after one block's scores; the earlier column wins a tie."""
    block_best = tl.max(scores, axis=0)
    column = start + tl.argmax(scores, axis=0)
    better = block_best > best
    return tl.where(better, block_best, best), tl.where(better, column, winner)


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

    top = -float("inf")
    for start in range(0, vocab, BLOCK):
        cols = start + offsets
        scaled = tl.load(base + cols, mask=cols < vocab, other=-float("inf")) / temperature
        top = tl.maximum(top, tl.max(scaled, axis=0))
    floor = top + log_min_p

    total = 0.0
    best = -float("inf")
    winner = 0
    for start in range(0, vocab, BLOCK):
        cols = start + offsets
        scaled = tl.load(base + cols, mask=cols < vocab, other=-float("inf")) / temperature
        kept = (cols < vocab) & (scaled >= floor)
        total += tl.sum(tl.where(kept, tl.exp(scaled - top), 0.0), axis=0)
        scores = tl.where(kept, scaled - tl.log(exp_noise(cols.to(tl.uint32), low, high)), -float("inf"))
        best, winner = _argmax_update(best, winner, scores, start, BLOCK)

    inside = False
    while not inside:
        pivot = tl.load(base + winner) / temperature
        above = 0.0
        best = -float("inf")
        next_winner = winner
        for start in range(0, vocab, BLOCK):
            cols = start + offsets
            scaled = tl.load(base + cols, mask=cols < vocab, other=-float("inf")) / temperature
            more = (cols < vocab) & (scaled > pivot)
            above += tl.sum(tl.where(more, tl.exp(scaled - top), 0.0), axis=0)
            scores = tl.where(more, scaled - tl.log(exp_noise(cols.to(tl.uint32), low, high)), -float("inf"))
            best, next_winner = _argmax_update(best, next_winner, scores, start, BLOCK)
        inside = above < top_p * total
        winner = tl.where(inside, winner, next_winner)
    tl.store(out_ptr + row, winner.to(tl.int64))


def draw_nucleus(logits: torch.Tensor, settings: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    rows, vocab = logits.shape
    logits = logits if logits.stride(1) == 1 else logits.contiguous()  # the kernel steps along a row by 1
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        _nucleus_kernel[(rows,)](logits, settings, pairs, out, vocab, logits.stride(0), BLOCK=BLOCK, num_warps=8)
    return out
