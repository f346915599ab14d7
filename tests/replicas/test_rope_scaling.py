"""Each rope scaling type's frequencies and attention factor against transformers' own (its
ROPE_INIT_FUNCTIONS), and the context each is served with. The models' outputs with them are checked
against transformers in test_model_vs_hf.py (llama3_tied, llama_mqa_bias, qwen2_yarn) and test_phi3.py."""

from __future__ import annotations

import pytest
import torch

from replicas.layers.rotary import rope_inv_freq
from replicas.model_config import ModelConfig, ModelConfigError

BASE = dict(vocab_size=32, hidden_size=128, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1)
CASES = {
    "yarn": ("Qwen2", dict(rope_theta=1e6, max_position_embeddings=32768,
                           rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                         "original_max_position_embeddings": 32768})),
    "yarn-betas": ("Qwen2", dict(rope_theta=1e4, max_position_embeddings=4096,
                                 rope_scaling={"rope_type": "yarn", "factor": 8.0, "beta_fast": 16, "beta_slow": 2,
                                               "original_max_position_embeddings": 512, "truncate": False})),
    "yarn-mscale": ("Qwen2", dict(rope_theta=1e4, max_position_embeddings=8192,
                                  rope_scaling={"rope_type": "yarn", "factor": 16.0, "mscale": 0.707,
                                                "mscale_all_dim": 1.0, "original_max_position_embeddings": 512})),
    "yarn-given-attention": ("Qwen3", dict(rope_theta=1e6, max_position_embeddings=40960, head_dim=128,
                                           rope_scaling={"rope_type": "yarn", "factor": 4.0, "attention_factor": 1.5,
                                                         "original_max_position_embeddings": 32768})),
    "yarn-no-original": ("Qwen2", dict(rope_theta=1e4, max_position_embeddings=2048,
                                       rope_scaling={"rope_type": "yarn", "factor": 2.0})),
    "llama3": ("Llama", dict(rope_theta=5e5, max_position_embeddings=131072,
                             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})),
    "linear": ("Llama", dict(rope_theta=1e4, rope_scaling={"rope_type": "linear", "factor": 2.0})),
}


def _hf(kind: str, fields: dict):
    import transformers

    return getattr(transformers, f"{kind}Config")(**{**BASE, **fields})


def _ours(kind: str, fields: dict) -> ModelConfig:
    return ModelConfig.from_dict({**BASE, **fields, "architectures": [f"{kind}ForCausalLM"]}, device="cpu")


@pytest.mark.parametrize("name", sorted(CASES))
def test_frequencies_and_attention_factor_are_transformers(name):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kind, fields = CASES[name]
    hf_config, ours = _hf(kind, fields), _ours(kind, fields)
    want, want_factor = ROPE_INIT_FUNCTIONS[ours.rope_scaling.rope_type](hf_config, "cpu")
    got = rope_inv_freq(ours.head_dim, ours.rope_theta, ours.rope_scaling)
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)
    assert ours.rope_scaling.attention_factor == pytest.approx(want_factor, rel=1e-12)
    if name.startswith("yarn"):  # not a case where the scaling changes nothing
        plain = rope_inv_freq(ours.head_dim, ours.rope_theta)
        assert (got < plain).any() and (got == plain).any() and ours.rope_scaling.attention_factor != 1


@pytest.mark.parametrize("name,context", [("yarn", 131072), ("yarn-given-attention", 131072),
                                          ("yarn-betas", 4096), ("yarn-no-original", 4096), ("llama3", 131072)])
def test_the_context_served(name, context):
    """YaRN stretches the original context by its factor (vLLM's max_model_len for Qwen2.5 with factor 4:
    131,072), never below max_position_embeddings."""
    assert _ours(*CASES[name]).max_position_embeddings == context


def test_a_yarn_factor_from_the_contexts():
    """No factor: transformers takes max_position_embeddings over the original context."""
    cfg = _ours("Qwen2", dict(max_position_embeddings=8192, rope_scaling={"rope_type": "yarn", "factor": None,
                                                                          "original_max_position_embeddings": 2048}))
    assert (cfg.rope_scaling.factor, cfg.max_position_embeddings) == (4.0, 8192)


def test_a_yarn_config_without_a_usable_factor_is_refused():
    with pytest.raises(ModelConfigError, match="rope_scaling|factor > 0"):
        _ours("Qwen2", dict(rope_scaling={"rope_type": "yarn", "factor": -2.0}))
