"""The RMSNorm before an FP8 layer writes that layer's FP8 input too (RMSNorm.fp8_output): the fused kernel's
copy equals what the layer's own quantizer makes of the norm's output, the layer's GEMM takes it instead of
quantizing again, and link_fp8_norms marks exactly the norms whose only reader is such a layer."""

from __future__ import annotations

import pytest
import torch

from replicas.kernels import fused
from replicas.kernels.fp8 import quantize_rows as quantize_kernel
from replicas.quantization import FP8, attach_fp8_copy, fp8_copy, link_fp8_norms, quantize_model, quantize_rows
from tests.replicas.fp8_reference import assert_quantized_rows

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.float32, torch.bfloat16]


def _rows(rows: int, width: int, seed: int, dtype: torch.dtype, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=g) * scale * torch.logspace(-2, 1, rows).unsqueeze(1)
    return x.to(DEVICE, dtype)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual", [False, True])
def test_the_norms_fp8_copy_is_the_quantizers_output(dtype, residual):
    """Scales and FP8 values bit for bit against kernels.fp8.quantize_rows over the norm's output (one
    conversion under the interpreter too), and against the e4m3 definition (fp8_reference.py: under the
    interpreter, the values its conversion gets right); on CUDA also against the torch quantizer."""
    width = 200
    x, r = _rows(5, width, 1, dtype), _rows(5, width, 2, dtype)
    weight = (_rows(1, width, 3, dtype, 0.5)[0] + 1).contiguous()
    if residual:
        out, h = fused.fused_add_rms_norm(x, r, weight, 1e-5, quantize=True)
        plain, plain_h = fused.fused_add_rms_norm(x, r, weight, 1e-5)
        assert torch.equal(h, plain_h)
    else:
        out = fused.rms_norm(x, weight, 1e-5, quantize=True)
        plain = fused.rms_norm(x, weight, 1e-5)
    assert torch.equal(out, plain) and fp8_copy(plain) is None  # the output itself does not change
    q, scales = fp8_copy(out)
    assert q.dtype == FP8 and q.shape == out.shape and scales.shape == (5,)
    q_kernel, scales_kernel = quantize_kernel(out)
    assert torch.equal(scales, scales_kernel) and _same_bits(q, q_kernel)
    assert_quantized_rows(out, q, scales)
    if ON_GPU:
        q_ref, scales_ref = quantize_rows(out)
        assert torch.equal(scales, scales_ref) and _same_bits(q, q_ref)


def test_rows_wider_than_one_block_carry_no_copy(monkeypatch):
    """The two-pass loop writes the row before its max is known: no copy, and the layer quantizes as before."""
    monkeypatch.setattr(fused, "_MAX_NORM_BLOCK", 64)
    x = _rows(3, 200, 4, torch.float32)
    out = fused.rms_norm(x, torch.ones(200, device=DEVICE), 1e-5, quantize=True)
    assert fp8_copy(out) is None
    torch.testing.assert_close(out, fused.rms_norm(x, torch.ones(200, device=DEVICE), 1e-5))


def test_a_copy_belongs_to_the_tensor_object_it_was_attached_to():
    x = torch.randn(4, 8)
    q, scales = quantize_rows(x)
    attach_fp8_copy(x, q, scales)
    assert fp8_copy(x)[0] is q and fp8_copy(x)[1] is scales
    assert fp8_copy(x.view(4, 8)) is None and fp8_copy(x.clone()) is None and fp8_copy(x[:2]) is None


def test_link_marks_the_norms_each_fp8_layer_alone_reads(demo):
    """Llama's input norm (read by qkv_proj) and post-attention norm (gate_up_proj), not the final norm; none
    before quantization; and not a norm whose layer has a checkpoint's static input scale."""
    from replicas.models import load_model

    model = load_model(demo.model_dir)
    assert link_fp8_norms(model) == 0
    quantize_model(model, "fp8", torch.float32, torch.device("cpu"))
    layers = model.model.layers
    layers[1].self_attn.qkv_proj.input_scale = torch.ones(1)  # as an FP8 checkpoint with static input scales
    assert link_fp8_norms(model) == 2 * len(layers) - 1
    for i, layer in enumerate(layers):
        assert layer.input_layernorm.fp8_output == (i != 1)
        assert layer.post_attention_layernorm.fp8_output
    assert not model.model.norm.fp8_output


@pytest.mark.gpu
def test_the_fp8_gemm_takes_the_norms_copy_instead_of_quantizing_again(monkeypatch):
    """A norm marked fp8_output feeds a quantized layer: the layer's GEMM runs no quantizer of its own, and its
    output equals the GEMM over the norm's output quantized in the layer (a copy of it, which has no copy)."""
    from replicas.kernels import fp8 as fp8_kernels
    from replicas.layers import QKVParallelLinear, RMSNorm

    torch.manual_seed(0)
    norm = RMSNorm(512, params_dtype=torch.bfloat16).cuda()
    norm.fp8_output = True
    layer = QKVParallelLinear(512, 64, 8, 2, params_dtype=torch.bfloat16).cuda()
    layer.weight.data.normal_(0, 0.02)
    layer.quantize_fp8()
    calls = []
    real = fp8_kernels.quantize_rows
    monkeypatch.setattr(fp8_kernels, "quantize_rows", lambda *a, **k: calls.append(1) or real(*a, **k))
    x, residual = (torch.randn(7, 512, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    y, _ = norm(x, residual)
    assert fp8_copy(y) is not None
    got = layer(y)
    assert calls == []
    want = layer(y.clone())
    assert calls == [1]
    assert torch.equal(got, want)
    # the copy is what the GEMM reads: a zeroed one gives zeros
    q, scales = fp8_copy(y)
    attach_fp8_copy(y, torch.zeros_like(q), scales)
    assert not layer(y).any()
