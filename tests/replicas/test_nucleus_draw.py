"""The sort-free nucleus draw (replicas/nucleus_draw.py): the reference's nucleus (ties at the boundary all
in), its distribution, and the Triton kernel drawing the reference's tokens (on CPU through Triton's
interpreter), including rows whose first draws fall outside the nucleus (several rounds)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from replicas.nucleus_draw import draw_nucleus, draw_nucleus_reference, settings_row
from replicas.seeded_noise import key_pairs, row_key

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the kernel: on the GPU where there is one


def _kernel(*tensors: torch.Tensor) -> torch.Tensor:
    from replicas.kernels.nucleus_draw import draw_nucleus as kernel

    return kernel(*(t.to(DEVICE) for t in tensors)).cpu()


def _keys(rows: int, seed: int) -> torch.Tensor:
    return torch.tensor(key_pairs([row_key(seed, d) for d in range(rows)]), dtype=torch.int64)


def _case(rows: int, vocab: int, seed: int, spread: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    logits = torch.randn(rows, vocab, generator=g) * spread
    settings = torch.tensor([settings_row(rng.choice([0.3, 0.8, 1.0, 1.7]), rng.choice([1.0, 0.95, 0.6, 0.2, 1e-4]),
                                          rng.choice([0.0, 0.0, 0.01, 0.2])) for _ in range(rows)])
    return logits, settings, _keys(rows, seed)


@pytest.mark.parametrize("rows,vocab,spread,seed", [
    (16, 3000, 1.0, 0),  # flat rows: the first draws mostly fall outside the nucleus
    (8, 4096, 4.0, 1),  # peaked rows, exactly one block (the kernel's BLOCK)
    (5, 4097, 2.0, 2),  # a block and one column
    (12, 37, 1.0, 3),  # less than a block
    (3, 1, 1.0, 4),
])
def test_the_kernel_draws_the_references_tokens(rows, vocab, spread, seed):
    case = _case(rows, vocab, seed, spread)
    want = draw_nucleus_reference(*case)
    assert torch.equal(_kernel(*case), want)
    assert vocab == 1 or (want != case[0].argmax(dim=1)).any()  # not all greedy


def test_a_contiguous_copy_for_a_strided_row():
    logits, settings, pairs = _case(4, 600, 5)
    wide = torch.zeros(600, 4).t()  # column stride 4
    wide.copy_(logits)
    assert torch.equal(_kernel(wide, settings, pairs), draw_nucleus_reference(logits, settings, pairs))


PROBS = [0.4, 0.3, 0.15, 0.1, 0.05]


def _frequencies(draw, probs: list[float], rows: int, temperature=1.0, top_p=1.0, min_p=0.0) -> list[float]:
    logits = torch.tensor(probs).log().expand(rows, -1).contiguous()
    settings = torch.tensor([settings_row(temperature, top_p, min_p)]).expand(rows, -1).contiguous()
    counts = torch.bincount(draw(logits, settings, _keys(rows, 21)), minlength=len(probs))
    return (counts.double() / rows).tolist()


def _renormalised(weights: list[float]) -> list[float]:
    return [w / sum(weights) for w in weights]


@pytest.mark.parametrize("kw,want", [
    (dict(), PROBS),
    (dict(top_p=0.75), _renormalised(PROBS[:3] + [0, 0])),  # 0.4 + 0.3 < 0.75: the third is needed
    (dict(top_p=0.7), _renormalised(PROBS[:2] + [0, 0, 0])),  # 0.4 + 0.3 reach it: the third is out
    (dict(min_p=0.3), _renormalised(PROBS[:3] + [0, 0])),  # keep p >= 0.3 * 0.4
    (dict(min_p=0.3, top_p=0.6), _renormalised(PROBS[:2] + [0, 0, 0])),  # top_p of the mass min_p kept: 0.4/0.85
    (dict(temperature=0.5), _renormalised([p * p for p in PROBS])),
    (dict(top_p=1e-6), [1, 0, 0, 0, 0]),
])
def test_the_reference_draws_from_the_nucleus(kw, want):
    got = _frequencies(draw_nucleus_reference, PROBS, 20_000, **kw)
    assert all(abs(g - w) < 0.015 for g, w in zip(got, want, strict=True)), (got, want)
    assert all(g == 0 for g, w in zip(got, want, strict=True) if w == 0)


def test_tokens_tied_on_the_boundary_are_all_in():
    """0.4, then 0.3 twice: top_p 0.5 needs one of the 0.3s, and neither is more likely than the other."""
    probs = [0.4, 0.3, 0.3]
    got = _frequencies(draw_nucleus_reference, probs, 20_000, top_p=0.5)
    assert all(abs(g - p) < 0.015 for g, p in zip(got, probs, strict=True)), got


@pytest.mark.parametrize("probs,top_p", [(PROBS, 0.8), ([0.4, 0.3, 0.3], 0.5)])
def test_the_kernel_draws_the_references_tokens_on_a_known_nucleus(probs, top_p):
    """Token for token, where the reference's distribution is checked above (ties at the boundary too)."""
    logits = torch.tensor(probs).log().expand(300, -1).contiguous()
    settings = torch.tensor([settings_row(1.0, top_p, 0.0)]).expand(300, -1).contiguous()
    want = draw_nucleus_reference(logits, settings, _keys(300, 21))
    assert torch.equal(_kernel(logits, settings, _keys(300, 21)), want)
    assert set(want.tolist()) == set(range(3))


