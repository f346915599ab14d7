"""Fused pointwise ops of the Llama block: one Triton launch where the torch code takes several kernels.

Semantics (each kernel repeats its torch reference's rounding steps, so it
matches bit for bit up to the order of a float32 sum and ~1 ulp of the libm):

    fused_add_rms_norm(x, r, w, eps) -> (y, h):  h = x + r (in x.dtype),
        y = w * (h / sqrt(mean(h^2) + eps)).to(x.dtype), the norm in float32
        (replicas.layers.norm.RMSNorm.forward_native)
    rms_norm(x, w, eps) -> y                     the same without the add
    silu_and_mul(x [..., 2I]) -> silu(x[..., :I]) * x[..., I:]
        (replicas.layers.norm.SiluAndMul.forward_native); with lora= (a two-slice
        lora_core.punica.pending.PendingExpand) gate and up first get each row's
        expand, as PendingExpand.apply() would have added it
    write_kv_cache(k, v [T, Hk, D], k_cache, v_cache [blocks, block_size, Hk, D], slot_mapping [T]):
        k_cache.view(-1, Hk, D)[slot[t]] = k[t] (same for v), slot -1 skipped
        (replicas.attention.write_kv)

Every op returns new tensors and leaves its inputs alone (write_kv_cache
writes only the caches). No op reads anything back to the host and every
grid depends only on shapes, so all of them can be captured in a CUDA graph.

On CUDA the transcendentals come from libdevice, the CUDA math library that
torch's own kernels call (Triton's tl.cos/tl.exp may take faster, less exact
instructions); the interpreter has no libdevice and uses numpy's.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from lora_core.punica.pending import PendingExpand
from lora_core.punica.row_expand import row_expand, row_slot
from replicas.attention import FP8_KV_MAX
from replicas.kernels.fp8 import quantize_row_values
from replicas.layers.row_scale import RowScale
from replicas.quantization import FP8, FP8_MAX, MIN_SCALE, attach_fp8_copy

_MAX_NORM_BLOCK = 8192  # a row up to this wide stays in registers; wider rows are read twice
# SiluAndMul with a PendingExpand to add (lora_core/punica/pending.py): columns per program, each holding
# [block, R] tiles of gate's and up's B. H200, 32 rows, rank 16: 128 / 256 / 512 columns 9.7 / 10.9 / 10.9 us
# over the base GEMM and op with one adapter, 10.3 / 11.1 / 11.1 with ten (bench/pending_expand.py).
LORA_SILU_BLOCK = 128
# Slots of up to this rank: past it each row's B (per-row reads, no tile shares them) costs more than the expand
# kernel saves (H200, 8B gate_up, rank 64: 1.3-33 us slower per site at 1-32 adapters; bench/pending_expand.py).
# SiluAndMul runs a larger expand as its own kernel first.
LORA_SILU_MAX_RANK = 16


def enabled() -> bool:
    """Whether the layers call these kernels on CUDA tensors: on unless env LORAFLEET_FUSED_OPS=0.

    On by default since an H200 measured them (bench/fused_ops.py): bit-exact
    to torch and ~2.5 ms faster per Llama-3-8B decode step at batch 32. The
    switch stays so a suspected kernel bug can be ruled out in one restart.
    """
    return os.environ.get("LORAFLEET_FUSED_OPS", "1") != "0"


def fp8_norm_enabled() -> bool:
    """Whether an RMSNorm before an FP8 layer writes that layer's FP8 input too (RMSNorm.fp8_output): on unless
    env LORAFLEET_FP8_NORM_QUANT=0 (for A/B runs: the layer then quantizes in its own launch)."""
    return os.environ.get("LORAFLEET_FP8_NORM_QUANT", "1") != "0"


def _launch_opts(t: torch.Tensor) -> dict:
    # No mul+add -> fma contraction: torch rounds each product on its own.
    return {"enable_fp_fusion": False} if t.is_cuda else {}


@triton.jit
def _exp(x, PRECISE: tl.constexpr):
    if PRECISE:
        y = libdevice.exp(x)
    else:
        y = tl.exp(x)
    return y


@triton.jit
def tanh(x, PRECISE: tl.constexpr):
    if PRECISE:
        y = libdevice.tanh(x)
    else:  # the interpreter: tanh(x) = 2 / (1 + e^-2x) - 1, whose exp saturates to the right limits
        y = 2.0 / (1.0 + tl.exp(-2.0 * x)) - 1.0
    return y


@triton.jit
def _rsqrt(x, PRECISE: tl.constexpr):
    if PRECISE:
        y = libdevice.rsqrt(x)
    else:
        y = tl.math.rsqrt(x)
    return y


@triton.jit
def _cos(x, PRECISE: tl.constexpr):
    if PRECISE:
        y = libdevice.cos(x)
    else:
        y = tl.cos(x)
    return y


@triton.jit
def _sin(x, PRECISE: tl.constexpr):
    if PRECISE:
        y = libdevice.sin(x)
    else:
        y = tl.sin(x)
    return y


@triton.jit
def _row_inv(part_ptr, row, sp, eps, inv_n, CHUNKS: tl.constexpr, BLOCK_P: tl.constexpr, PRECISE: tl.constexpr):
    """1 / rms of a row from a RowScale's partial sums of squares (replicas/layers/row_scale.py), float32."""
    offs = tl.arange(0, BLOCK_P)
    parts = tl.load(part_ptr + row * sp + offs, mask=offs < CHUNKS, other=0.0)
    return _rsqrt(tl.sum(parts, axis=0) * inv_n + eps, PRECISE)


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, q_ptr, qs_ptr, eps, inv_n, N, sx, sr, so, sro,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, SINGLE_PASS: tl.constexpr,
                     PRECISE: tl.constexpr, QUANT: tl.constexpr, LIMIT: tl.constexpr, FLOOR: tl.constexpr):
    """One program per row. A row that fits one block stays in registers; a wider one is read twice.

    The mean is sum * (1/N), as torch's mean reduction computes it. QUANT (single pass only): the output row
    also goes to q_ptr [rows, N] as FP8 with its scale at qs_ptr [rows], as kernels.fp8.quantize_rows would
    quantize it."""
    row = tl.program_id(0).to(tl.int64)
    x_row, r_row = x_ptr + row * sx, res_ptr + row * sr
    out_row, ro_row = out_ptr + row * so, res_out_ptr + row * sro
    dtype = x_ptr.dtype.element_ty
    offs = tl.arange(0, BLOCK)
    if SINGLE_PASS:
        mask = offs < N
        h = tl.load(x_row + offs, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            h = (h.to(tl.float32) + tl.load(r_row + offs, mask=mask, other=0.0).to(tl.float32)).to(dtype)
            tl.store(ro_row + offs, h, mask=mask)
        hf = h.to(tl.float32)
        inv = _rsqrt(tl.sum(hf * hf, axis=0) * inv_n + eps, PRECISE)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = (w * (hf * inv).to(dtype).to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(out_row + offs, y, mask=mask)
        if QUANT:
            quantize_row_values(y.to(tl.float32), mask, q_ptr + row * N + offs, qs_ptr + row, LIMIT, FLOOR)
    else:
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, N, BLOCK):
            mask = start + offs < N
            h = tl.load(x_row + start + offs, mask=mask, other=0.0)
            if HAS_RESIDUAL:
                r = tl.load(r_row + start + offs, mask=mask, other=0.0)
                h = (h.to(tl.float32) + r.to(tl.float32)).to(dtype)
                tl.store(ro_row + start + offs, h, mask=mask)
            hf = h.to(tl.float32)
            acc += hf * hf
        inv = _rsqrt(tl.sum(acc, axis=0) * inv_n + eps, PRECISE)
        if HAS_RESIDUAL:
            tl.debug_barrier()  # the second pass reads h back from res_out
            x_row = ro_row
        for start in range(0, N, BLOCK):
            mask = start + offs < N
            hf = tl.load(x_row + start + offs, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + start + offs, mask=mask, other=0.0).to(tl.float32)
            y = w * (hf * inv).to(dtype).to(tl.float32)
            tl.store(out_row + start + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t [..., N] as a [rows, N] view (a copy only if it cannot be viewed) with unit stride along N."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _lora_args(lora: PendingExpand | None, x2: torch.Tensor) -> tuple[tuple, dict]:
    """(the LoRA arguments of a fused kernel, its LoRA constexprs): dummies without a PendingExpand."""
    if lora is None:
        return (x2, x2, x2, x2, 0, 0, 0, 0, 0, 0), {"HAS_LORA": False, "BLOCK_R": 16}
    return lora.kernel_args(), {"HAS_LORA": True, "BLOCK_R": max(16, triton.next_power_of_2(lora.slice_rank))}


def _scale_args(row_scale: RowScale | None, x2: torch.Tensor) -> tuple:
    """A fused kernel's RowScale arguments (fused._row_inv's): dummies without one."""
    if row_scale is None:
        return x2, 0, 0.0, 0.0
    if row_scale.partials.shape[0] != x2.shape[0]:
        raise ValueError(f"a RowScale of {row_scale.partials.shape[0]} rows for {x2.shape[0]} rows")
    return row_scale.kernel_args()


def _scale_consts(row_scale: RowScale | None) -> dict:
    chunks = row_scale.chunks if row_scale is not None else 0
    return {"CHUNKS": chunks, "BLOCK_P": triton.next_power_of_2(max(chunks, 1))}


def _rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
              quantize: bool = False):
    n = x.shape[-1]
    x2 = _rows(x)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    res_out = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else out
    r2 = _rows(residual) if residual is not None else x2
    if x2.shape[0] == 0:
        return out, res_out
    out2, ro2 = out.view(-1, n), res_out.view(-1, n)
    block = min(triton.next_power_of_2(n), _MAX_NORM_BLOCK)
    single_pass = block >= n
    quantize = quantize and single_pass  # the row is in registers when its max is taken
    q = torch.empty(out2.shape, dtype=FP8, device=x.device) if quantize else out2
    scales = torch.empty(out2.shape[0], dtype=torch.float32, device=x.device) if quantize else out2
    _rms_norm_kernel[(x2.shape[0],)](
        x2, r2, weight.contiguous(), out2, ro2, q, scales, float(eps), 1.0 / n, n,
        x2.stride(0), r2.stride(0), out2.stride(0), ro2.stride(0),
        HAS_RESIDUAL=residual is not None, BLOCK=block, SINGLE_PASS=single_pass, PRECISE=x.is_cuda,
        QUANT=quantize, LIMIT=FP8_MAX, FLOOR=MIN_SCALE, num_warps=max(1, min(block // 512, 8)), **_launch_opts(x))
    if quantize:
        attach_fp8_copy(out, q, scales)
    return out, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, quantize: bool = False) -> torch.Tensor:
    """x [..., N], weight [N] -> weight * (x / sqrt(mean(x^2, -1) + eps)).to(x.dtype), norm in float32.
    quantize: the output also carries its FP8 copy for an FP8 layer to read (quantization.attach_fp8_copy),
    made in the same launch; rows wider than one block (_MAX_NORM_BLOCK) carry none."""
    return _rms_norm(x, None, weight, eps, quantize)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float, quantize: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [..., N] -> (rms_norm(h), h) with h = x + residual in x.dtype; both new tensors.
    quantize: as rms_norm's."""
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not match x "
                         f"{tuple(x.shape)} {x.dtype}")
    return _rms_norm(x, residual, weight, eps, quantize)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, sx, so,
                         slots_ptr, s_ptr, b_ptr, ranks_ptr, ss_t, ss_l, sb_l, sb_n, sr_s, s_slice,
                         part_ptr, sp, eps, inv_n,
                         BLOCK: tl.constexpr, PRECISE: tl.constexpr, HAS_LORA: tl.constexpr, BLOCK_R: tl.constexpr,
                         CHUNKS: tl.constexpr, BLOCK_P: tl.constexpr, GELU_TANH: tl.constexpr):
    """HAS_LORA: gate and up get a two-slice PendingExpand's row first, each rounded to x's dtype as the
    expand kernel would have stored it. CHUNKS > 0: then a RowScale's factor, rounded again, as apply_().
    GELU_TANH: gelu(gate, approximate="tanh") instead of silu (Gemma), as torch's CUDA kernel computes it."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(x_ptr + row * sx + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * sx + inter + offs, mask=mask, other=0.0)
    if HAS_LORA:
        slot, rank_gate = row_slot(slots_ptr, ranks_ptr, row, 0, sr_s)
        _, rank_up = row_slot(slots_ptr, ranks_ptr, row, 1, sr_s)
        s_row, b_slot = s_ptr + row * ss_t + slot * ss_l, b_ptr + slot * sb_l
        gate = (gate.to(tl.float32) + row_expand(s_row, b_slot, rank_gate, offs, mask, sb_n, BLOCK_R)).to(gate.dtype)
        up = (up.to(tl.float32) + row_expand(s_row + s_slice, b_slot + inter * sb_n, rank_up, offs, mask, sb_n,
                                             BLOCK_R)).to(up.dtype)
    if CHUNKS > 0:
        inv = _row_inv(part_ptr, row, sp, eps, inv_n, CHUNKS, BLOCK_P, PRECISE)
        gate = (gate.to(tl.float32) * inv).to(gate.dtype)
        up = (up.to(tl.float32) * inv).to(up.dtype)
    up = up.to(tl.float32)
    g = gate.to(tl.float32)
    if GELU_TANH:  # 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))
        inner = 0.7978845608028654 * (g + 0.044715 * (g * g * g))
        act = (0.5 * g * (1.0 + tanh(inner, PRECISE))).to(gate.dtype)
    else:
        act = tl.math.div_rn(g, 1.0 + _exp(-g, PRECISE)).to(gate.dtype)  # F.silu rounds to the dtype
    tl.store(out_ptr + row * so + offs, (act.to(tl.float32) * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_fusable(x: torch.Tensor, lora: PendingExpand) -> bool:
    """Whether silu_and_mul takes this expand onto x: x 2-D, the expand's two slices gate's and up's widths."""
    return x.dim() == 2 and lora.fusable((x.shape[-1] // 2,) * 2)


def silu_and_mul(x: torch.Tensor, lora: PendingExpand | None = None, row_scale: RowScale | None = None,
                 gelu_tanh: bool = False) -> torch.Tensor:
    """x [..., 2I] = [gate | up] -> new silu(gate) * up [..., I] (gelu_tanh: gelu(gate, approximate="tanh")).

    lora: a two-slice expand (gate, up) still owed to x = [T, 2I], added first as lora.apply() would
    (rounded to x.dtype); row_scale: a RowScale still owed to x [T, 2I], applied next as its apply_() would.
    x itself is left alone."""
    inter = x.shape[-1] // 2
    if lora is not None and not silu_fusable(x, lora):
        raise ValueError(f"silu_and_mul takes two-slice expands of {inter} outputs each onto [T, {2 * inter}] "
                         f"rows, got slices {lora.output_slices} onto {tuple(x.shape)}")
    x2 = _rows(x)
    out = torch.empty(*x.shape[:-1], inter, dtype=x.dtype, device=x.device)
    if x2.shape[0] == 0 or inter == 0:
        return out
    block = min(triton.next_power_of_2(inter), 1024 if lora is None else LORA_SILU_BLOCK)
    out2 = out.view(-1, inter)
    lora_args, lora_consts = _lora_args(lora, x2)
    _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](
        x2, out2, inter, x2.stride(0), out2.stride(0), *lora_args, *_scale_args(row_scale, x2), BLOCK=block,
        PRECISE=x.is_cuda, **lora_consts, **_scale_consts(row_scale), GELU_TANH=gelu_tanh, num_warps=4,
        **_launch_opts(x))
    return out


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, num_heads,
                     sk_t, sk_h, sv_t, sv_h, sc_b, sc_s, sc_h,
                     BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_H: tl.constexpr, SATURATE: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    # slot as a vector: the interpreter mis-types a scalar mask combined with a tensor one
    live = (tl.full((BLOCK_H,), 0, tl.int64) + slot >= 0) & (heads < num_heads)
    mask = live[:, None] & (offs_d < HEAD_DIM)[None, :]
    dst = (slot // BLOCK_SIZE) * sc_b + (slot % BLOCK_SIZE) * sc_s + heads[:, None] * sc_h + offs_d[None, :]
    k = tl.load(k_ptr + tok * sk_t + heads[:, None] * sk_h + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + tok * sv_t + heads[:, None] * sv_h + offs_d[None, :], mask=mask)
    if SATURATE > 0:  # an FP8 cache: +-448 at most, as replicas.attention.to_cache_dtype stores them
        k = tl.minimum(tl.maximum(k.to(tl.float32), -SATURATE), SATURATE)
        v = tl.minimum(tl.maximum(v.to(tl.float32), -SATURATE), SATURATE)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """k, v [T, Hk, D] -> k_cache, v_cache [num_blocks, block_size, Hk, D] at flat slot slot_mapping[t]
    (= block * block_size + offset); a slot of -1 (padding) is skipped. Writes the caches in place."""
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must share shape and strides")
    if k.stride(-1) != 1 or v.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise ValueError("k, v and the caches need a unit stride along head_dim")
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    block_d = triton.next_power_of_2(head_dim)
    block_h = max(1, min(triton.next_power_of_2(num_heads), 1024 // block_d))
    _write_kv_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
        k, v, k_cache, v_cache, slot_mapping, num_heads,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_H=block_h,
        SATURATE=FP8_KV_MAX if k_cache.dtype == torch.float8_e4m3fn else 0.0, num_warps=4)
