"""FP8 base weights (EngineArgs.quantization="fp8", replicas/quantization.py): the quantization, the GEMM
against its float32 definition, the Triton input quantizer, the layers, and the engine with adapters against
transformers + PEFT whose base linear layers compute the same FP8 products."""

from __future__ import annotations

import pytest
import torch

from replicas.quantization import (FP8, FP8_MAX, MIN_SCALE, check_method, fp8_linear_reference, quantize_rows,
                                   row_scales)
from tests.replicas.conftest import EVERY_PROJECTION, generate_against_peft, write_peft_adapters

ON_GPU = torch.cuda.is_available()


def _x(rows: int, width: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=g) * torch.logspace(-3, 2, rows).unsqueeze(1)
    x[0] = 0.0  # a row of zeros
    return x.to(dtype)


def test_rows_quantize_to_fp8_values_with_their_own_scales():
    x = _x(6, 300, 0)
    q, scales = quantize_rows(x)
    assert q.dtype == FP8 and scales.dtype == torch.float32
    assert scales[0] == MIN_SCALE and not q[0].float().any()
    assert torch.equal(scales[1:], x[1:].abs().amax(1) / FP8_MAX)
    assert q.float().abs().amax(1)[1:].eq(FP8_MAX).all()  # each row's largest value lands on 448
    # round to nearest: e4m3 keeps 3 mantissa bits, so each value is within 1/16 of itself
    back = q.float() * scales.unsqueeze(1)
    assert ((back - x).abs() <= x.abs() / 16 + 2 ** -9 * scales.unsqueeze(1)).all()


def test_the_reference_gemm_is_the_dequantized_product():
    x, w = _x(5, 64, 1), _x(7, 64, 2)
    wq, ws = quantize_rows(w)
    bias = torch.randn(7)
    got = fp8_linear_reference(x.reshape(5, 1, 64), wq, ws, bias)
    xq, xs = quantize_rows(x)
    want = (xq.float() * xs.unsqueeze(1)) @ (wq.float() * ws.unsqueeze(1)).t() + bias
    assert got.shape == (5, 1, 7)
    torch.testing.assert_close(got.reshape(5, 7), want, rtol=1e-5, atol=1e-5)
    exact = x @ w.t() + bias
    assert (got.reshape(5, 7) - exact).abs().max() < 0.1 * exact.abs().max()  # FP8's error, not another's


def test_unknown_methods_are_refused():
    assert check_method(None) is None and check_method("fp8") == "fp8"
    with pytest.raises(ValueError, match="quantization"):
        check_method("int4")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_triton_quantizer_equals_the_reference(dtype):
    """Scales bit for bit under the interpreter too; the FP8 values on CUDA only (the interpreter's float8
    conversion rounds some values into the binade below: 125.7 -> 64)."""
    from replicas.kernels.fp8 import quantize_rows as kernel

    x = _x(9, 3000, 3, dtype).to("cuda" if ON_GPU else "cpu")
    strided = torch.cat([x, x], dim=1)[:, :3000]
    q, scales = kernel(strided)
    q_ref, scales_ref = quantize_rows(x)
    assert torch.equal(scales, scales_ref)
    if ON_GPU:
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


def _row_parallel_reference(x, wq, ws, bias, tp: int):
    """A row-parallel layer at TP tp: each rank quantizes its part of each input row on its own (the weights'
    scales are the whole rows'), and the partial products are summed."""
    parts = zip(x.chunk(tp, dim=-1), wq.chunk(tp, dim=1))
    y = sum(fp8_linear_reference(xp, wp.contiguous(), ws) for xp, wp in parts)
    return y if bias is None else y + bias


