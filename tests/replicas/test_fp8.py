"""FP8 base weights (EngineArgs.quantization="fp8", replicas/quantization.py): the quantization, the GEMM
against its float32 definition, the Triton input quantizer, the layers, and the engine with adapters against
transformers + PEFT whose base linear layers compute the same FP8 products."""

from __future__ import annotations

import pytest
import torch

from replicas.quantization import (FP8, FP8_MAX, MIN_SCALE, check_method, fp8_linear_reference, quantize_rows,
                                   row_scales)
from tests.replicas.conftest import EVERY_PROJECTION, generate_against_peft, write_peft_adapters
from tests.replicas.fp8_reference import assert_quantized_rows, e4m3_round, e4m3_value

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


@pytest.mark.parametrize("width", [3000, 17000])  # a row in one block, and one over two (MAX_BLOCK)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_triton_quantizer_equals_the_reference(dtype, width):
    """Scales and FP8 values bit for bit against the e4m3 definition (fp8_reference.py) and the torch
    quantizer; under the interpreter the values its float8 conversion gets right (it rounds some into the
    binade below: 125.7 -> 64)."""
    from replicas.kernels.fp8 import MAX_BLOCK, quantize_rows as kernel

    assert (width <= MAX_BLOCK) == (width == 3000)
    x = _x(9, width, 3, dtype).to("cuda" if ON_GPU else "cpu")
    strided = torch.cat([x, x], dim=1)[:, :width]
    q, scales = kernel(strided)
    assert_quantized_rows(x, q, scales)
    static = torch.tensor([0.05], device=x.device)  # a checkpoint's input scale: the larger rows saturate
    assert_quantized_rows(x, *kernel(strided, static=static), static=static)
    q_ref, scales_ref = quantize_rows(x)
    assert torch.equal(scales, scales_ref)
    if ON_GPU:
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    # into given rows (the stacked FP8 A rows: replicas/fp8_lora.py): rows 2-6 of an [11, width] buffer
    out, out_scales = torch.zeros(11, width, dtype=FP8, device=x.device), torch.zeros(11, device=x.device)
    kernel(strided[2:7], out=out[2:7], out_scales=out_scales[2:7])
    assert_quantized_rows(x[2:7], out[2:7], out_scales[2:7])
    assert not out_scales[7:].any() and not out_scales[:2].any()
    assert not out[7:].view(torch.uint8).any() and not out[:2].view(torch.uint8).any()
    with pytest.raises(ValueError, match="fit"):
        kernel(strided[2:7], out=out[2:6], out_scales=out_scales[2:7])


def test_the_triton_quantizer_divides_rounding_correctly():
    """x / scale correctly rounded, not x times 1 / scale: float32 ulps around e4m3's rounding boundaries times
    a scale of 3 (1 / 3 is inexact), kept where the two quotients quantize apart."""
    from replicas.kernels.fp8 import quantize_rows as kernel

    values = e4m3_value(torch.arange(0x08, 0x7E, dtype=torch.uint8))  # the normals below 448
    bits = ((values[:-1] + values[1:]) / 2 * 3).float().view(torch.int32)  # exact: 7 significant bits at most
    x = torch.cat([(bits + k).view(torch.float32) for k in range(-6, 7)])
    x = x[e4m3_round(x / 3) != e4m3_round(x * (1 / torch.tensor(3.0)))]
    assert len(x) >= 8
    row = torch.cat([x, torch.tensor([448.0 * 3])]).unsqueeze(0).to("cuda" if ON_GPU else "cpu")
    q, scales = kernel(row)
    assert scales.item() == 3.0
    assert_quantized_rows(row, q, scales)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, marks=pytest.mark.gpu), torch.float16])
