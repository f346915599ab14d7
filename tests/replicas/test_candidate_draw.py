"""The draw among top-k candidates (replicas/candidate_draw.py): the reference's masks and distribution, and
the Triton kernel drawing the reference's tokens (on CPU through Triton's interpreter)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from replicas.candidate_draw import (candidate_width, candidate_widths, draw_candidates, draw_candidates_reference,
                                     settings_row)
from replicas.seeded_noise import key_pairs, row_key

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the kernel: on the GPU where there is one


def _kernel(*tensors: torch.Tensor) -> torch.Tensor:
    from replicas.kernels.candidate_draw import draw_candidates as kernel

    return kernel(*(t.to(DEVICE) for t in tensors)).cpu()


def _case(rows: int, width: int, seed: int):
    """Random candidates (sorted, as torch.topk gives them), ids, settings over their whole ranges, keys."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    values = torch.randn(rows, width, generator=g).sort(dim=1, descending=True).values
    ids = torch.randint(0, 128_256, (rows, width), generator=g)
    settings = torch.tensor([settings_row(rng.choice([0.05, 0.7, 1.0, 1.6]), rng.randint(1, width),
                                          rng.choice([1.0, 0.95, 0.5, 1e-4]), rng.choice([0.0, 0.0, 0.05, 0.3]))
                             for _ in range(rows)], dtype=torch.float32)
    pairs = torch.tensor(key_pairs([rng.getrandbits(64) for _ in range(rows)]), dtype=torch.int64)
    return values, ids, settings, pairs


@pytest.mark.parametrize("rows,width,seed", [(24, 50, 0), (6, 1024, 1), (40, 7, 2), (3, 1, 3), (8, 33, 4)])
def test_the_kernel_draws_the_references_tokens(rows, width, seed):
    case = _case(rows, width, seed)
    want = draw_candidates_reference(*case)
    got = _kernel(*case)
    assert got.dtype == torch.int64 and torch.equal(got, want)
    assert width == 1 or (want != case[1][:, 0]).any()  # some rows drew past their most likely token


def test_an_empty_group():
    values, ids, settings, pairs = _case(1, 5, 0)
    assert _kernel(values[:0], ids[:0], settings[:0], pairs[:0]).shape == (0,)


PROBS = [0.4, 0.3, 0.15, 0.1, 0.05]


def _frequencies(draw, rows: int, temperature=1.0, top_k=5, top_p=1.0, min_p=0.0) -> list[float]:
    values = torch.tensor(PROBS).log().expand(rows, -1).contiguous()
    ids = torch.arange(10, 15).expand(rows, -1).contiguous()
    settings = torch.tensor([settings_row(temperature, top_k, top_p, min_p)]).expand(rows, -1).contiguous()
    pairs = torch.tensor(key_pairs([row_key(11, d) for d in range(rows)]), dtype=torch.int64)
    counts = torch.bincount(draw(values, ids, settings, pairs) - 10, minlength=5)
    return (counts.double() / rows).tolist()


def _renormalised(weights: list[float]) -> list[float]:
    return [w / sum(weights) for w in weights]


@pytest.mark.parametrize("kw,want", [
    (dict(), PROBS),
    (dict(top_k=2), _renormalised(PROBS[:2] + [0, 0, 0])),
    (dict(top_p=0.75), _renormalised(PROBS[:3] + [0, 0])),  # 0.4 + 0.3 < 0.75: the third is needed
    (dict(min_p=0.3), _renormalised(PROBS[:3] + [0, 0])),  # keep p >= 0.3 * 0.4
    (dict(temperature=0.5), _renormalised([p * p for p in PROBS])),  # p^(1 / T)
    (dict(top_p=1e-6), [1, 0, 0, 0, 0]),  # the most likely always survives
])
def test_the_reference_draws_from_the_masked_distribution(kw, want):
    got = _frequencies(draw_candidates_reference, 20_000, **kw)
    assert all(abs(g - w) < 0.015 for g, w in zip(got, want, strict=True)), (got, want)
    assert all(g == 0 for g, w in zip(got, want, strict=True) if w == 0)


def test_the_kernel_draws_from_the_masked_distribution():
    got = _frequencies(_kernel, 3000, top_k=4, top_p=0.9)  # keeps 0.4, 0.3, 0.15 (0.85 < 0.9), 0.1
    want = _renormalised(PROBS[:4] + [0])
    assert all(abs(g - w) < 0.03 for g, w in zip(got, want, strict=True)), (got, want)
    assert got[4] == 0


def test_a_seeded_rows_token_is_its_own_whatever_the_batch():
    values, ids, settings, pairs = _case(16, 40, 5)
    settings[:, 1:] = torch.tensor(settings_row(1.0, 40, 1.0, 0.0)[1:])  # no mask: only the noise decides
    alone = draw_candidates(values[3:4], ids[3:4], settings[3:4], pairs[3:4])
    shuffled = torch.randperm(16, generator=torch.Generator().manual_seed(0))
    among = draw_candidates(values[shuffled], ids[shuffled], settings[shuffled], pairs[shuffled])
    assert among[(shuffled == 3).nonzero().item()] == alone[0]


def test_masked_candidates_are_never_drawn():
    """Candidates at -inf (a logit bias or allowed_token_ids took them out before top-k) keep probability 0."""
    values = torch.tensor([[2.0, 1.0, -math.inf, -math.inf]]).expand(500, -1).contiguous()
    ids = torch.arange(4).expand(500, -1).contiguous()
    settings = torch.tensor([settings_row(1.0, 4, 1.0, 0.0)]).expand(500, -1).contiguous()
    pairs = torch.tensor(key_pairs([row_key(3, d) for d in range(500)]), dtype=torch.int64)
    for draw in (draw_candidates_reference, _kernel):
        assert set(draw(values, ids, settings, pairs).tolist()) == {0, 1}


def test_a_wider_candidate_set_draws_the_same_tokens():
    """The sampler takes candidate_width(top_k) candidates, a power of two, rather than top_k: the extra ones are
    masked by each row's top_k, and candidate j's noise does not depend on the width."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(12, 3000, generator=g)
    pairs = torch.tensor(key_pairs([row_key(7, d) for d in range(12)]), dtype=torch.int64)
    for top_k in (1, 5, 16, 50, 129, 1000):
        settings = torch.tensor([settings_row(0.9, top_k, 0.95, 0.02)] * 12)
        exact, wide = logits.topk(top_k, dim=1), logits.topk(candidate_width(top_k, 3000), dim=1)
        assert wide.values.shape[1] > top_k or top_k in (16,)
        assert torch.equal(draw_candidates_reference(wide.values, wide.indices, settings, pairs),
                           draw_candidates_reference(exact.values, exact.indices, settings, pairs))


def test_candidate_widths_are_few_and_cover_every_top_k():
    for vocab in (128_256, 700, 9):
        widths = candidate_widths(vocab, 1024)
        assert len(widths) <= 7 and all(w <= vocab for w in widths)
        assert {candidate_width(k, vocab) for k in range(1, min(vocab, 1024) + 1)} == set(widths)
        assert all(candidate_width(k, vocab) >= k for k in range(1, min(vocab, 1024) + 1))


@pytest.mark.gpu
def test_cuda_draws_the_cpu_references_tokens_at_full_width():
    case = _case(64, 1024, 9)
    want = draw_candidates_reference(*case)
    got = draw_candidates(*(t.cuda() for t in case)).cpu()
    assert torch.equal(got, want)
