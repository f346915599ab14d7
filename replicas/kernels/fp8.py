"""replicas/quantization.py's FP8 GEMM on CUDA, the parts torch has no one launch for.

quantize_rows: per-token input quantization, a program per row: the row's max |x|, then x / scale rounded to
float8 e4m3, and the scale. The same values as quantization.quantize_rows: the scale and the division in
float32, correctly rounded, the quotient clamped to +-448 before the conversion (round to nearest even, as
torch converts).

scale_product: the epilogue of a product computed with unit scales (torch._scaled_mm's per-tensor form, which
bench/fp8_gemm.py measured at about half the time of its row-wise form on decode batches): float32 sums times
each row's input scale and each column's weight scale, rounded to the model's dtype, then the bias added as
quantization.fp8_linear_reference adds it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replicas.quantization import FP8, FP8_MAX, MIN_SCALE

# a row of up to this many values is one block (its second read, from L2, costs little); wider rows loop.
# Was 1,024 at 4 warps: 8 us for Llama-3-8B's 14,336-wide down_proj input, a decode batch's bfloat16 GEMM 33.
MAX_BLOCK = 16384
SCALE_BLOCK = 1024


@triton.jit
def _scale_of(peak, LIMIT: tl.constexpr, FLOOR: tl.constexpr):
    """A row's scale from its max |x|: peak / LIMIT, at least FLOOR (float32, the division correctly rounded)."""
    return tl.maximum(tl.math.div_rn(peak, LIMIT), FLOOR)


@triton.jit
def _to_fp8(x, scale, LIMIT: tl.constexpr):
    """float32 x / scale, clamped to +-LIMIT, rounded to the nearest float8 e4m3 (even on ties)."""
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -LIMIT), LIMIT)
    return q.to(tl.float8e4nv, fp_downcast_rounding="rtne")


@triton.jit
def _row_scale(x_row, width, LIMIT: tl.constexpr, FLOOR: tl.constexpr, BLOCK: tl.constexpr):
    """_scale_of(max |x_row[:width]|)."""
    peak = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, width, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        peak = tl.maximum(peak, tl.abs(tl.load(x_row + cols, mask=cols < width, other=0.0).to(tl.float32)))
    return _scale_of(tl.max(peak, axis=0), LIMIT, FLOOR)


@triton.jit
def _store_quantized(x_row, q_row, scale, width, LIMIT: tl.constexpr, BLOCK: tl.constexpr):
    """q_row[:width] = _to_fp8(x_row, scale)."""
    for start in range(0, width, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < width, other=0.0).to(tl.float32)
        tl.store(q_row + cols, _to_fp8(x, scale, LIMIT), mask=cols < width)


@triton.jit
def quantize_row_values(v, mask, q_ptrs, scale_ptr, LIMIT: tl.constexpr, FLOOR: tl.constexpr):
    """A row already in registers (float32 values of the model's dtype, v[~mask] ignored), quantized as
    _quantize_rows_kernel quantizes it from memory: the scale (max |v| / LIMIT, at least FLOOR) to scale_ptr,
    v / scale clamped and rounded to float8 e4m3 to q_ptrs. For a kernel that has just written the row (the
    RMSNorm before an FP8 layer: replicas/kernels/fused.py)."""
    scale = _scale_of(tl.max(tl.where(mask, tl.abs(v), 0.0), axis=0), LIMIT, FLOOR)
    tl.store(scale_ptr, scale)
    tl.store(q_ptrs, _to_fp8(v, scale, LIMIT), mask=mask)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, static_ptr, width, x_stride, LIMIT: tl.constexpr,
                          FLOOR: tl.constexpr, STATIC: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    x_row = x_ptr + row.to(tl.int64) * x_stride
    if STATIC:  # a checkpoint's input scale, one for every row
        scale = tl.load(static_ptr)
    else:
        scale = _row_scale(x_row, width, LIMIT, FLOOR, BLOCK)
    tl.store(scale_ptr + row, scale)
    _store_quantized(x_row, q_ptr + row.to(tl.int64) * width, scale, width, LIMIT, BLOCK)