def test_the_product_epilogue_scales_rounds_then_adds_the_bias(dtype, with_bias):
    """The unit-scale product's epilogue (kernels/fp8.scale_product) against torch doing the same steps: the
    scales in float32, one rounding to the dtype, the bias added as y + bias adds it. (bfloat16 on CUDA only:
    the interpreter's bfloat16 conversion truncates.)"""
    from replicas.kernels.fp8 import SCALE_BLOCK, scale_product

    device = "cuda" if ON_GPU else "cpu"
    g = torch.Generator().manual_seed(4)
    rows, width = 5, SCALE_BLOCK + 37  # a partial block of columns
    acc = (torch.randn(rows, width, generator=g) * 300).to(device)
    x_scale, w_scale = torch.rand(rows, generator=g).to(device), torch.rand(width, generator=g).to(device) / 50
    bias = (torch.randn(width, generator=g)).to(dtype).to(device) if with_bias else None
    want = (acc * x_scale.unsqueeze(1) * w_scale.unsqueeze(0)).to(dtype)
    if with_bias:
        want = want + bias
    got = scale_product(acc, x_scale, w_scale, bias, dtype)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def _fp8_linears(forward, per_tensor: bool = False):
    """A peft_greedy_reference patch: every nn.Linear but the LM head runs forward(name, FP8 weight, its row
    scales, bias) (one scale for the whole tensor where per_tensor, else one per row)."""
    def patch(model):
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and "lm_head" not in name:
                w = module.weight.data
                wq, ws = quantize_rows(w, row_scales(w.reshape(1, -1)).expand(w.shape[0]) if per_tensor else None)
                module.forward = forward(name, wq, ws, module.bias)
    return patch


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

    def forward(name, wq, ws, bias):
        if name.endswith(("o_proj", "down_proj")):
            return lambda x: _row_parallel_reference(x, wq, ws, bias, tp)
        return lambda x: fp8_linear_reference(x, wq, ws, bias)

    prompts = ["The quick brown fox", "Once upon a time in a city far away,", "SELECT"]
    generate_against_peft(demo.model_dir, adapters, prompts, [None, "all-r8", "all-r8"], 8, tp, fully_sharded,
                          patch=_fp8_linears(forward), tolerance=None if tp == 1 else 0.1, quantization="fp8")


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
@pytest.mark.parametrize("stacked", [0, 256], ids=["unstacked", "stacked"])
def test_an_fp8_engine_on_cuda_serves_adapters_as_close_as_the_float32_definition(demo, loras, stacked):
    """bfloat16 with FP8 weights on CUDA (torch._scaled_mm, the Triton quantizer, CUDA graphs, adapters):
    every request completes, and its prompts' logprobs (teacher-forced, so no token choice can diverge) move
    away from the unquantized engine's by about what FP8 moves them in float32 on the CPU (the reference GEMM).
    The demo model is chaotic under FP8 (its logprobs reach -25; an e4m3 step flips as an activation moves by
    an ulp): on the CPU FP8 moves them 0.65 on average in float32, 0.85 in bfloat16, and bfloat16 alone 0.14;
    a wrong scale or GEMM moves them by whole units. stacked: decode and prompt steps of up to that many rows
    shrink in the FP8 GEMM (replicas/fp8_lora.py), in the definition too."""
    from replicas.llm import LLM
    from replicas.sampling_params import SamplingParams

    names = sorted(loras)[:2]
    requests = [None, loras[names[0]], loras[names[1]]]
    prompts = ["The quick brown fox jumps over the lazy dog", "Once upon a time in a city far away,", "SELECT *"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=0)

    def logprobs(**kw) -> list[float]:
        llm = LLM(str(demo.model_dir), enable_lora=True, max_loras=2, max_lora_rank=32,
                  kv_cache_memory_bytes=1 << 28, **kw)
        try:
            outs = llm.generate(prompts, params, requests)
        finally:
            llm.shutdown()
        for out in outs:
            assert out.error is None and len(out.outputs[0].token_ids) == 12
        return [next(iter(pos.values())) for out in outs for pos in out.prompt_logprobs[1:]]

    def mean_gap(a: list[float], b: list[float]) -> float:
        return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / len(a)

    on_cuda = mean_gap(logprobs(dtype="bfloat16", quantization="fp8", lora_stacked_max_tokens=stacked),
                       logprobs(dtype="bfloat16"))
    definition = mean_gap(logprobs(dtype="float32", device="cpu", quantization="fp8", lora_stacked_max_tokens=stacked),
                          logprobs(dtype="float32", device="cpu"))
    assert on_cuda < 2 * definition, (on_cuda, definition)


def test_merging_and_by_default_the_stacked_path_are_off_over_fp8_weights():
    """(The stacked path when asked for: tests/replicas/test_fp8_lora.py.)"""
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


# ---- checkpoints already in FP8 (replicas/fp8_checkpoint.py) ------------------------------------------------

def _compressed(weights: dict, inputs: dict | None, **extra) -> dict:
    group = {"targets": ["Linear"], "weights": {"type": "float", "num_bits": 8, "symmetric": True, **weights},
             "input_activations": None if inputs is None else {"type": "float", "num_bits": 8, **inputs},
             "output_activations": None}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": group},
            "ignore": ["lm_head"], **extra}


CHANNEL_DYNAMIC = _compressed({"strategy": "channel", "dynamic": False}, {"strategy": "token", "dynamic": True})
TENSOR_STATIC = _compressed({"strategy": "tensor", "dynamic": False}, {"strategy": "tensor", "dynamic": False})


