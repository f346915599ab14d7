"""RowScale: the add + RMSNorm's LoRA kernel leaves each row's 1 / rms to the op after the next linear layer
(replicas/layers/row_scale.py), which applies it as it reads that layer's output: the rotary embedding after
qkv_proj, SiluAndMul after gate_up_proj.

Reference: the norm as it was (normed output), and for the consumers the pending expand, then
RowScale.apply_, then the op's forward_native. Kernels run under Triton's interpreter on CPU.
"""

from __future__ import annotations

import types

import pytest
import torch

from replicas.kernels import fused, lora_norm, lora_rotary
from replicas.layers import ColumnParallelLinear, RotaryEmbedding, SiluAndMul, norm, rotary
from replicas.layers.row_scale import RowScale, scales_with_input
from replicas.parallel import ParallelContext
from tests.replicas.test_fused_lora_kernels import (DEVICE, HEAD_DIM, HIDDEN_BLOCKS, QKV, ROW_SLOTS, _close,
                                                    _norm_case, _pending, _randn, _reference_input)

# float16 never defers (RMSNorm.forward_deferred): an unnormed row may overflow its range
DTYPES = [torch.float32] + ([torch.bfloat16] if torch.cuda.is_available() else [])


def _scale(rows: int, seed: int, chunks: int = 3) -> RowScale:
    """A RowScale of random positive partial sums (rms between ~0.5 and ~3)."""
    partials = torch.rand(rows, chunks, generator=torch.Generator().manual_seed(seed)) * 10 + 0.5
    return RowScale(partials.to(DEVICE), 1e-5, 1.0 / (2 * chunks))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", sorted(ROW_SLOTS))
