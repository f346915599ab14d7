"""Gemma 3 (Gemma3ForCausalLM, Gemma3ForConditionalGeneration) and Gemma 2: their config fields, and the
engine against transformers (+ PEFT).

The model's logits are compared with transformers in test_model_vs_hf.py (the "gemma3" checkpoint: a sliding
layer of window 6 over local rope, a full layer over linearly scaled global rope, soft-capped logits); here the
config's two layouts and its refusals, then the engine generating greedily from text, base and LoRA adapters
(on every projection, and one on embed_tokens, which the embedding scale multiplies too) mixed in one batch,
at TP = 1 and 2.
"""

from __future__ import annotations

import math

import pytest

from replicas.model_config import ModelConfig, ModelConfigError
from tests.replicas.conftest import (EVERY_PROJECTION, generate_against_peft, over_demo_tokenizer,
                                     write_peft_adapter, write_peft_adapters)

STEPS = 8
PROMPTS = ["The quick brown fox", "Once upon a time in a city far away, there lived", "SELECT"]
# google/gemma-3-1b-it's config.json (transformers v4 layout), smaller
GEMMA3_1B = dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=64, hidden_size=32,
                 intermediate_size=64, num_hidden_layers=7, num_attention_heads=4, num_key_value_heads=1,
                 head_dim=16, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=16, rms_norm_eps=1e-6,
                 rope_theta=1000000, rope_local_base_freq=10000, rope_scaling=None, sliding_window=512,
                 sliding_window_pattern=6, final_logit_softcapping=None, attn_logit_softcapping=None,
                 max_position_embeddings=32768, bos_token_id=2, eos_token_id=[1, 106])


