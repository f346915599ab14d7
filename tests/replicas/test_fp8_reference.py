"""tests/replicas/fp8_reference.py, the FP8 tests' oracle, against torch's own float8_e4m3fn cast and the
format's table: every code, ties, values between, saturation; and its per-row scales against the torch
quantizer's (replicas/quantization.py)."""

from __future__ import annotations

import torch

from replicas import quantization
from tests.replicas.fp8_reference import E4M3_MAX, e4m3_round, e4m3_value, interpreter_exact, quantize_rows

FP8 = torch.float8_e4m3fn
ROUNDS_TO_448 = 464.0  # halfway to 480, which e4m3fn lacks: torch's cast is compared below it only
CODES = torch.arange(256, dtype=torch.uint8)


def _torch_codes(x: torch.Tensor) -> torch.Tensor:
    return x.to(FP8).view(torch.uint8)


def test_every_code_decodes_as_torch_decodes_it():
    got, want = e4m3_value(CODES), CODES.view(FP8).double()
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and int(torch.isnan(got).sum()) == 2  # 0x7F, 0xFF
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
    assert e4m3_value(torch.tensor([0x7E, 0x01, 0x08], dtype=torch.uint8)).tolist() == [448.0, 2.0 ** -9,
                                                                                         2.0 ** -6]


def test_every_value_rounds_to_its_own_code():
    finite = CODES[~torch.isnan(e4m3_value(CODES))]
    assert torch.equal(e4m3_round(e4m3_value(finite)), finite)  # -0 (0x80) keeps its sign


def test_ties_go_to_the_even_mantissa():
    positive = CODES[:0x7F]  # 0 .. 448 in order
    values = e4m3_value(positive)
    mid = ((values[:-1] + values[1:]) / 2).float()  # exact in float32: 5 significant bits at most
    for sign in (1, -1):
        got = e4m3_round(sign * mid)
        assert torch.equal(got, _torch_codes(sign * mid))
        assert not (got & 1).any()  # of the two neighbours, the one whose last bit is 0
    # a float32 ulp off a tie decides it
    up, down = torch.nextafter(mid, torch.tensor(1e9)), torch.nextafter(mid, torch.tensor(0.0))
    assert torch.equal(e4m3_round(up), positive[1:]) and torch.equal(e4m3_round(down), positive[:-1])


def test_random_values_round_as_torch_casts_them():
    g = torch.Generator().manual_seed(0)
    magnitude = torch.exp2(torch.rand(100_000, generator=g) * 23 - 14)  # 2^-14 .. 2^9: to zero, subnormal, normal
    x = magnitude * (torch.randint(0, 2, magnitude.shape, generator=g) * 2 - 1)
    x = x[x.abs() < ROUNDS_TO_448]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert torch.equal(e4m3_round(x.to(dtype)), _torch_codes(x.to(dtype))), dtype


def test_magnitudes_past_448_saturate():
    """As the kernels' clamp makes them; torch's own cast differs by version there (NaN in 2.11, 448 in 2.13)."""
    x = torch.tensor([448.0, 463.9, 464.0, 480.0, 1e6, float("inf"), -500.0, -float("inf")])
    assert e4m3_value(e4m3_round(x)).tolist() == [E4M3_MAX] * 6 + [-E4M3_MAX] * 2
    assert torch.equal(e4m3_round(x[:2]), _torch_codes(x[:2]))
    assert e4m3_round(torch.tensor([float("nan")])).item() == 0x7F


def test_row_quantization_equals_the_torch_quantizer():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 300, generator=g) * torch.logspace(-8, 3, 64).unsqueeze(1)
    x[0] = 0.0
    for dtype in (torch.float32, torch.bfloat16):
        want_q, want_s = quantization.quantize_rows(x.to(dtype))
        got_q, got_s = quantize_rows(x.to(dtype))
        assert torch.equal(got_s, want_s) and got_s[0] == quantization.MIN_SCALE
        assert torch.equal(got_q, want_q.view(torch.uint8))
    static = torch.tensor([0.01])  # a checkpoint's input scale: values past 448 * 0.01 saturate
    got_q, _ = quantize_rows(x[40:50], static.expand(10))
    assert torch.equal(got_q, quantization.quantize_rows(x[40:50], static.expand(10))[0].view(torch.uint8))
    assert (e4m3_value(got_q).abs() == E4M3_MAX).any()


def test_the_interpreters_exact_positions_are_most_and_skip_ties_and_carries():
    x = torch.tensor([[0.0, 1.0, 1.0625, 125.7, 2.0 ** -8, 7.0, 448.0]])
    scales = torch.ones(1)
    # 1.0625 is halfway between 1 and 1.125; 125.7 rounds up to 128; 2^-8 is subnormal
    assert interpreter_exact(x, scales).tolist() == [[True, True, False, False, False, True, True]]
    g = torch.Generator().manual_seed(2)
    rows = torch.randn(8, 4096, generator=g)
    assert interpreter_exact(rows, quantize_rows(rows)[1]).float().mean() > 0.9
