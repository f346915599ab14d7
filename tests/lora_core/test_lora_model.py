"""LoRAModel loading against real PEFT adapters: every module's delta equals PEFT's."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from lora_core.config import LoRAConfig
from lora_core.lora_model import LoRAModel
from lora_core.peft_helper import PEFTHelper
from tests.lora_core.conftest import ALL_PROJ, PEFT_CASES

ATOL = 1e-5
CASES = {**PEFT_CASES,
         "lora_bias": dict(with_bias=True, r=4, lora_alpha=8, lora_bias=True, target_modules=ALL_PROJ)}
LORA_CONFIG = LoRAConfig(max_lora_rank=16, bias_enabled=True)


@pytest.fixture(scope="module", params=sorted(CASES))
def loaded(request, make_peft_adapter, expected_lora_modules, llama_module_specs):
    path, peft_model = make_peft_adapter(**CASES[request.param])
    model = LoRAModel.from_local_checkpoint(
        path, expected_lora_modules, lora_model_id=3, lora_config=LORA_CONFIG, module_specs=llama_module_specs)
    return model, peft_model, path


def _assert_deltas_match(model, peft_model, peft_deltas):
    expected = peft_deltas(peft_model)
    assert set(model.loras) == set(expected)
    for name, delta in expected.items():
        ours = model.get_lora(name).compute_delta_weight()
        assert ours.shape == delta.shape, name
        assert delta.abs().max() > 1e-3, name  # PEFT's zero-initialised B would make this vacuous
        torch.testing.assert_close(ours, delta, atol=ATOL, rtol=0, msg=name)


def test_every_delta_matches_peft(loaded, peft_deltas):
    model, peft_model, path = loaded
    assert model.id == 3 and model.path == str(path)
    _assert_deltas_match(model, peft_model, peft_deltas)


def test_optimize_preserves_deltas(make_peft_adapter, expected_lora_modules, peft_deltas):
    for kwargs in (CASES["rslora"], CASES["alpha_pattern"], CASES["embed_lm_head"]):
        path, peft_model = make_peft_adapter(**kwargs)
        model = LoRAModel.from_local_checkpoint(path, expected_lora_modules).optimize()
        assert all(l.scaling == 1.0 for l in model.loras.values())
        _assert_deltas_match(model, peft_model, peft_deltas)
        _assert_deltas_match(model.optimize(), peft_model, peft_deltas)  # idempotent


def test_layout_rank_and_scaling(loaded, peft_layers):
    """A is kept as [in, r] and B as [r, out]; rank and scaling are per module."""
    model, peft_model, _ = loaded
    layers = peft_layers(peft_model)
    for name, lora in model.loras.items():
        layer = layers[name]
        r = layer.r["default"]
        if lora.is_embedding:
            a, b = layer.lora_embedding_A["default"], layer.lora_embedding_B["default"]  # [r, vocab], [dim, r]
        else:
            a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight  # [r, in], [out, r]
        assert lora.rank == r and lora.lora_a.shape == (a.shape[1], r) and lora.lora_b.shape == (r, b.shape[0])
        torch.testing.assert_close(lora.lora_a, a.detach().T, atol=0, rtol=0)
        torch.testing.assert_close(lora.lora_b, b.detach().T, atol=0, rtol=0)
        assert lora.scaling == pytest.approx(layer.scaling["default"])
        assert lora.lora_alpha == layer.lora_alpha["default"]
        # Views of contiguous copies in PEFT's layout (what a slot write copies straight), not of the file's.
        assert lora.lora_a.t().is_contiguous() and lora.lora_b.t().is_contiguous()
        assert lora.lora_a.data_ptr() != a.data_ptr() and lora.lora_b.data_ptr() != b.data_ptr()
    assert model.rank == max(l.rank for l in model.loras.values())


def test_embedding_and_lm_head(make_peft_adapter, expected_lora_modules, llama_module_specs):
    path, _ = make_peft_adapter(**CASES["embed_lm_head"])
    model = LoRAModel.from_local_checkpoint(path, expected_lora_modules, module_specs=llama_module_specs)
    embed, head = model.get_lora("model.embed_tokens"), model.get_lora("lm_head")
    assert embed.is_embedding and embed.lora_a.shape == (128, 4) and embed.lora_b.shape == (4, 64)
    assert not head.is_embedding and head.lora_a.shape == (64, 4) and head.lora_b.shape == (4, 128)
    # PEFT also saved the base embedding / lm_head weights; they are not LoRA modules.
    assert not any("base_layer" in name for name in model.loras)


def test_lora_bias(make_peft_adapter, expected_lora_modules, peft_layers):
    path, peft_model = make_peft_adapter(**CASES["lora_bias"])
    model = LoRAModel.from_local_checkpoint(path, expected_lora_modules, lora_config=LORA_CONFIG)
    layers = peft_layers(peft_model)
    for name, lora in model.loras.items():
        bias = layers[name].lora_B["default"].bias.detach()
        torch.testing.assert_close(lora.bias, bias, atol=0, rtol=0)
    scalings = {name: lora.scaling for name, lora in model.loras.items()}
    model.optimize()
    for name, lora in model.loras.items():
        torch.testing.assert_close(lora.bias, layers[name].lora_B["default"].bias.detach() * scalings[name])


def test_rank_pattern_gives_mixed_ranks(make_peft_adapter, expected_lora_modules):
    path, _ = make_peft_adapter(**CASES["rank_pattern"])
    model = LoRAModel.from_local_checkpoint(path, expected_lora_modules)
    assert model.get_lora("model.layers.0.self_attn.q_proj").rank == 8
    assert model.get_lora("model.layers.1.mlp.down_proj").rank == 2
    assert model.get_lora("model.layers.0.mlp.down_proj").rank == 4
    assert model.rank == 8


def test_live_state_dict_keys_with_adapter_name(make_peft_adapter, expected_lora_modules, peft_deltas):
    """A live PEFT state_dict keeps the adapter name ('.lora_A.default.weight'); both spellings load."""
    kwargs = CASES["embed_lm_head"]
    path, peft_model = make_peft_adapter(**kwargs)
    live = {k: v for k, v in peft_model.state_dict().items() if ".lora_" in k}
    assert any(".lora_A.default.weight" in k for k in live)
    assert any(k.endswith(".lora_embedding_A.default") for k in live)
    helper = PEFTHelper.from_local_dir(path)
    model = LoRAModel.from_lora_tensors(live, helper, expected_lora_modules=expected_lora_modules)
    _assert_deltas_match(model, peft_model, peft_deltas)


def test_keys_without_peft_prefix(make_peft_adapter, expected_lora_modules, peft_deltas):
    path, peft_model = make_peft_adapter(**CASES["plain"])
    tensors = {k.removeprefix("base_model.model."): v
               for k, v in load_file(path / "adapter_model.safetensors").items()}
    model = LoRAModel.from_lora_tensors(tensors, PEFTHelper.from_local_dir(path),
                                        expected_lora_modules=expected_lora_modules)
    assert "model.layers.0.self_attn.q_proj" in model.loras
    _assert_deltas_match(model, peft_model, peft_deltas)


def test_tensors_are_copies_and_cast(make_peft_adapter, expected_lora_modules):
    path, _ = make_peft_adapter(**CASES["plain"])
    tensors = load_file(path / "adapter_model.safetensors")
    helper = PEFTHelper.from_local_dir(path)
    model = LoRAModel.from_lora_tensors(tensors, helper, expected_lora_modules=expected_lora_modules)
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    before = model.get_lora("model.layers.0.self_attn.q_proj").lora_a.clone()
    tensors[key].fill_(7.0)
    torch.testing.assert_close(model.get_lora("model.layers.0.self_attn.q_proj").lora_a, before)

    half = LoRAModel.from_local_checkpoint(path, expected_lora_modules, dtype=torch.bfloat16)
    assert all(l.lora_a.dtype == torch.bfloat16 and l.lora_b.dtype == torch.bfloat16 for l in half.loras.values())


def test_copy_false_aliases_the_given_tensors_and_means_the_same(make_peft_adapter, expected_lora_modules,
                                                                 peft_deltas):
    """copy=False (a loader process's read: laid out at once, then dropped) keeps the given tensors where
    device and dtype match, casts where not, and the deltas are PEFT's all the same."""
    path, peft_model = make_peft_adapter(**CASES["plain"])
    tensors = load_file(path / "adapter_model.safetensors")
    helper = PEFTHelper.from_local_dir(path)
    model = LoRAModel.from_lora_tensors(tensors, helper, expected_lora_modules=expected_lora_modules, copy=False)
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert model.get_lora("model.layers.0.self_attn.q_proj").lora_a.data_ptr() == tensors[key].data_ptr()
    _assert_deltas_match(model, peft_model, peft_deltas)
    half = LoRAModel.from_local_checkpoint(path, expected_lora_modules, dtype=torch.bfloat16, copy=False)
    assert all(l.lora_a.dtype == torch.bfloat16 and l.lora_b.dtype == torch.bfloat16 for l in half.loras.values())


def test_helper_passed_in_is_used(make_peft_adapter, expected_lora_modules):
    path, _ = make_peft_adapter(**CASES["plain"])
    helper = PEFTHelper.from_local_dir(path)
    model = LoRAModel.from_local_checkpoint(path, expected_lora_modules, helper)
    assert model.peft_helper is helper


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_all_finite_reads_the_exponent_bits(dtype):
    """The CPU bit test agrees with torch.isfinite at the edges: the largest finite magnitudes of either sign,
    subnormals, signed zeros, NaN and both infinities, in contiguous, strided and empty tensors."""
    from lora_core.adapter_checks import all_finite

    info = torch.finfo(dtype)
    edges = torch.tensor([info.max, -info.max, info.tiny / 2, -info.tiny / 2, 0.0, -0.0, 1.0], dtype=dtype)
    assert all_finite(edges) and all_finite(edges[::2]) and all_finite(edges[:0])
    for bad in (float("nan"), float("inf"), float("-inf")):
        t = torch.randn(8, 16).to(dtype)
        t[5, 3] = bad
        assert not all_finite(t) and not all_finite(t.t()), bad
        assert all_finite(t[:5]) and bool(torch.isfinite(t[:5]).all())
