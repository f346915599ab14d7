"""A multimodal model's text model by name (lora_core/multimodal_names.py), as checkpoints and PEFT adapters
of Gemma 3 4B-27B spell it in transformers v4 and v5."""

from __future__ import annotations

import pytest

from lora_core.adapter_checks import group_by_module, parse_key
from lora_core.multimodal_names import image_only, text_model_name


@pytest.mark.parametrize("name,want", [
    ("language_model.model.layers.3.self_attn.q_proj", "model.layers.3.self_attn.q_proj"),  # v4
    ("model.language_model.layers.3.mlp.down_proj", "model.layers.3.mlp.down_proj"),  # v5
    ("language_model.lm_head.weight", "lm_head.weight"),
    ("model.layers.3.self_attn.q_proj", "model.layers.3.self_attn.q_proj"),  # a text model's own: unchanged
    ("model.language_modelling.x", "model.language_modelling.x"),  # only the whole segment counts
])
def test_names_under_language_model_are_the_text_models(name, want):
    assert text_model_name(name) == want


def test_the_vision_tower_and_projector_are_image_only():
    assert image_only("vision_tower.vision_model.encoder.layers.0.self_attn.q_proj")
    assert image_only("model.vision_tower.encoder.layers.0.self_attn.q_proj")
    assert image_only("model.multi_modal_projector.mm_input_projection_weight")
    assert not image_only("model.language_model.layers.0.self_attn.q_proj")
    assert not image_only("model.layers.0.self_attn.q_proj")


def test_an_adapters_keys_group_under_the_text_models_modules():
    import torch

    a, b = torch.zeros(4, 8), torch.zeros(8, 4)
    keys = {"base_model.model.model.language_model.layers.0.self_attn.q_proj.lora_A.weight": a,
            "base_model.model.model.language_model.layers.0.self_attn.q_proj.lora_B.weight": b,
            "base_model.model.model.vision_tower.encoder.layers.0.self_attn.q_proj.lora_A.weight": a,
            "base_model.model.model.vision_tower.encoder.layers.0.self_attn.q_proj.lora_B.weight": b}
    assert parse_key(next(iter(keys)))[0] == "model.layers.0.self_attn.q_proj"
    modules, problems = group_by_module(keys, "adapter_model.safetensors")
    assert list(modules) == ["model.layers.0.self_attn.q_proj"] and problems == []
