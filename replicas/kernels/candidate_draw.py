"""replicas/candidate_draw.py's draw in one launch: a program per row holds the row's K candidates.

K is at most the sampler's TOP_K_CANDIDATES (1,024), so a row fits one block: temperature, the top_k and
min_p masks, softmax, the top_p prefix sums (tl.cumsum), the key's noise (seeded_noise's hash) and the
argmax, with nothing written between them. Sums and scans may round apart from torch's in the last bit, so
only a candidate sitting on a top_p boundary could be kept by one and dropped by the other.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replicas.kernels.seeded_noise import exp_noise


@triton.jit
def _draw_kernel(values_ptr, ids_ptr, settings_ptr, pairs_ptr, out_ptr, width, values_stride, ids_stride,
                 BLOCK: tl.constexpr):
    row = tl.program_id(0)
    pos = tl.arange(0, BLOCK)
    inside = pos < width
    temperature = tl.load(settings_ptr + row * 4)
    top_k = tl.load(settings_ptr + row * 4 + 1)
    top_p = tl.load(settings_ptr + row * 4 + 2)
    log_min_p = tl.load(settings_ptr + row * 4 + 3)
    logits = tl.load(values_ptr + row * values_stride + pos, mask=inside, other=-float("inf")) / temperature
    best = tl.max(logits, axis=0)
    keep = inside & (pos.to(tl.float32) < top_k) & (logits >= best + log_min_p)
    e = tl.where(keep, tl.exp(logits - best), 0.0)
    probs = e / tl.sum(e, axis=0)
    before = tl.cumsum(probs, axis=0) - probs
    keep = keep & ((before < top_p) | (pos == 0))
    low = tl.load(pairs_ptr + row * 2).to(tl.uint32)
    high = tl.load(pairs_ptr + row * 2 + 1).to(tl.uint32)
    scores = tl.where(keep, probs / exp_noise(pos.to(tl.uint32), low, high), -1.0)
    choice = tl.argmax(scores, axis=0)
    tl.store(out_ptr + row, tl.load(ids_ptr + row * ids_stride + choice))


def draw_candidates(values: torch.Tensor, ids: torch.Tensor, settings: torch.Tensor,
                    pairs: torch.Tensor) -> torch.Tensor:
    rows, width = values.shape
    out = torch.empty(rows, dtype=torch.int64, device=values.device)
    if rows:
        _draw_kernel[(rows,)](values, ids, settings, pairs, out, width, values.stride(0), ids.stride(0),
                              BLOCK=max(16, triton.next_power_of_2(width)))
    return out
