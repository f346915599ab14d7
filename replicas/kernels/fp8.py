"""replicas/quantization.py's per-token input quantization in one launch: a program per row finds the row's
max |x| (one pass), then writes x / scale rounded to float8 e4m3 (a second pass) and the scale. The same
values as quantization.quantize_rows: the scale and the division in float32, correctly rounded, the
quotient clamped to +-448 before the conversion (round to nearest even, as torch converts)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replicas.quantization import FP8, FP8_MAX, MIN_SCALE

BLOCK = 1024


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, static_ptr, width, x_stride, LIMIT: tl.constexpr,
                          FLOOR: tl.constexpr, STATIC: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    x_row = x_ptr + row.to(tl.int64) * x_stride
    q_row = q_ptr + row.to(tl.int64) * width
    if STATIC:  # a checkpoint's input scale, one for every row
        scale = tl.load(static_ptr)
    else:
        peak = tl.zeros((BLOCK,), tl.float32)
        for start in range(0, width, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            peak = tl.maximum(peak, tl.abs(tl.load(x_row + cols, mask=cols < width, other=0.0).to(tl.float32)))
        scale = tl.maximum(tl.math.div_rn(tl.max(peak, axis=0), LIMIT), FLOOR)
    tl.store(scale_ptr + row, scale)
    for start in range(0, width, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < width, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -LIMIT), LIMIT)
        tl.store(q_row + cols, q.to(tl.float8e4nv, fp_downcast_rounding="rtne"), mask=cols < width)


def quantize_rows(x: torch.Tensor, static: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, K] (rows may be strided) -> (float8 [rows, K], float32 scales [rows]); static: one float32
    scale for every row (a checkpoint's input_scale), else each row's own."""
    rows, width = x.shape
    if x.stride(1) != 1:
        raise ValueError("quantize_rows: each row must be contiguous")
    q = torch.empty((rows, width), dtype=FP8, device=x.device)
    scales = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows:
        _quantize_rows_kernel[(rows,)](x, q, scales, scales if static is None else static, width, x.stride(0),
                                       LIMIT=FP8_MAX, FLOOR=MIN_SCALE, STATIC=static is not None, BLOCK=BLOCK,
                                       num_warps=4)
    return q, scales
