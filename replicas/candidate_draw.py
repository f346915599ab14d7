"""A draw among each row's top-k candidates: temperature, top_k, min_p, top_p, then argmax(p / q).

Why one function: the sampler's top-k path (rows with top_k <= TOP_K_CANDIDATES, replicas/sampler.py) took
about twenty small torch kernels and five host-to-device copies a step, each with its launch's host time. On
the 1B shape, whose decode step takes ~1.5 ms, that host time (0.84 ms with 32 seeded rows) set the pace
(bench/sampling_settings.py). On CUDA one Triton program per row does it all
(replicas/kernels/candidate_draw.py); the torch code here is the reference and the CPU path.

Inputs, per row of the group:
    values [N, K] float32: the row's K largest logits, most likely first (torch.topk), before temperature
    ids    [N, K] int64:   their token ids
    settings [N, 4] float32: temperature (> 0), top_k (1..K), top_p (0, 1], ln(min_p) (-inf: no min_p)
    pairs  [N, 2] int64:   the draw's noise key (replicas/seeded_noise.key_pairs)
The noise of candidate j is the key's column j (seeded_noise), so a seeded row draws the same token whatever
shares its batch. Masked candidates get probability 0; the most likely one always survives (top_p near 0
is greedy). The probabilities are left unnormalised after the masks: argmax(p / q) does not see the scale.
"""

from __future__ import annotations

import math

import torch

from replicas.seeded_noise import exponentials_reference


def log_min_p(min_p: float) -> float:
    """min_p as the draws take it: the masks read logits (p < min_p * p_max <=> l < l_max + ln(min_p)), and the
    host takes the log of 0 as -inf where a kernel's log(0) would need a guard."""
    return math.log(min_p) if min_p > 0 else -math.inf


def candidate_width(top_k: int, vocab: int) -> int:
    """How many candidates a group whose largest top_k is top_k takes from torch.topk: the next power of two (at
    least 16, at most the vocabulary). Why: the kernel's variant follows the width, and a variant that warm-up
    did not compile costs a compile (about a second) at the first request with that top_k; per power of two,
    warm-up compiles them all (replicas/warm_up.py). The extra candidates cost topk nothing measurable, and
    each row's own top_k still masks them."""
    return min(vocab, max(16, 1 << (top_k - 1).bit_length()))


def candidate_widths(vocab: int, most: int) -> list[int]:
    """Every width candidate_width gives for top_k in 1..most."""
    return sorted({candidate_width(1 << i, vocab) for i in range(max(1, most - 1).bit_length() + 1)})


def settings_row(temperature: float, top_k: int, top_p: float, min_p: float) -> list[float]:
    """A row of `settings`."""
    return [temperature, top_k, top_p, log_min_p(min_p)]


def draw_candidates_reference(values: torch.Tensor, ids: torch.Tensor, settings: torch.Tensor,
                              pairs: torch.Tensor) -> torch.Tensor:
    """-> [N] int64: each row's drawn token id."""
    temperature, top_k, top_p, log_min_p = (c.unsqueeze(1) for c in settings.unbind(1))
    logits = values / temperature
    positions = torch.arange(values.shape[1], device=values.device).unsqueeze(0)
    keep = (positions < top_k) & (logits >= logits.amax(dim=1, keepdim=True) + log_min_p)
    probs = logits.masked_fill(~keep, -torch.inf).softmax(dim=1)
    before = probs.cumsum(dim=1) - probs  # the mass of the more likely candidates
    keep &= (before < top_p) | (positions == 0)
    scores = probs.masked_fill(~keep, 0) / exponentials_reference(pairs, values.shape[1])
    return ids.gather(1, scores.argmax(dim=1, keepdim=True)).squeeze(1)


def draw_candidates(values: torch.Tensor, ids: torch.Tensor, settings: torch.Tensor,
                    pairs: torch.Tensor) -> torch.Tensor:
    """draw_candidates_reference's draw, by one Triton launch on CUDA."""
    if values.is_cuda:
        from replicas.kernels.candidate_draw import draw_candidates as kernel  # triton: CUDA only here

        return kernel(values, ids, settings, pairs)
    return draw_candidates_reference(values, ids, settings, pairs)