def quantize_rows(x: torch.Tensor, static: torch.Tensor | None = None, out: torch.Tensor | None = None,
                  out_scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, K] (rows may be strided) -> (float8 [rows, K], float32 scales [rows]); static: one float32
    scale for every row (a checkpoint's input_scale), else each row's own. out / out_scales: written into
    (contiguous), else new."""
    rows, width = x.shape
    if x.stride(1) != 1:
        raise ValueError("quantize_rows: each row must be contiguous")
    q = torch.empty((rows, width), dtype=FP8, device=x.device) if out is None else out
    scales = torch.empty(rows, dtype=torch.float32, device=x.device) if out_scales is None else out_scales
    given = out is not None or out_scales is not None  # checked only then: every GEMM's input comes through here
    if given and (not (q.is_contiguous() and scales.is_contiguous()) or q.shape != x.shape or scales.shape != (rows,)):
        raise ValueError(f"quantize_rows: out {tuple(q.shape)} / out_scales {tuple(scales.shape)} must be contiguous "
                         f"and fit x {tuple(x.shape)}")
    if rows:
        block = min(triton.next_power_of_2(width), MAX_BLOCK)
        _quantize_rows_kernel[(rows,)](x, q, scales, scales if static is None else static, width, x.stride(0),
                                       LIMIT=FP8_MAX, FLOOR=MIN_SCALE, STATIC=static is not None, BLOCK=block,
                                       num_warps=max(4, min(16, block // 1024)))
    return q, scales


@triton.jit
def _quantize_tables_kernel(src_tab, dst_tab, scale_tab, rows_tab, width_tab, slot, num_parts,
                            SRC: tl.constexpr, LIMIT: tl.constexpr, FLOOR: tl.constexpr, BLOCK: tl.constexpr):
    part = tl.program_id(0)
    row = tl.program_id(1)
    if row >= tl.load(rows_tab + part):
        return
    width = tl.load(width_tab + part)
    entry = slot * num_parts + part
    offset = row.to(tl.int64) * width
    src = tl.load(src_tab + entry).to(tl.pointer_type(SRC)) + offset
    scale = _row_scale(src, width, LIMIT, FLOOR, BLOCK)
    tl.store(tl.load(scale_tab + entry).to(tl.pointer_type(tl.float32)) + row, scale)
    _store_quantized(src, tl.load(dst_tab + entry).to(tl.pointer_type(tl.float8e4nv)) + offset, scale, width, LIMIT,
                     BLOCK)


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
TABLE_BLOCK = 4096


class QuantizeTables:
    """quantize_rows over many matrices in one launch: for `slot`, each part's src[slot] [rows, width] (any
    of its own shape, contiguous) quantized per row into dst[slot] with its scales into scales[slot], as
    quantize_rows computes them. FP8ARows' copies of an adapter slot's A rows (replicas/fp8_lora.py): 128
    matrices for an 8B model, whose launches one by one cost ~20 us of host time each."""

    def __init__(self, parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        """parts: (src [slots, rows, width], dst float8 [slots, rows, width], scales float32 [slots, rows])."""
        src0 = parts[0][0]
        self.src_dtype = _TL_DTYPES[src0.dtype]
        for src, dst, scales in parts:
            ok = (src.dtype == src0.dtype and dst.dtype == FP8 and scales.dtype == torch.float32
                  and src.shape == dst.shape and scales.shape == src.shape[:2]
                  and all(t[0].is_contiguous() for t in (src, dst, scales)))
            if not ok:
                raise ValueError(f"QuantizeTables: src {src.dtype} {tuple(src.shape)}, dst {dst.dtype} "
                                 f"{tuple(dst.shape)} and scales {scales.dtype} {tuple(scales.shape)} do not fit")
        slots = src0.shape[0]

        def addresses(i: int) -> torch.Tensor:  # [slots, parts]: part p's tensor i at slot s
            return torch.tensor([[p[i][s].data_ptr() for p in parts] for s in range(slots)], dtype=torch.int64,
                                device=src0.device)

        # the tables hold addresses, not references: keep the tensors alive with them
        self.parts = parts
        self.src, self.dst, self.scales = addresses(0), addresses(1), addresses(2)
        self.rows = torch.tensor([p[0].shape[1] for p in parts], dtype=torch.int32, device=src0.device)
        self.widths = torch.tensor([p[0].shape[2] for p in parts], dtype=torch.int32, device=src0.device)
        self.max_rows = max(p[0].shape[1] for p in parts)

    def __call__(self, slot: int) -> None:
        _quantize_tables_kernel[(len(self.parts), self.max_rows)](
            self.src, self.dst, self.scales, self.rows, self.widths, slot, len(self.parts), SRC=self.src_dtype,
            LIMIT=FP8_MAX, FLOOR=MIN_SCALE, BLOCK=TABLE_BLOCK, num_warps=4)


@triton.jit
def _scale_product_kernel(acc_ptr, x_scale_ptr, w_scale_ptr, bias_ptr, out_ptr, width,
                          HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < width
    acc = tl.load(acc_ptr + row * width + cols, mask=inside, other=0.0)
    y = (acc * tl.load(x_scale_ptr + row) * tl.load(w_scale_ptr + cols, mask=inside, other=0.0))
    y = y.to(out_ptr.dtype.element_ty)
    if HAS_BIAS:  # after the product's rounding, in float32, rounded again: what torch's y + bias does
        y = (y.to(tl.float32) + tl.load(bias_ptr + cols, mask=inside, other=0.0).to(tl.float32))
        y = y.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * width + cols, y, mask=inside)


def scale_product(acc: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                  dtype: torch.dtype) -> torch.Tensor:
    """acc [rows, N] float32 (contiguous) * x_scale [rows] * w_scale [N], in dtype, + bias [N] -> [rows, N]."""
    rows, width = acc.shape
    out = torch.empty((rows, width), dtype=dtype, device=acc.device)
    if rows:
        _scale_product_kernel[(rows, triton.cdiv(width, SCALE_BLOCK))](
            acc, x_scale, w_scale, acc if bias is None else bias, out, width, HAS_BIAS=bias is not None,
            BLOCK=SCALE_BLOCK, num_warps=4)
    return out
