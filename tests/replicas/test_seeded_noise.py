"""Seeded rows' sampling noise (replicas/seeded_noise.py): Exp(1), a function of (seed, draw, column) only,
and the Triton kernel equal to the torch reference (on CPU through Triton's interpreter)."""

from __future__ import annotations

import math

import pytest
import torch

from replicas.seeded_noise import exponentials, exponentials_reference, key_pairs, row_key


def _pairs(keys: list[int], device: str = "cpu") -> torch.Tensor:
    return torch.tensor(key_pairs(keys), dtype=torch.int64, device=device)


@pytest.mark.parametrize("rows,width", [(5, 3000), (1, 1), (3, 1024), (2, 1025)])
def test_the_kernel_computes_the_reference(rows, width):
    from replicas.kernels import seeded_noise as kernel

    device = "cuda" if torch.cuda.is_available() else "cpu"
    pairs = _pairs([row_key(seed, draw) for seed, draw in [(0, 0), (1, 0), (1, 1), (2 ** 63 - 1, 7), (-5, 3)]][:rows],
                   device)
    want = exponentials_reference(pairs.cpu(), width)
    got = kernel.exponentials(pairs, width).cpu()
    assert got.shape == (rows, width) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=2e-6, atol=0)  # the same integers; log within an ulp


def test_an_empty_batch():
    from replicas.kernels import seeded_noise as kernel

    assert kernel.exponentials(_pairs([]).reshape(0, 2), 10).shape == (0, 10)


def test_noise_is_exponential_and_uncorrelated():
    q = exponentials(_pairs([row_key(s, d) for s in range(8) for d in range(4)]), 8192)
    flat = q.flatten().double()
    assert abs(flat.mean().item() - 1) < 0.01 and abs(flat.var().item() - 1) < 0.03
    assert abs((flat > 1).double().mean().item() - math.exp(-1)) < 0.005
    assert abs((flat > 3).double().mean().item() - math.exp(-3)) < 0.002
    u = torch.exp(-q.double())  # uniform on (0, 1)
    for a, b in ((u[:, :-1], u[:, 1:]), (u[:-1], u[1:])):  # neighbouring columns, neighbouring rows
        assert abs(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1].item()) < 0.01
    assert q.min().item() > 0 and torch.isfinite(q).all()


def test_keys_differ_over_seeds_and_draws():
    keys = {row_key(seed, draw) for seed in range(-50, 200) for draw in range(200)}
    assert len(keys) == 250 * 200 and all(0 <= k < 2 ** 64 for k in keys)


def test_a_rows_noise_is_its_own_whatever_the_batch():
    key = row_key(7, 3)
    alone = exponentials(_pairs([key]), 500)
    among = exponentials(_pairs([row_key(1, 0), key, row_key(9, 9)]), 500)
    assert torch.equal(alone[0], among[1])
    assert not torch.equal(among[0], among[1])


@pytest.mark.gpu
def test_cuda_draws_the_cpu_noise():
    pairs = _pairs([row_key(s, 0) for s in range(32)])
    torch.testing.assert_close(exponentials(pairs.cuda(), 128_256).cpu(), exponentials(pairs, 128_256),
                               rtol=2e-6, atol=0)
