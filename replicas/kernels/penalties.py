"""replicas/penalties.py's arithmetic in one launch, and the count of each drawn token in another.

penalize: a program per (row, block of the vocabulary) reads the row's settings (slot, repetition,
frequency, presence), its logits and, for a penalized row, its slot's counts and prompt marks, and writes
the penalized logits; a row with slot -1 is copied. Same operations in the same order as the torch code,
no fused multiply-add and a correctly rounded division: bit for bit torch's on CUDA and under the
interpreter. record: a program per row adds 1 to its slot's count of the token drawn (an atomic: two rows
never share a slot, but the add needs no read back of either). Grids from shapes only; nothing read back.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replicas.kernels.fused import _launch_opts

BLOCK = 2048


@triton.jit
def _penalize_kernel(logits_ptr, out_ptr, counts_ptr, prompt_ptr, settings_ptr, vocab, logits_stride,
                     BLOCK: tl.constexpr, PRECISE: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < vocab
    x = tl.load(logits_ptr + row.to(tl.int64) * logits_stride + cols, mask=inside)
    slot = tl.load(settings_ptr + row * 4).to(tl.int64)
    if slot >= 0:
        rep = tl.load(settings_ptr + row * 4 + 1)
        freq = tl.load(settings_ptr + row * 4 + 2)
        presence = tl.load(settings_ptr + row * 4 + 3)
        counts = tl.load(counts_ptr + slot * vocab + cols, mask=inside, other=0.0)
        seen = (tl.load(prompt_ptr + slot * vocab + cols, mask=inside, other=0) != 0) | (counts > 0)
        if PRECISE:  # Triton's float32 `/` is approximate on CUDA; torch's is rounded correctly
            divided = tl.math.div_rn(x, rep)
        else:
            divided = x / rep
        x = tl.where(seen, tl.where(x > 0, divided, x * rep), x)
        x = x - freq * counts - presence * (counts > 0).to(tl.float32)
    tl.store(out_ptr + row.to(tl.int64) * vocab + cols, x, mask=inside)


@triton.jit
def _record_kernel(counts_ptr, settings_ptr, token_ptr, vocab):
    row = tl.program_id(0)
    slot = tl.load(settings_ptr + row * 4).to(tl.int64)
    if slot >= 0:
        tl.atomic_add(counts_ptr + slot * vocab + tl.load(token_ptr + row), 1.0)


def penalize(logits: torch.Tensor, counts: torch.Tensor, prompt: torch.Tensor, settings: torch.Tensor
             ) -> torch.Tensor:
    """logits [N, V] float32 (rows may be strided), counts [S, V] float32, prompt [S, V] uint8, settings
    [N, 4] float32 -> new [N, V] logits."""
    n, vocab = logits.shape
    if logits.stride(1) != 1 or not counts.is_contiguous() or not prompt.is_contiguous():
        raise ValueError("penalize: logits rows, counts and prompt must be contiguous along the vocabulary")
    out = torch.empty((n, vocab), dtype=logits.dtype, device=logits.device)
    _penalize_kernel[(n, triton.cdiv(vocab, BLOCK))](
        logits, out, counts, prompt, settings.contiguous(), vocab, logits.stride(0), BLOCK=BLOCK,
        PRECISE=logits.is_cuda, num_warps=8, **_launch_opts(logits))
    return out


def record(counts: torch.Tensor, settings: torch.Tensor, token_ids: torch.Tensor) -> None:
    """counts[slot of row i, token_ids[i]] += 1 for every row with a slot (settings[:, 0] >= 0)."""
    _record_kernel[(token_ids.shape[0],)](counts, settings.contiguous(), token_ids.contiguous(), counts.shape[1])
