"""Fused Triton pointwise kernels (interpreter on CPU, real kernels on GPU) against the layers' torch code.

The references are the layers' forward_native (and replicas.attention.write_kv),
run on the same device and dtype, so a kernel must repeat their rounding steps,
not merely approximate the math.
"""

from __future__ import annotations

import pytest
import torch

from replicas.attention import write_kv
from replicas.kernels import fused
from replicas.kernels import rotary as rope_kernel
from replicas.layers import GeluTanhAndMul, RMSNorm, RotaryEmbedding, SiluAndMul
from replicas.rope_config import LONG_ROPE, RopeScaling

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
LLAMA3 = RopeScaling(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                     original_max_position_embeddings=8192)
# two rows of frequencies: the short factors' below position 17, the long ones' from there and for encoded positions
LONGROPE = RopeScaling(rope_type="longrope", original_max_position_embeddings=17,
                       short_factor=(1.0, 1.5, 2.0, 1.2, 1.1, 3.0, 1.0, 2.5),
                       long_factor=(9.0, 7.0, 5.0, 4.0, 3.0, 2.0, 1.5, 1.0), attention_factor=1.19)


def _randn(*shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(DEVICE, dtype)


def _ulps(dtype, n=1):
    """Relative tolerance of n units in the last place (at the bottom of a binade)."""
    return n * torch.finfo(dtype).eps


def _assert_mostly_exact(out, ref, max_mismatch):
    """Same rounding steps as the reference: all but a few half-precision elements bitwise equal.

    (In float32 an ulp of difference in a shared factor, e.g. a row's rsqrt,
    moves every element, so there only the tolerance applies.)
    """
    if out.dtype == torch.float32:
        return
    mismatch = (out != ref).float().mean().item()
    assert mismatch <= max_mismatch, f"{mismatch:.2%} of elements differ from the reference"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (5, 200), (2, 3, 96), (3, 1000)])
def test_rms_norm_matches_torch(shape, dtype, monkeypatch):
    hidden = shape[-1]
    if hidden == 1000:  # rows wider than one block take the two-pass loop
        monkeypatch.setattr(fused, "_MAX_NORM_BLOCK", 256)
    norm = RMSNorm(hidden, eps=1e-5, params_dtype=dtype).to(DEVICE)
    norm.weight.copy_(_randn(hidden, dtype=dtype, seed=1, scale=0.5) + 1)
    x = _randn(*shape, dtype=dtype, seed=2, scale=3.0)
    residual = _randn(*shape, dtype=dtype, seed=3, scale=3.0)

    out, new_residual = fused.fused_add_rms_norm(x, residual, norm.weight, norm.eps)
    ref, ref_residual = norm.forward_native(x, residual)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.equal(new_residual, ref_residual)
    torch.testing.assert_close(out, ref, rtol=_ulps(dtype, 2), atol=_ulps(dtype, 2))
    _assert_mostly_exact(out, ref, 0.02)

    out = fused.rms_norm(x, norm.weight, norm.eps)
    torch.testing.assert_close(out, norm.forward_native(x), rtol=_ulps(dtype, 2), atol=_ulps(dtype, 2))
    assert torch.equal(x, _randn(*shape, dtype=dtype, seed=2, scale=3.0)), "inputs are left alone"


