"""A draw over the whole vocabulary with min_p and top_p but no top_k, without sorting the vocabulary.

Why: a row with top_p and no top_k (the OpenAI clients' form) sorted its 128 K logits to find the nucleus:
0.87 ms of GPU time for 32 rows, 15% of an 8B decode step (bench/sampler_host.py, bench/sampling_settings.py). The
draw is argmax over the nucleus of p / q (q the row's Exp(1) noise,
replicas/seeded_noise.py), and that needs only the nucleus's membership test, not its order:

    token i is in the nucleus  <=>  the mass of the tokens more likely than i is < top_p

(ties at the boundary are all in, whatever a sort would have put first). Take w, the argmax of p / q over a
set that holds the whole nucleus. If w is in the nucleus it is also the nucleus's argmax. If not, no token as
likely as w or less is in it, so the next set is {p > p_w}: smaller by w at least, and still holding the
nucleus. The first set is every token min_p keeps; the most likely token always passes, so this ends, and
since w is mostly a likely token, in one or two rounds. Each round is one pass over the row that sums the
mass above the current w and finds the next set's argmax at once (replicas/kernels/nucleus_draw.py, one
program per row). The torch code here is the reference (by sorting) and the CPU path.

Inputs: logits [N, V] float32 (before temperature); settings [N, 3] float32: temperature (> 0), top_p
(0, 1], ln(min_p) (-inf: no min_p); pairs [N, 2] int64, each row's noise key (seeded_noise.key_pairs).
Scores are compared as logs, l / T - ln(q) (the log of p / q up to the row's constant).
"""

from __future__ import annotations

import torch

from replicas.candidate_draw import log_min_p
from replicas.seeded_noise import exponentials_reference


def settings_row(temperature: float, top_p: float, min_p: float) -> list[float]:
    """A row of `settings`."""
    return [temperature, top_p, log_min_p(min_p)]


def draw_nucleus_reference(logits: torch.Tensor, settings: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """-> [N] int64: each row's drawn token id."""
    temperature, top_p, log_min_p = (c.unsqueeze(1) for c in settings.unbind(1))
    scaled = logits / temperature
    kept = scaled >= scaled.amax(dim=1, keepdim=True) + log_min_p
    probs = scaled.masked_fill(~kept, -torch.inf).softmax(dim=1)
    ordered, order = probs.sort(dim=1, descending=True)
    before = ordered.cumsum(dim=1) - ordered
    # the mass of the strictly more likely tokens: a run of equal probabilities takes its first one's
    positions = torch.arange(probs.shape[1], device=probs.device).expand_as(ordered)
    starts = torch.ones_like(ordered, dtype=torch.bool)
    starts[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    run_start = torch.where(starts, positions, 0).cummax(dim=1).values
    inside_sorted = before.gather(1, run_start) < top_p
    inside = torch.zeros_like(inside_sorted).scatter(1, order, inside_sorted) & kept
    scores = (scaled - exponentials_reference(pairs, logits.shape[1]).log()).masked_fill(~inside, -torch.inf)
    return scores.argmax(dim=1)


def draw_nucleus(logits: torch.Tensor, settings: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """draw_nucleus_reference's draw, by one Triton launch on CUDA."""
    if logits.is_cuda:
        from replicas.kernels.nucleus_draw import draw_nucleus as kernel  # triton: CUDA only here

        return kernel(logits, settings, pairs)
    return draw_nucleus_reference(logits, settings, pairs)