def test_masked_tokens_are_never_drawn():
    logits = torch.tensor([[1.0, -math.inf, 0.5, -math.inf, 0.2]]).expand(100, -1).contiguous()
    settings = torch.tensor([settings_row(1.0, 0.99, 0.0)]).expand(100, -1).contiguous()
    for draw in (draw_nucleus_reference, _kernel):
        assert set(draw(logits, settings, _keys(100, 2)).tolist()) == {0, 2, 4}


def test_a_row_without_a_finite_logit_ends():
    """No token to draw (every logit -inf, or NaN from a broken model): the kernel still ends and answers a column,
    instead of looping on a mass that no comparison can judge; the rows beside it draw as ever."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(2))
    logits[0] = -math.inf
    logits[1] = math.nan
    settings = torch.tensor([settings_row(1.0, 0.9, 0.0)] * 3)
    got = _kernel(logits, settings, _keys(3, 4))
    assert all(0 <= t < 50 for t in got.tolist())
    assert got[2] == draw_nucleus_reference(logits[2:], settings[2:], _keys(3, 4)[2:])[0]


def test_a_seeded_rows_token_is_its_own_whatever_the_batch():
    logits, settings, pairs = _case(10, 500, 6)
    alone = draw_nucleus(logits[4:5], settings[4:5], pairs[4:5])
    order = torch.randperm(10, generator=torch.Generator().manual_seed(1))
    among = draw_nucleus(logits[order], settings[order], pairs[order])
    assert among[(order == 4).nonzero().item()] == alone[0]


@pytest.mark.gpu
def test_cuda_draws_the_cpu_references_tokens_at_full_width():
    case = _case(32, 128_256, 9, spread=3.0)
    assert torch.equal(draw_nucleus(*(t.cuda() for t in case)).cpu(), draw_nucleus_reference(*case))


def _by_definition(logits: torch.Tensor, temperature: float, top_p: float, min_p: float, key: int) -> int:
    """One row's draw straight from the definitions, O(V^2): a token is kept if p >= min_p * p_max, and in the
    nucleus if the kept tokens strictly more likely than it hold < top_p of the kept mass; the draw is the first
    column of the largest l / T - ln(q) among them."""
    from replicas.seeded_noise import exponentials_reference

    scaled = logits.double() / temperature
    p = torch.softmax(scaled, dim=0)
    kept = p >= min_p * p.max()
    mass = p[kept].sum()
    q = exponentials_reference(torch.tensor([key_pairs([key])[0]], dtype=torch.int64), len(logits))[0].double()
    best, best_col = -math.inf, None
    for i in range(len(logits)):
        if kept[i] and p[kept & (p > p[i])].sum() < top_p * mass:
            score = float(scaled[i] - q[i].log())
            if score > best:
                best, best_col = score, i
    return best_col


def test_the_reference_and_the_kernel_follow_the_definitions_on_rows_full_of_ties():
    """bf16 logits tie often (8 bits of mantissa): rows of a few distinct values, every setting."""
    g = torch.Generator().manual_seed(7)
    rows, vocab = 24, 40
    logits = (torch.randint(0, 5, (rows, vocab), generator=g).float() * 0.5).to(torch.bfloat16).float()
    rng = random.Random(7)
    cases = [(rng.choice([0.5, 1.0, 1.5]), rng.choice([0.3, 0.6, 0.9, 1.0]), rng.choice([0.0, 0.2]))
             for _ in range(rows)]
    keys = [rng.getrandbits(64) for _ in range(rows)]
    settings = torch.tensor([settings_row(*c) for c in cases])
    pairs = torch.tensor(key_pairs(keys), dtype=torch.int64)
    want = [_by_definition(logits[i], *cases[i], keys[i]) for i in range(rows)]
    assert draw_nucleus_reference(logits, settings, pairs).tolist() == want
    assert _kernel(logits, settings, pairs).tolist() == want
