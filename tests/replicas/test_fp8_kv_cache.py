"""EngineArgs.kv_cache_dtype="fp8": K and V stored in float8 e4m3 (replicas/attention.py). The engine with
adapters against transformers + PEFT whose attention reads the same FP8-rounded keys and values; the
saturation at +-448; the names. (The attention kernels reading an FP8 cache: test_paged_attention.py.)"""

from __future__ import annotations

import pytest
import torch

from replicas.attention import kv_cache_dtype, to_cache_dtype
from tests.replicas.conftest import EVERY_PROJECTION, generate_against_peft, write_peft_adapters

FP8 = torch.float8_e4m3fn


def test_names_and_saturation():
    assert kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_dtype("fp8", torch.bfloat16) == kv_cache_dtype("fp8_e4m3", torch.float32) == FP8
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_cache_dtype("int8", torch.bfloat16)
    x = torch.tensor([1000.0, -1000.0, 0.3, float("nan")])
    stored = to_cache_dtype(x, FP8).float()
    assert stored[:2].tolist() == [448.0, -448.0] and stored[2] == torch.tensor(0.3).to(FP8).float()
    assert stored[3].isnan()  # a NaN stays one (not turned into a finite value)
    assert torch.equal(to_cache_dtype(x[:3], torch.bfloat16), x[:3].to(torch.bfloat16))


def _hf_attention_reads_fp8(monkeypatch, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """transformers' Llama attention (eager) reads keys and values as an FP8 cache stores them:
    round_fp8(x / scale) * scale."""
    import transformers.models.llama.modeling_llama as llama

    eager = llama.eager_attention_forward

    def stored(x, scale):
        return to_cache_dtype(x / scale, FP8).to(x.dtype) * scale

    def fp8_kv(module, query, key, value, *args, **kwargs):
        return eager(module, query, stored(key, k_scale), stored(value, v_scale), *args, **kwargs)

    monkeypatch.setattr(llama, "eager_attention_forward", fp8_kv)


@pytest.mark.parametrize("tp", [1, 2])
def test_generation_with_adapters_matches_hf_peft_over_fp8_keys_and_values(demo, tmp_path, monkeypatch, tp):
    """transformers computes every step over the whole sequence, each key and value rounded to FP8 as the
    engine stores them (the step's own too: the engine writes before it reads); queries stay unrounded. The
    keys and values come out of GEMMs that sum in another order than transformers' (ulps apart), and a value
    an ulp from an FP8 rounding boundary lands a step (1/16) away: logprobs then agree within 0.03, not 2e-3
    (0.0055 measured). Without the FP8 cache the engine's tokens differ from the first one."""
    _hf_attention_reads_fp8(monkeypatch)
    adapters = write_peft_adapters(demo.model_dir, tmp_path, 90,
                                   {"all-r8": dict(r=8, lora_alpha=16, target_modules=EVERY_PROJECTION)})
    prompts = ["The quick brown fox", "Once upon a time in a city far away,", "SELECT"]
    generate_against_peft(demo.model_dir, adapters, prompts, [None, "all-r8", "all-r8"], 8, tp, tp > 1,
                          tolerance=0.03, kv_cache_dtype="fp8")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_fused_cache_write_stores_what_the_reference_stores(dtype):
    """fused.write_kv_cache into FP8 caches (values past 448 among them) bit for bit as write_kv; on CUDA only:
    Triton's interpreter rounds some float8 conversions into the binade below."""
    from replicas.attention import write_kv
    from replicas.kernels import fused

    g = torch.Generator().manual_seed(5)
    k, v = ((torch.randn(7, 2, 64, generator=g) * 200).to("cuda", dtype) for _ in range(2))
    slots = torch.tensor([5, 0, -1, 23, 9, -1, 12], device="cuda")
    got = [torch.zeros(6, 4, 2, 64, device="cuda").to(FP8) for _ in range(2)]
    want = [c.clone() for c in got]
    fused.write_kv_cache(k, v, *got, slots)
    write_kv(k, v, *want, slots)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got, want))


def test_a_checkpoints_calibrated_scales_divide_what_the_cache_stores(demo, tmp_path, monkeypatch):
    """An FP8 checkpoint with a kv_cache_scheme (k_scale 0.05, v_scale 0.07 on every layer) served with an FP8
    cache: keys and values stored as round_fp8(k / k_scale) and read back times it. transformers (its linear
    layers computing the same FP8 products) with its attention reading keys and values rounded that way."""
    from replicas.quantization import fp8_linear_reference
    from tests.replicas.test_fp8 import CHANNEL_DYNAMIC, _fp8_linears, _write_fp8_checkpoint

    config = dict(CHANNEL_DYNAMIC, kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": "tensor"})
    fp8_dir = _write_fp8_checkpoint(demo.model_dir, tmp_path / "fp8", config, per_tensor=False, kv_scales=True)
    _hf_attention_reads_fp8(monkeypatch, k_scale=0.05, v_scale=0.07)
    prompts = ["The quick brown fox", "Once upon a time in a city far away,", "SELECT"]
    generate_against_peft(fp8_dir, {}, prompts, [None] * 3, 8, patch=_fp8_linears(
        lambda name, wq, ws, bias: lambda x: fp8_linear_reference(x, wq, ws, bias)),
        reference_dir=demo.model_dir, tolerance=0.03, kv_cache_dtype="fp8")
