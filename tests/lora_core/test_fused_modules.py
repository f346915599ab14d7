"""Adapters of models that store q/k/v and gate/up fused (Phi-3: qkv_proj, gate_up_proj): real PEFT adapters on
a tiny transformers Phi3 load as the packed layer's sub-modules, one A for all slices and B cut by rows, each
slice's delta equal to PEFT's rows; rank and alpha patterns keyed on the fused name hold; the structure cache
and the loader processes' parts split alike; a module given fused and in parts, or a B that does not cover
the layer, is refused."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import Phi3Config, Phi3ForCausalLM

from lora_core.adapter_structure import AdapterStructures
from lora_core.config import LoRAConfig
from lora_core.errors import AdapterShapeError, CorruptAdapterError
from lora_core.lora_model import LoRAModel
from tests.lora_core.conftest import HEADS, HIDDEN, INTERMEDIATE, KV_HEADS, LAYERS, VOCAB, peft_delta_in_out, \
    peft_lora_layers

FUSED = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
EXPECTED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj")
KV = KV_HEADS * (HIDDEN // HEADS)
SLICES = {"qkv_proj": [("self_attn.q_proj", HIDDEN), ("self_attn.k_proj", KV), ("self_attn.v_proj", KV)],
          "gate_up_proj": [("mlp.gate_proj", INTERMEDIATE), ("mlp.up_proj", INTERMEDIATE)]}


@pytest.fixture(scope="module")
def tiny_phi3():
    config = Phi3Config(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
                        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=VOCAB,
                        max_position_embeddings=128, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    return Phi3ForCausalLM(config).eval()


def _adapter(tiny_phi3, tmp_path, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = get_peft_model(copy.deepcopy(tiny_phi3), LoraConfig(**kwargs))
        gen = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_" in name:
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
        peft_model.save_pretrained(tmp_path)
    return peft_model


def _load(path, specs, **kw):
    return LoRAModel.from_local_checkpoint(path, EXPECTED, module_specs=specs, **kw)


def _expect_split(model: LoRAModel, peft_model) -> None:
    """Every slice of every fused module: PEFT's delta rows, one A shared; plain modules as they are."""
    for name, layer in peft_lora_layers(peft_model).items():
        delta = peft_delta_in_out(layer)  # [in, out]
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in SLICES:
            got = model.get_lora(name)
            torch.testing.assert_close(got.lora_a @ got.lora_b * got.scaling, delta)
            continue
        assert model.get_lora(name) is None  # only the slices are served
        layer_prefix = name.rsplit(".", 2)[0]
        start = 0
        for sub, width in SLICES[leaf]:
            got = model.get_lora(f"{layer_prefix}.{sub}")
            torch.testing.assert_close(got.lora_a @ got.lora_b * got.scaling, delta[:, start:start + width])
            start += width
        assert start == delta.shape[1]


def test_fused_modules_load_as_their_slices(tiny_phi3, tmp_path, llama_module_specs):
    peft_model = _adapter(tiny_phi3, tmp_path, r=4, lora_alpha=8, target_modules=FUSED)
    model = _load(tmp_path, llama_module_specs)
    _expect_split(model, peft_model)
    q, k = (model.get_lora(f"model.layers.0.self_attn.{m}") for m in ("q_proj", "k_proj"))
    assert torch.equal(q.lora_a, k.lora_a) and q.rank == k.rank == 4


def test_rank_and_alpha_patterns_keyed_on_the_fused_name(tiny_phi3, tmp_path, llama_module_specs):
    peft_model = _adapter(tiny_phi3, tmp_path, r=4, lora_alpha=8, target_modules=FUSED,
                          rank_pattern={"qkv_proj": 8}, alpha_pattern={r"layers\.1\.mlp\.gate_up_proj": 2})
    model = _load(tmp_path, llama_module_specs)
    _expect_split(model, peft_model)
    assert model.get_lora("model.layers.0.self_attn.v_proj").rank == 8
    assert model.get_lora("model.layers.1.mlp.up_proj").scaling == 2 / 4


def test_the_structure_cache_and_load_parts_split_alike(tiny_phi3, tmp_path, llama_module_specs):
    peft_model = _adapter(tiny_phi3, tmp_path, r=4, lora_alpha=8, target_modules=FUSED)
    structures, config = AdapterStructures(), LoRAConfig(max_loras=2, max_lora_rank=16)
    first = _load(tmp_path, llama_module_specs, lora_config=config, structures=structures, copy=False)
    cached = _load(tmp_path, llama_module_specs, lora_config=config, structures=structures, copy=False)
    assert len(structures) == 1 and set(first.loras) == set(cached.loras)
    _expect_split(cached, peft_model)
    parts = [_load(tmp_path, llama_module_specs, lora_config=config, part=(k, 2), copy=False) for k in range(2)]
    assert sorted(n for p in parts for n in p.loras) == sorted(first.loras)
    for p in parts:
        for name, lora in p.loras.items():
            torch.testing.assert_close(lora.lora_b, first.get_lora(name).lora_b)


def test_without_the_served_models_layers_the_fused_module_stays_whole(tiny_phi3, tmp_path):
    """A validation that knows no model (the cluster's adapter tier) checks names only: nothing to split by."""
    _adapter(tiny_phi3, tmp_path, r=4, lora_alpha=8, target_modules=["qkv_proj"])
    model = LoRAModel.from_local_checkpoint(tmp_path, EXPECTED)
    assert model.get_lora("model.layers.0.self_attn.qkv_proj").lora_b.shape == (4, HIDDEN + 2 * KV)


def test_a_module_fused_and_in_parts_is_refused(tiny_phi3, tmp_path, llama_module_specs):
    _adapter(tiny_phi3, tmp_path, r=4, lora_alpha=8, target_modules=["qkv_proj"])
    tensors = load_file(tmp_path / "adapter_model.safetensors")
    prefix = "base_model.model.model.layers.0.self_attn"
    tensors[f"{prefix}.k_proj.lora_A.weight"] = torch.zeros(4, HIDDEN)
    tensors[f"{prefix}.k_proj.lora_B.weight"] = torch.zeros(KV, 4)
    save_file(tensors, tmp_path / "adapter_model.safetensors")
    with pytest.raises(CorruptAdapterError, match="both fused and as its part model.layers.0.self_attn.k_proj"):
        _load(tmp_path, llama_module_specs)


def test_a_fused_b_that_does_not_cover_the_layer_is_refused(tiny_phi3, tmp_path, llama_module_specs):
    _adapter(tiny_phi3, tmp_path, r=4, lora_alpha=8, target_modules=["gate_up_proj"])
    tensors = load_file(tmp_path / "adapter_model.safetensors")
    key = "base_model.model.model.layers.1.mlp.gate_up_proj.lora_B.weight"
    tensors[key] = tensors[key][:INTERMEDIATE].contiguous()  # gate's rows only
    save_file(tensors, tmp_path / "adapter_model.safetensors")
    with pytest.raises(AdapterShapeError, match=rf"out_features={2 * INTERMEDIATE}"):
        _load(tmp_path, llama_module_specs)