def test_rms_norm_of_strided_rows_and_float32_weight():
    x = _randn(4, 160, dtype=torch.float16, seed=4)[:, :80]  # rows 160 apart
    weight = _randn(80, dtype=torch.float32, seed=5)
    norm = RMSNorm(80, eps=1e-6, params_dtype=torch.float32).to(DEVICE)
    norm.weight.copy_(weight)
    out = fused.rms_norm(x, weight, 1e-6)
    assert out.dtype == torch.float32  # weight * h promotes, as in torch
    torch.testing.assert_close(out, norm.forward_native(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,scaling,rotary_dim", [
    (4, 2, 16, None, None), (8, 1, 64, LLAMA3, None), (6, 6, 48, RopeScaling(rope_type="linear", factor=2.0), None),
    (32, 8, 128, None, None), (4, 2, 16, LONGROPE, None),
    # a head partly turned (Phi-4-mini: 96 of 128), with longrope's factor on cos and sin
    (24, 8, 128, None, 96), (4, 2, 48, LONGROPE, 16),
])
def test_rotary_matches_torch(num_heads, num_kv_heads, head_dim, scaling, rotary_dim, dtype):
    rope = RotaryEmbedding(head_dim, 500000.0, scaling, rotary_dim).to(DEVICE)
    num_tokens = 5
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = _randn(num_tokens, q_size + 2 * kv_size, dtype=dtype, seed=head_dim)
    q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)  # strided views, as in LlamaAttention
    positions = torch.tensor([0, 1, 17, 4095, 100_000], device=DEVICE)
    if scaling is LONGROPE:  # one a long prompt's token below the original context: the long factors there too
        positions[1] += LONG_ROPE
    qkv_before = qkv.clone()

    q_out, k_out = rope_kernel.rotary(positions, q, k, rope.inv_freq, head_dim, rope.long_from, rope.rotary_dim,
                                      rope.cos_sin_factor)
    q_ref, k_ref = rope.forward_native(positions, q, k)
    assert torch.equal(qkv, qkv_before), "q and k are left alone"
    for out, ref in ((q_out, q_ref), (k_out, k_ref)):
        assert out.shape == ref.shape and out.dtype == ref.dtype
        # cos/sin may differ by an ulp of the libm; it moves an output by up to |x| * ulp
        torch.testing.assert_close(out, ref, rtol=_ulps(dtype, 2), atol=_ulps(dtype, 8))
        _assert_mostly_exact(out, ref, 0.02)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2 * 64), (7, 2 * 300), (2, 3, 2 * 1500)])
@pytest.mark.parametrize("layer", [SiluAndMul, GeluTanhAndMul])
def test_silu_and_mul_matches_torch(shape, dtype, layer):
    x = _randn(*shape, dtype=dtype, seed=shape[-1], scale=4.0)
    out = fused.silu_and_mul(x, gelu_tanh=layer.gelu_tanh)
    ref = layer().forward_native(x)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    # gelu's 1 + tanh(...) next to 0 turns a tanh an ulp off torch's (libdevice's on CUDA, exp's under the
    # interpreter) into an absolute error of |x| ulps, x up to ~16 here (an H200: 2 ulps failed in float32)
    atol = _ulps(dtype, 16 if layer is GeluTanhAndMul else 2)
    torch.testing.assert_close(out, ref, rtol=_ulps(dtype, 2), atol=atol)
    _assert_mostly_exact(out, ref, 0.02)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_kv_heads,head_dim", [(2, 16), (1, 48), (8, 128)])