@pytest.mark.parametrize("config,static", [(CHANNEL_DYNAMIC, False), (TENSOR_STATIC, True),
                                           ({"quant_method": "fp8", "activation_scheme": "static"}, True),
                                           ({"quant_method": "fp8", "activation_scheme": "dynamic",
                                             "ignored_layers": ["lm_head"]}, False)])
def test_fp8_checkpoint_configs_are_read(config, static):
    from replicas.fp8_checkpoint import parse_fp8_checkpoint

    assert parse_fp8_checkpoint({"quantization_config": config}, "m").static_input is static
    assert parse_fp8_checkpoint({}, "m") is None


@pytest.mark.parametrize("config,match", [
    ({"quant_method": "awq"}, "quant_method 'awq'"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "block-wise"),
    (_compressed({"strategy": "channel"}, None), "weight-only"),
    (_compressed({"strategy": "group", "group_size": 128}, {"strategy": "token", "dynamic": True}), "strategy"),
    (_compressed({"strategy": "channel", "type": "int"}, {"strategy": "token", "dynamic": True}), "8-bit float"),
    (_compressed({"strategy": "channel"}, {"strategy": "token", "dynamic": False}), "input_activations"),
    (_compressed({"strategy": "channel"}, {"strategy": "token", "dynamic": True},
                 ignore=["lm_head", "model.layers.0.mlp.down_proj"]), "unquantized"),
    (dict(CHANNEL_DYNAMIC, format="pack-quantized"), "format"),
])
def test_other_quantization_configs_name_what_is_unsupported(config, match):
    from replicas.errors import ModelConfigError
    from replicas.fp8_checkpoint import parse_fp8_checkpoint

    with pytest.raises(ModelConfigError, match=match):
        parse_fp8_checkpoint({"quantization_config": config}, "m")