def test_parses_the_v4_layout_of_gemma_3_1b():
    cfg = ModelConfig.from_dict(GEMMA3_1B)
    assert cfg.layer_sliding_windows == (512,) * 5 + (None, 512)  # every sixth layer attends to everything
    assert [cfg.layer_rope(i)[0] for i in (0, 5)] == [10000.0, 1000000.0]
    assert (cfg.attn_scale, cfg.embed_scale, cfg.hidden_act) == (0.25, math.sqrt(32), "gelu_pytorch_tanh")
    assert (cfg.qk_norm, cfg.final_logit_softcapping, cfg.eos_token_ids) == (True, None, (1, 106))
    scaled = ModelConfig.from_dict({**GEMMA3_1B, "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert scaled.layer_rope(5)[1].factor == 8.0 and scaled.layer_rope(0)[1].rope_type == "default"


def test_parses_the_v5_layout():
    v5 = {**GEMMA3_1B, "rope_theta": None, "rope_local_base_freq": None, "layer_types": ["full_attention"] * 7,
          "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 5e5},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}}}
    cfg = ModelConfig.from_dict(v5)
    assert cfg.layer_sliding_windows == (None,) * 7
    assert (cfg.layer_rope(0)[0], cfg.layer_rope(0)[1].factor, cfg.local_rope[0]) == (5e5, 4.0, 50.0)


def test_parses_gemma_2_with_its_defaults():
    """google/gemma-2-2b's config.json leaves layer_types out: every second layer attends to everything; both
    soft caps default on (transformers' Gemma2Config)."""
    raw = {**GEMMA3_1B, "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "num_hidden_layers": 4,
           "sliding_window": 4096, "rope_theta": 10000.0}
    for key in ("rope_local_base_freq", "sliding_window_pattern", "final_logit_softcapping",
                "attn_logit_softcapping"):
        raw.pop(key)
    cfg = ModelConfig.from_dict(raw)
    assert cfg.layer_sliding_windows == (4096, None, 4096, None)
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping, cfg.qk_norm) == (50.0, 30.0, False)
    assert cfg.local_rope is None and cfg.layer_rope(0) == cfg.layer_rope(1) == (10000.0, cfg.rope_scaling)
    unset = ModelConfig.from_dict({**raw, "attn_logit_softcapping": None, "final_logit_softcapping": None})
    assert (unset.attn_logit_softcapping, unset.final_logit_softcapping) == (None, None)


@pytest.mark.parametrize("change,match", [
    ({"attn_logit_softcapping": -1}, "attn_logit_softcapping must be a positive number"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"hidden_activation": "gelu"}, "hidden_activation 'gelu'"),
    ({"layer_types": ["sliding_attention"] * 3}, "each of the 7 layers"),
    ({"layer_types": ["chunked_attention"] * 7}, "each of the 7 layers"),
], ids=["negative-softcap", "bidirectional", "exact-gelu", "short-layer-types", "unknown-layer-type"])
def test_refused_gemma_configs_name_the_field(change, match):
    with pytest.raises(ModelConfigError, match=match):
        ModelConfig.from_dict({**GEMMA3_1B, **change})


@pytest.fixture(scope="module")
def gemma3_dir(demo, tmp_path_factory):
    return over_demo_tokenizer(demo, tmp_path_factory.mktemp("gemma3"), "gemma3")


@pytest.fixture(scope="module")
def gemma2_dir(demo, tmp_path_factory):
    return over_demo_tokenizer(demo, tmp_path_factory.mktemp("gemma2"), "gemma2")


def test_gemma_2_generation_with_an_adapter_matches_hf_peft(gemma2_dir, tmp_path):
    """Gemma 2's soft-capped attention and logits, its window on every second layer, through the engine."""
    adapters = {"g2": write_peft_adapter(gemma2_dir, tmp_path / "g2", 60, r=8, lora_alpha=16,
                                         target_modules=["q_proj", "k_proj", "o_proj", "up_proj", "down_proj"])}
    generate_against_peft(gemma2_dir, adapters, PROMPTS, [None, "g2", "g2"], STEPS)


@pytest.fixture(scope="module")
def gemma3_adapters(gemma3_dir, tmp_path_factory):
    """Two PEFT adapters: every projection at rank 8; attention and embed_tokens at rank 4."""
    root = tmp_path_factory.mktemp("gemma3-adapters")
    configs = {"all-r8": dict(r=8, lora_alpha=16, target_modules=EVERY_PROJECTION),
               "embed-r4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "embed_tokens"])}
    return write_peft_adapters(gemma3_dir, root, 40, configs)


@pytest.mark.parametrize("tp,fully_sharded", [(1, False), (2, True)])
def test_generation_with_adapters_matches_hf_peft(gemma3_dir, gemma3_adapters, tp, fully_sharded):
    names = [None, "all-r8", "embed-r4", "all-r8", None, "embed-r4"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    outputs = generate_against_peft(gemma3_dir, gemma3_adapters, prompts, names, STEPS, tp, fully_sharded)
    # the sliding layer's window (6) is crossed in a prefill
    assert max(len(out.prompt_token_ids) for out in outputs) > 6
    # the adapters move the output (this tiny tied model repeats a prompt's last token, so its logprobs):
    # requests 0 and 3 share a prompt (base, all-r8), as do 1 and 4 (all-r8, base) and 2 and 5 (embed-r4 twice)
    for base, adapted in ((0, 3), (4, 1)):
        a, b = outputs[base].outputs[0], outputs[adapted].outputs[0]
        assert a.token_ids != b.token_ids or max(abs(x[t] - y[t]) for x, y, t in zip(a.logprobs, b.logprobs,
                                                                                  a.token_ids)) > 1e-2


def test_a_multimodal_config_is_served_as_its_text_model():
    """Gemma 3 4B's config.json writes only its text_config's changes from Gemma3TextConfig's defaults."""
    cfg = ModelConfig.from_dict({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
                                 "torch_dtype": "bfloat16", "vision_config": {"hidden_size": 1152},
                                 "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
                                                 "num_hidden_layers": 34, "sliding_window": 1024,
                                                 "rope_scaling": {"factor": 8.0, "rope_type": "linear"}}})
    assert (cfg.architecture, cfg.model_type, cfg.vocab_size, cfg.num_attention_heads, cfg.head_dim) == \
        ("Gemma3ForConditionalGeneration", "gemma3", 262_208, 8, 256)
    assert cfg.layer_sliding_windows[:6] == (1024,) * 5 + (None,) and cfg.max_position_embeddings == 131_072
    assert cfg.layer_rope(5)[1].factor == 8.0 and cfg.tie_word_embeddings


@pytest.fixture(scope="module")
def gemma3_multimodal_dir(demo, tmp_path_factory):
    """A tiny Gemma3ForConditionalGeneration (a Siglip vision tower beside the "gemma3" text model) saved by
    transformers, over the demo tokenizer."""
    import json
    import shutil

    import torch
    import transformers

    from tests.replicas.conftest import CHECKPOINTS, TINY, randomize

    path = tmp_path_factory.mktemp("gemma3-mm")
    demo_config = json.loads((demo.model_dir / "config.json").read_text())
    vocab = demo_config["vocab_size"]
    # without the logits' soft cap, as Gemma 3's own configs: transformers' multimodal class does not apply one
    text = {**TINY, **CHECKPOINTS["gemma3"][1], "vocab_size": vocab, "final_logit_softcapping": None}
    config = transformers.Gemma3Config(
        text_config=text, vision_config=dict(hidden_size=32, intermediate_size=40, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14),
        mm_tokens_per_image=4, image_token_index=vocab - 1, boi_token_index=vocab - 3, eoi_token_index=vocab - 2)
    torch.manual_seed(5)
    model = transformers.Gemma3ForConditionalGeneration(config)
    randomize(model, 5)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo.model_dir / name, path / name)
    return path


def test_a_multimodal_checkpoint_and_its_adapter_match_hf_peft(gemma3_multimodal_dir, tmp_path):
    """The text model of a Gemma3ForConditionalGeneration checkpoint, base and with an adapter whose
    target_modules matched the vision tower's q_proj / v_proj too (those LoRAs are left out: they act on
    images only), against transformers + PEFT's multimodal model on text prompts."""
    adapters = {"mm": write_peft_adapter(gemma3_multimodal_dir, tmp_path / "mm", 50, r=8, lora_alpha=16,
                                         target_modules=["q_proj", "v_proj", "down_proj"])}
    from safetensors import safe_open

    with safe_open(adapters["mm"] / "adapter_model.safetensors", "pt") as f:
        assert any("vision_tower" in key for key in f.keys())  # PEFT put LoRAs on the vision tower too
    names = [None, "mm", "mm"]
    generate_against_peft(gemma3_multimodal_dir, adapters, PROMPTS, names, STEPS)