def test_write_kv_cache_matches_index_copy(num_kv_heads, head_dim, dtype):
    num_blocks, block_size, num_tokens = 6, 4, 7
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = _randn(*shape, dtype=dtype, seed=1), _randn(*shape, dtype=dtype, seed=2)
    kv = _randn(num_tokens, 2, num_kv_heads, head_dim, dtype=dtype, seed=3)
    k, v = kv[:, 0], kv[:, 1]  # strided, as the split of a packed qkv
    slots = torch.tensor([5, 0, -1, 23, 9, -1, 12], device=DEVICE)  # -1: padding, skipped
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv(k, v, k_ref, v_ref, slots)
    fused.write_kv_cache(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_switch_is_on_by_default_and_read_from_env(monkeypatch):
    monkeypatch.delenv("LORAFLEET_FUSED_OPS", raising=False)
    assert fused.enabled()
    monkeypatch.setenv("LORAFLEET_FUSED_OPS", "1")
    assert fused.enabled()
    monkeypatch.setenv("LORAFLEET_FUSED_OPS", "0")
    assert not fused.enabled()


def test_layers_stay_on_torch_off_cuda(monkeypatch):
    monkeypatch.setenv("LORAFLEET_FUSED_OPS", "1")

    def refuse(*args, **kwargs):
        raise AssertionError("a fused kernel ran on a CPU tensor")

    for name in ("rms_norm", "fused_add_rms_norm", "silu_and_mul"):
        monkeypatch.setattr(fused, name, refuse)
    monkeypatch.setattr(rope_kernel, "rotary", refuse)
    x = torch.randn(3, 32)
    RMSNorm(32)(x), RMSNorm(32)(x, x), SiluAndMul()(x)
    RotaryEmbedding(16, 10000.0)(torch.arange(3), x, x)


@pytest.mark.gpu
def test_layers_dispatch_to_fused_kernels_on_cuda(monkeypatch):
    monkeypatch.setenv("LORAFLEET_FUSED_OPS", "1")
    calls = []

    def counted(name, kernel):
        def run(*args, **kwargs):
            calls.append(name)
            return kernel(*args, **kwargs)
        return run

    for name in ("rms_norm", "fused_add_rms_norm", "silu_and_mul"):
        monkeypatch.setattr(fused, name, counted(name, getattr(fused, name)))
    monkeypatch.setattr(rope_kernel, "rotary", counted("rotary", rope_kernel.rotary))
    dtype = torch.bfloat16
    tol = dict(rtol=_ulps(dtype, 2), atol=_ulps(dtype, 8))
    norm = RMSNorm(4096, 1e-5, dtype).cuda()
    x, r = _randn(8, 4096, dtype=dtype, seed=1), _randn(8, 4096, dtype=dtype, seed=2)
    torch.testing.assert_close(norm(x), norm.forward_native(x), **tol)
    torch.testing.assert_close(norm(x, r)[0], norm.forward_native(x, r)[0], **tol)
    gate_up = _randn(8, 2 * 1024, dtype=dtype, seed=3)
    torch.testing.assert_close(SiluAndMul()(gate_up), SiluAndMul().forward_native(gate_up), **tol)
    rope = RotaryEmbedding(128, 500000.0, LLAMA3).cuda()
    pos = torch.arange(8, device="cuda") * 1000
    for out, ref in zip(rope(pos, x[:, :1024], r[:, :512]), rope.forward_native(pos, x[:, :1024], r[:, :512]),
                        strict=True):
        torch.testing.assert_close(out, ref, **tol)
    assert calls == ["rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary"]


@pytest.mark.gpu
def test_fused_kernels_replay_in_cuda_graph():
    """No host syncs and shape-only grids: captured once, replayed on new inputs."""
    dtype, tokens = torch.bfloat16, 32
    weight = _randn(4096, dtype=dtype, seed=1)
    inv_freq = RotaryEmbedding(128, 500000.0).cuda().inv_freq
    x, r = _randn(tokens, 4096, dtype=dtype, seed=2), _randn(tokens, 4096, dtype=dtype, seed=3)
    qkv = _randn(tokens, 6144, dtype=dtype, seed=4)
    gate_up = _randn(tokens, 2 * 14336, dtype=dtype, seed=5)
    pos = torch.arange(tokens, device="cuda")

    def step():
        return (fused.fused_add_rms_norm(x, r, weight, 1e-5)[0],
                *rope_kernel.rotary(pos, qkv[:, :4096], qkv[:, 4096:5120], inv_freq, 128),
                fused.silu_and_mul(gate_up))

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for seed in (10, 20):
        for i, t in enumerate((x, r, qkv, gate_up)):
            t.copy_(_randn(*t.shape, dtype=dtype, seed=seed + i))
        pos.copy_(torch.randint(0, 8192, (tokens,), device="cuda"))
        graph.replay()
        for out, ref in zip(outs, step(), strict=True):
            assert torch.equal(out, ref)
