"""float8 e4m3 (float8_e4m3fn) and the per-row FP8 quantization, written from their definitions: the oracle of
the Triton quantizer (replicas/kernels/fp8.py), the RMSNorm's FP8 copy and QuantizeTables, which share their
rounding and scale helpers and so cannot check each other. Plain torch in float64, without torch's float8 cast.

e4m3fn: a sign, 4 exponent bits (bias 7), 3 mantissa bits, no infinities; exponent 15 with mantissa 7 is NaN,
so the largest finite value is 1.75 * 2^8 = 448; subnormals (exponent 0) are multiples of 2^-9.

Per-row quantization (the kernels' docstrings): scale = max(max |row| / 448, 1e-12), the division in float32
and correctly rounded; each value x / scale, again a correctly rounded float32 quotient, clamped to +-448 and
rounded to the nearest e4m3 value, ties to even.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
MIN_NORMAL = 2.0 ** -6
SUBNORMAL_STEP = 2.0 ** -9
SCALE_FLOOR = 1e-12  # as float32, as the kernels' FLOOR and torch's clamp round it
NAN_CODE = 0x7F


def e4m3_value(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes -> their float64 values (NaN for 0x7F and 0xFF)."""
    c = codes.to(torch.int64)
    sign = torch.where(c >= 128, -1.0, 1.0).double()
    exponent, mantissa = (c >> 3) & 0xF, (c & 0x7).double()
    normal = (1 + mantissa / 8) * torch.pow(2.0, (exponent - 7).double())
    value = torch.where(exponent == 0, mantissa * SUBNORMAL_STEP, normal)
    value = torch.where((c & 0x7F) == NAN_CODE, float("nan"), value)
    return sign * value


def _quantum(a: torch.Tensor) -> torch.Tensor:
    """The spacing of e4m3 values around each a >= 0: 2^(e - 3) in the binade [2^e, 2^(e + 1)), 2^-9 below
    the normals."""
    _, exp = torch.frexp(a)  # a = m * 2^exp, m in [0.5, 1): the binade's e is exp - 1
    return torch.where(a < MIN_NORMAL, SUBNORMAL_STEP, torch.pow(2.0, (exp - 4).double()))


def e4m3_round(x: torch.Tensor) -> torch.Tensor:
    """Values (any float dtype) -> uint8 e4m3 codes: round to nearest, ties to even, magnitudes past 448
    (infinities too) saturated to 448 as the kernels' clamp does; NaN -> 0x7F."""
    x64 = x.double()
    a = x64.abs()
    finite = torch.isfinite(a)
    a = torch.where(finite, a, torch.zeros_like(a))
    n = a / _quantum(a)  # exact: a float32 (or narrower) value over a power of two
    whole = n.floor()
    rest = n - whole
    odd = torch.remainder(whole, 2) == 1
    rounded = (whole + ((rest > 0.5) | ((rest == 0.5) & odd)).double()) * _quantum(a)
    rounded = torch.where(finite, rounded.clamp(max=E4M3_MAX), torch.full_like(a, E4M3_MAX))
    # the code of a representable magnitude: subnormal steps, else exponent and mantissa
    _, exp = torch.frexp(rounded)
    mantissa = rounded / torch.pow(2.0, (exp - 4).double()) - 8
    normal = (exp + 6) * 8 + mantissa  # biased exponent (exp - 1) + 7, then 3 mantissa bits
    code = torch.where(rounded < MIN_NORMAL, rounded / SUBNORMAL_STEP, normal).to(torch.int64)
    code = code | torch.where(torch.signbit(x64), 128, 0)
    code = torch.where(torch.isnan(x64), NAN_CODE, code)
    return code.to(torch.uint8)


def _f32_quotient(a: torch.Tensor, b: torch.Tensor | float) -> torch.Tensor:
    """a / b correctly rounded to float32 for float32 a and b: the float64 quotient's second rounding to
    float32 cannot differ from a direct one (53 >= 2 * 24 + 2 bits)."""
    return (a.double() / (b.double() if torch.is_tensor(b) else b)).float()


def row_scales(x: torch.Tensor) -> torch.Tensor:
    """[rows, K] -> float32 [rows]: max(max |row| / 448, 1e-12)."""
    peak = x.detach().cpu().float().abs().amax(dim=-1)
    return torch.maximum(_f32_quotient(peak, E4M3_MAX), torch.tensor(SCALE_FLOOR, dtype=torch.float32))


def quantize_rows(x: torch.Tensor, scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, K] -> (uint8 e4m3 codes [rows, K], float32 scales [rows]) on the CPU; scales: given (a static
    one expanded to every row), else row_scales(x)."""
    scales = row_scales(x) if scales is None else scales.detach().cpu().float()
    q = _f32_quotient(x.detach().cpu().float(), scales.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX)
    return e4m3_round(q), scales


def interpreter_exact(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Where the Triton interpreter's float8 conversion (triton/runtime/interpreter.py, _convert_float) agrees
    with e4m3's rounding: it rounds half away from zero, ORs a mantissa carry into the exponent's low bit (125.7
    -> 64 where the exponent is odd), and truncates below the normals. So: zeros, and normal quotients that are
    no tie and carry into no exponent."""
    q = _f32_quotient(x.detach().cpu().float(), scales.detach().cpu().float().unsqueeze(-1))
    a = q.double().abs().clamp(max=E4M3_MAX)
    n = a / _quantum(a)
    rest = n - n.floor()
    return (a == 0) | ((a >= MIN_NORMAL) & (rest != 0.5) & (n < 15.5))


def assert_quantized_rows(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
                          static: torch.Tensor | None = None, interpreted: bool | None = None) -> None:
    """q (float8 [rows, K]) and scales (float32 [rows]) are x's per-row quantization (with one static scale
    [1], if given) bit for bit: every value, but where a Triton kernel ran under the interpreter (interpreted;
    None: q is a CPU tensor) those interpreter_exact keeps, which must be most of them."""
    want_q, want_s = quantize_rows(x, None if static is None else static.expand(x.shape[0]))
    got_s = scales.cpu()
    assert torch.equal(got_s, want_s), (got_s - want_s).abs().max()
    got = q.view(torch.uint8).cpu()
    interpreted = not q.is_cuda if interpreted is None else interpreted
    keep = interpreter_exact(x, want_s) if interpreted else torch.ones_like(got, dtype=torch.bool)
    assert keep.float().mean() > 0.8, keep.float().mean()
    wrong = (got != want_q) & keep
    assert not wrong.any(), (f"{int(wrong.sum())} FP8 values differ, e.g. x / scale = "
                             f"{_f32_quotient(x.cpu().float(), want_s.unsqueeze(-1))[wrong][:4].tolist()}: "
                             f"{e4m3_value(got[wrong][:4]).tolist()} != {e4m3_value(want_q[wrong][:4]).tolist()}")