@pytest.mark.parametrize("tp,fully_sharded", [(1, False), (2, True)])
def test_generation_with_adapters_matches_hf_peft_over_the_same_fp8_products(demo, tmp_path, tp, fully_sharded):
    """The engine's FP8 model (float32 on CPU; TP 2 over gloo) with adapters on every projection:
    transformers + PEFT whose base nn.Linear layers (not the LM head) compute the same FP8 products from
    the same quantized weights (o_proj and down_proj as TP ranks split them). At TP 1 both run the same float
    operations in the same order, and logprobs agree as unquantized ones do. At TP 2 the partial sums add in
    another order, and FP8 rounding turns ulps into steps of 1/16 where a value sits on a rounding boundary:
    one ulp more on this model's GEMM inputs moves its logprobs by up to 0.07 (measured at TP 1, reference
    inputs times 1 + 2^-22), so there they agree within 0.1."""
    adapters = write_peft_adapters(demo.model_dir, tmp_path, 70,
                                   {"all-r8": dict(r=8, lora_alpha=16, target_modules=EVERY_PROJECTION)})

    def fp8_linears(model):
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and "lm_head" not in name:
                wq, ws = quantize_rows(module.weight.data)
                if name.endswith(("o_proj", "down_proj")):
                    module.forward = lambda x, wq=wq, ws=ws, b=module.bias: _row_parallel_reference(x, wq, ws, b, tp)
                else:
                    module.forward = lambda x, wq=wq, ws=ws, b=module.bias: fp8_linear_reference(x, wq, ws, b)

    prompts = ["The quick brown fox", "Once upon a time in a city far away,", "SELECT"]
    generate_against_peft(demo.model_dir, adapters, prompts, [None, "all-r8", "all-r8"], 8, tp, fully_sharded,
                          patch=fp8_linears, tolerance=None if tp == 1 else 0.1, quantization="fp8")


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 7, 32, 300])
def test_the_fp8_gemm_on_cuda_matches_the_reference(rows):
    """torch._scaled_mm with both row-wise scales (bfloat16 in and out) against the float32 products."""
    from replicas.quantization import fp8_linear

    x = _x(rows, 4096, rows, torch.bfloat16).cuda()
    g = torch.Generator().manual_seed(rows)
    wq, ws = quantize_rows((torch.randn(1024, 4096, generator=g) * 0.02).to(torch.bfloat16).cuda())
    bias = (torch.randn(1024, generator=g) * 0.1).to(torch.bfloat16).cuda()
    got, want = fp8_linear(x, wq, ws, bias).float(), fp8_linear_reference(x, wq, ws, bias).float()
    # the sums in another order, then one bfloat16 rounding (2^-8 relative) each, and the bias's
    torch.testing.assert_close(got, want, rtol=2 ** -7, atol=2 ** -7 * want.abs().max().item())


@pytest.mark.gpu
def test_an_fp8_engine_on_cuda_serves_adapters_close_to_bfloat16(demo, loras):
    """bfloat16 with FP8 weights, CUDA graphs, adapters: every request completes, and the prompts' logprobs
    (teacher-forced, so no token choice can diverge) stay near the unquantized engine's."""
    from replicas.llm import LLM
    from replicas.sampling_params import SamplingParams
    from lora_core.request import LoRARequest

    names = sorted(loras)[:2]
    requests = [None, LoRARequest(names[0], 1, str(loras[names[0]])), LoRARequest(names[1], 2, str(loras[names[1]]))]
    prompts = ["The quick brown fox jumps over the lazy dog", "Once upon a time in a city far away,", "SELECT *"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=0)

    def run(**kw):
        llm = LLM(str(demo.model_dir), enable_lora=True, max_loras=2, max_lora_rank=32, dtype="bfloat16",
                  kv_cache_memory_bytes=1 << 28, **kw)
        try:
            return llm.generate(prompts, params, requests)
        finally:
            llm.shutdown()

    fp8, exact = run(quantization="fp8"), run()
    for q, e in zip(fp8, exact):
        assert q.error is None and len(q.outputs[0].token_ids) == 12
        gaps = [abs(next(iter(a.values())) - next(iter(b.values())))
                for a, b in zip(q.prompt_logprobs[1:], e.prompt_logprobs[1:])]
        assert sum(gaps) / len(gaps) < 0.1, gaps


def test_merging_and_the_stacked_path_are_off_over_fp8_weights():
    from lora_core.config import LoRAConfig
    from lora_core.errors import LoRAConfigError
    from replicas.lora_layers import stacked_max_tokens
    from replicas.lora_merge import merge_after_steps

    config, cuda = LoRAConfig(max_loras=2, max_lora_rank=8), torch.device("cuda")
    assert merge_after_steps(None, config, cuda, 1, quantized=True) == 0
    assert stacked_max_tokens(None, config, cuda, 1, torch.bfloat16, quantized=True) == 0
    assert merge_after_steps(None, config, cuda, 1) > 0 and stacked_max_tokens(None, config, cuda, 1) > 0
    with pytest.raises(LoRAConfigError, match="FP8"):
        merge_after_steps(8, config, cuda, 1, quantized=True)
    with pytest.raises(LoRAConfigError, match="quantization"):
        stacked_max_tokens(256, config, cuda, 1, torch.bfloat16, quantized=True)