@pytest.mark.parametrize("hidden, block", HIDDEN_BLOCKS)
def test_deferred_norm_times_its_row_scale_is_the_norm(rows, hidden, block, dtype, monkeypatch):
    """add_rms_norm_lora_deferred -> (weight * h, h, scale): h as add_rms_norm_lora's, and weight * h * inv
    the normed output; one partial per column chunk, so no program waits for the row's others."""
    monkeypatch.setattr(lora_norm, "LORA_NORM_BLOCK", block)
    x, residual, layer, args = _norm_case(rows, hidden, dtype, rows + 40)
    want_out, want_h = layer.forward_native(_reference_input(x, args), residual)
    y, h, scale = lora_norm.add_rms_norm_lora_deferred(x, residual, layer.weight, layer.eps, _pending(*args, True, x))
    _close(h, want_h)
    assert scale.chunks == -(-hidden // block)
    _close(y, (layer.weight.float() * h.float()).to(dtype))
    _close((y.float() * scale.inv()).to(dtype), want_out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_lora", [True, False])
def test_silu_and_mul_applies_a_row_scale_after_the_expand(with_lora, dtype):
    rows, inter = 5, 96
    x = _randn(rows, 2 * inter, dtype=dtype, seed=2, scale=2.0)
    args = (ROW_SLOTS[rows], (inter, inter), dtype, 77)
    scale = _scale(rows, 3)
    want = _reference_input(x, args) if with_lora else x.clone()
    scale.apply_(want)
    lora = _pending(*args, True, x) if with_lora else None
    _close(fused.silu_and_mul(x, lora=lora, row_scale=scale), SiluAndMul().forward_native(want))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_applies_a_row_scale_to_q_k_and_v(dtype):
    rows = 9
    rope = RotaryEmbedding(HEAD_DIM, 10000.0).to(DEVICE)
    qkv = _randn(rows, sum(QKV), dtype=dtype, seed=5, scale=2.0)
    positions = (torch.arange(rows) * 11).to(DEVICE)
    args = (ROW_SLOTS[rows], QKV, dtype, 99)
    scale = _scale(rows, 4)
    want = _reference_input(qkv, args)
    scale.apply_(want)
    want_q, want_k, want_v = want.split(QKV, -1)
    ref_q, ref_k = rope.forward_native(positions, want_q, want_k)
    got = qkv.clone()
    q, k, v = got.split(QKV, -1)
    out_q, out_k = lora_rotary.rotary_lora(positions, q, k, v, rope.inv_freq, HEAD_DIM, _pending(*args, True, got),
                                           scale)
    _close(out_q, ref_q)
    _close(out_k, ref_k)
    _close(v, want_v)


def test_layers_apply_a_row_scale_where_no_kernel_fuses_it(monkeypatch):
    """Without fused ops (the CPU path) SiluAndMul and RotaryEmbedding add the expand, then scale their input
    in place, then run forward_native; a row_scale without v is refused (v needs it too)."""
    monkeypatch.setattr(norm, "fused_ops", lambda x: None)
    monkeypatch.setattr(rotary, "fused_ops", lambda x: None)
    dtype, rows, inter = torch.float32, 5, 64
    scale = _scale(rows, 8)
    gate_up = _randn(rows, 2 * inter, dtype=dtype, seed=4)
    args = (ROW_SLOTS[rows], (inter, inter), dtype, 12)
    want = _reference_input(gate_up, args)
    scale.apply_(want)
    y = gate_up.clone()
    _close(SiluAndMul()(y, lora=_pending(*args, False, y), row_scale=scale), SiluAndMul().forward_native(want))

    rope = RotaryEmbedding(HEAD_DIM, 10000.0).to(DEVICE)
    qkv = _randn(rows, sum(QKV), dtype=dtype, seed=6)
    positions = torch.arange(rows).to(DEVICE)
    args = (ROW_SLOTS[rows], QKV, dtype, 13)
    want = _reference_input(qkv, args)
    scale.apply_(want)
    got = qkv.clone()
    q, k, v = got.split(QKV, -1)
    out_q, out_k = rope(positions, q, k, lora=_pending(*args, False, got), v=v, row_scale=scale)
    ref_q, ref_k = rope.forward_native(positions, *want.split(QKV, -1)[:2])
    _close(out_q, ref_q)
    _close(out_k, ref_k)
    _close(v, want.split(QKV, -1)[2])
    with pytest.raises(ValueError, match="v needs it"):
        rope(positions, q, k, row_scale=scale)


@pytest.mark.parametrize("dtype, defers", [(torch.float32, True), (torch.float16, False)])
def test_rms_norm_defers_only_where_its_lora_kernel_runs(dtype, defers, monkeypatch):
    """RMSNorm.forward_deferred: the deferred kernel where fused ops run (a stand-in, so the choice is checked on
    any device), not in float16; elsewhere the plain forward with row_scale None, its output normed."""
    stand_in = types.SimpleNamespace(fused_add_rms_norm=fused.fused_add_rms_norm, rms_norm=fused.rms_norm)
    monkeypatch.setattr(norm, "fused_ops", lambda x: stand_in)
    x, residual, layer, args = _norm_case(5, 96, dtype, 21)
    want_out, want_h = layer.forward_native(_reference_input(x, args), residual)
    y = x.clone()
    out, h, scale = layer.forward_deferred(y, residual, _pending(*args, False, y))
    _close(h, want_h)
    assert (scale is not None) == defers
    _close((out.float() * scale.inv()).to(dtype) if defers else out, want_out)
    monkeypatch.setattr(norm, "fused_ops", lambda x: None)
    y = x.clone()
    out, h, scale = layer.forward_deferred(y, residual, _pending(*args, False, y))
    assert scale is None
    _close(out, want_out)


def test_only_layers_without_biases_take_a_row_scale():
    ctx = ParallelContext()
    assert scales_with_input(ColumnParallelLinear(8, 8, False, ctx, torch.float32))
    assert not scales_with_input(ColumnParallelLinear(8, 8, True, ctx, torch.float32))
    assert not scales_with_input(types.SimpleNamespace(bias=None, scales_with_input=lambda: False))  # a LoRA bias


def test_row_scale_inv_is_the_rms_of_the_parts():
    h = torch.randn(4, 12, generator=torch.Generator().manual_seed(1))
    parts = (h * h).view(4, 3, 4).sum(-1)
    scale = RowScale(parts, 1e-6, 1.0 / 12)
    torch.testing.assert_close(scale.inv(), torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))
