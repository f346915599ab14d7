"""Granite (GraniteForCausalLM): its multipliers from config.json, and the engine against transformers + PEFT.

The model's logits are compared with transformers in test_model_vs_hf.py (the "granite" checkpoint, none of
its four multipliers 1); here the config's fields and refusals, then the engine generating greedily from
text, base and LoRA adapters (one on embed_tokens, which the embedding multiplier multiplies too) in one
batch, at TP = 1 and 2.
"""

from __future__ import annotations

import pytest

from replicas.model_config import ModelConfig, ModelConfigError
from tests.replicas.conftest import EVERY_PROJECTION, generate_against_peft, over_demo_tokenizer, write_peft_adapters

STEPS = 8
PROMPTS = ["The quick brown fox", "Once upon a time in a city far away, there lived", "SELECT"]
# ibm-granite/granite-3.1-2b-instruct's config.json, smaller
GRANITE = dict(architectures=["GraniteForCausalLM"], model_type="granite", vocab_size=64, hidden_size=32,
               intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               hidden_act="silu", embedding_multiplier=12.0, attention_multiplier=0.015625, residual_multiplier=0.22,
               logits_scaling=8.0, rope_theta=5000000.0, tie_word_embeddings=True, max_position_embeddings=131072)


def test_parses_granites_multipliers():
    cfg = ModelConfig.from_dict(GRANITE)
    assert (cfg.embed_scale, cfg.attn_scale, cfg.residual_multiplier, cfg.logits_scaling) == (12.0, 0.015625,
                                                                                              0.22, 8.0)
    plain = ModelConfig.from_dict({k: v for k, v in GRANITE.items() if not k.endswith(("multiplier", "scaling"))})
    assert (plain.embed_scale, plain.attn_scale, plain.residual_multiplier, plain.logits_scaling) == (1.0,) * 4


@pytest.mark.parametrize("change", [{"logits_scaling": 0}, {"residual_multiplier": "big"},
                                    {"embedding_multiplier": -1.0}])
def test_a_multiplier_that_is_not_a_positive_number_is_refused(change):
    with pytest.raises(ModelConfigError, match=f"{next(iter(change))} must be positive"):
        ModelConfig.from_dict({**GRANITE, **change})


@pytest.fixture(scope="module")
def granite_dir(demo, tmp_path_factory):
    return over_demo_tokenizer(demo, tmp_path_factory.mktemp("granite"), "granite")


@pytest.fixture(scope="module")
def granite_adapters(granite_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("granite-adapters")
    configs = {"all-r8": dict(r=8, lora_alpha=16, target_modules=EVERY_PROJECTION),
               "embed-r4": dict(r=4, lora_alpha=8, target_modules=["o_proj", "embed_tokens"])}
    return write_peft_adapters(granite_dir, root, 70, configs)


@pytest.mark.parametrize("tp,fully_sharded", [(1, False), (2, True)])
def test_generation_with_adapters_matches_hf_peft(granite_dir, granite_adapters, tp, fully_sharded):
    names = [None, "all-r8", "embed-r4", "all-r8", None, "embed-r4"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    outputs = generate_against_peft(granite_dir, granite_adapters, prompts, names, STEPS, tp, fully_sharded)
    a, b = outputs[0].outputs[0], outputs[3].outputs[0]  # one prompt, base and all-r8
    assert a.token_ids != b.token_ids or max(abs(x[t] - y[t]) for x, y, t in zip(a.logprobs, b.logprobs,
                                                                              a.token_ids)) > 1e-2