def _write_fp8_checkpoint(source, out, config: dict, per_tensor: bool, input_scales: dict | None = None,
                          kv_scales: bool = False):
    """source's checkpoint with every decoder linear weight in FP8 (scales per row, or one per tensor) and,
    with input_scales (projection -> value), a static input scale for each; kv_scales: each attention layer's
    k_scale and v_scale too (compressed-tensors' kv_cache_scheme)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    out.mkdir()
    tensors = {}
    for name, tensor in load_file(source / "model.safetensors").items():
        projection = name.split(".")[-2]
        if name.endswith("proj.weight") and ".layers." in name:
            scale = row_scales(tensor.reshape(1, -1)).expand(tensor.shape[0]) if per_tensor else None
            q, scales = quantize_rows(tensor, scale)
            tensors[name] = q
            tensors[name + "_scale"] = scales[:1].clone() if per_tensor else scales.unsqueeze(1)
            if input_scales is not None:
                tensors[name[: -len("weight")] + "input_scale"] = torch.tensor([input_scales[projection]])
            if kv_scales and projection == "k_proj":
                attn = name[: -len("k_proj.weight")]
                tensors[attn + "k_scale"], tensors[attn + "v_scale"] = torch.tensor(0.05), torch.tensor(0.07)
        else:
            tensors[name] = tensor
    save_file(tensors, out / "model.safetensors")
    raw = json.loads((source / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**raw, "quantization_config": config}))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(source / name, out / name)
    return out


@pytest.mark.parametrize("tp,kv_scales", [(1, False), (2, False), (1, True)])
def test_a_per_channel_checkpoint_serves_as_quantization_fp8_over_its_source(demo, tmp_path, tp, kv_scales):
    """Per-channel weights ([out, 1] scales) with dynamic inputs, read from the checkpoint (at TP 2 each rank
    cuts its rows of q, k, v, gate and up and their scales): the same tokens and logprobs as the source
    checkpoint quantized at load, adapters included. A kv_cache_scheme's k_scale / v_scale are read and left
    out (the cache stays in the model's dtype here)."""
    from lora_core.request import LoRARequest
    from replicas.llm import LLM
    from replicas.sampling_params import SamplingParams

    config = dict(CHANNEL_DYNAMIC, kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": "tensor"}) \
        if kv_scales else CHANNEL_DYNAMIC
    fp8_dir = _write_fp8_checkpoint(demo.model_dir, tmp_path / "fp8", config, per_tensor=False, kv_scales=kv_scales)
    name = sorted(demo.adapters)[0]
    lora = [None, LoRARequest(name, 1, str(demo.adapters[name]))]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=0, ignore_eos=True)
    outs = []
    for model, kw in ((fp8_dir, {}), (demo.model_dir, {"quantization": "fp8"})):
        llm = LLM(str(model), enable_lora=True, max_lora_rank=32, dtype="float32", device="cpu",
                  tensor_parallel_size=tp, **kw)
        outs.append(llm.generate(["The quick brown fox", "SELECT"], params, lora))
        llm.shutdown()
    for a, b in zip(*outs, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        # not bit for bit: two engines' float32 results were 1e-6 apart in about one run of six (the second
        # token's logprob; tokens equal), the same order of tests each time: CPU GEMMs need not repeat their sums
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert x.keys() == y.keys() and all(abs(x[t] - y[t]) <= 1e-5 for t in x)


@pytest.mark.parametrize("stacked", [0, 512], ids=["unstacked", "stacked"])
def test_a_per_tensor_static_checkpoint_matches_hf_peft_over_the_same_products(demo, tmp_path, stacked):
    """One scale per weight tensor and a static input scale per projection (q, k and v apart, so the packed
    layer must take their largest, as must gate and up): the engine with adapters against transformers + PEFT
    on the source checkpoint whose linear layers compute those FP8 products. stacked: the shrink in the FP8
    GEMM (replicas/fp8_lora.py), whose input is quantized with the layer's static scale: PEFT's lora_A layers
    compute that product (A per rank row)."""
    inputs = {"q_proj": 0.02, "k_proj": 0.03, "v_proj": 0.025, "o_proj": 0.01, "gate_proj": 0.04, "up_proj": 0.03,
              "down_proj": 0.05}
    packed = {"q_proj": ("q_proj", "k_proj", "v_proj"), "gate_proj": ("gate_proj", "up_proj")}
    packed |= {"k_proj": packed["q_proj"], "v_proj": packed["q_proj"], "up_proj": packed["gate_proj"]}
    fp8_dir = _write_fp8_checkpoint(demo.model_dir, tmp_path / "fp8", TENSOR_STATIC, per_tensor=True,
                                    input_scales=inputs)
    adapters = write_peft_adapters(demo.model_dir, tmp_path, 80,
                                   {"all-r8": dict(r=8, lora_alpha=16, target_modules=EVERY_PROJECTION)})

    def static(projection: str) -> torch.Tensor:
        return torch.tensor([max(inputs[p] for p in packed.get(projection, (projection,)))])

    def forward(name, wq, ws, bias):
        return lambda x: fp8_linear_reference(x, wq, ws, bias, static(name.rsplit(".", 1)[-1]))

    def lora_a(model):  # "...self_attn.q_proj.lora_A.all-r8"
        for name, module in model.named_modules():
            if ".lora_A." in name and isinstance(module, torch.nn.Linear):
                aq, a_scale = quantize_rows(module.weight.data)
                scale = static(name.split(".lora_A.")[0].rsplit(".", 1)[-1])
                module.forward = lambda x, aq=aq, a_scale=a_scale, scale=scale: fp8_linear_reference(
                    x, aq, a_scale, None, scale)

    prompts = ["The quick brown fox", "Once upon a time in a city far away,", "SELECT"]
    generate_against_peft(fp8_dir, adapters, prompts, [None, "all-r8", "all-r8"], 8,
                          patch=_fp8_linears(forward, per_tensor=True), reference_dir=demo.model_dir,
                          patch_peft=lora_a if stacked else None, tolerance=0.1 if stacked else None,
                          lora_stacked_max_tokens=stacked)


def test_a_phi3_checkpoint_with_fused_fp8_tensors_loads_their_scales(demo, tmp_path):
    """Phi-3 stores q/k/v and gate/up fused: a per-tensor scale (and static input scale) then covers all of
    a fused tensor, and the pieces the loader cuts share it. The engine serves it as transformers' Phi-3
    computes those FP8 products."""
    from tests.replicas.conftest import over_demo_tokenizer

    source = over_demo_tokenizer(demo, tmp_path / "phi3", "phi3")
    inputs = {"qkv_proj": 0.02, "o_proj": 0.01, "gate_up_proj": 0.04, "down_proj": 0.05}
    fp8_dir = _write_fp8_checkpoint(source, tmp_path / "fp8", TENSOR_STATIC, per_tensor=True, input_scales=inputs)

    def forward(name, wq, ws, bias):
        static = torch.tensor([inputs[name.rsplit(".", 1)[-1]]])
        return lambda x: fp8_linear_reference(x, wq, ws, bias, static)

    generate_against_peft(fp8_dir, {}, ["The quick brown fox", "SELECT"], [None, None], 6,
                          patch=_fp8_linears(forward, per_tensor=True), reference_dir=source)
