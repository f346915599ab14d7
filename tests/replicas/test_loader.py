"""Reading a model directory: config.json / generation_config.json parsing and the safetensors loader."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from replicas.loader import CheckpointError, checkpoint_files, iterate_weights
from replicas.model_config import ModelConfig, ModelConfigError
from tests.replicas.conftest import build_model

# ---- weights --------------------------------------------------------------------------------


def test_sharded_checkpoint_yields_the_same_tensors(sharded_checkpoint, tiny_checkpoint):
    assert (sharded_checkpoint / "model.safetensors.index.json").is_file()
    files = checkpoint_files(sharded_checkpoint)
    assert len(files) > 1
    sharded = dict(iterate_weights(sharded_checkpoint))
    single = dict(iterate_weights(tiny_checkpoint("llama3_tied")))  # same seed, same weights
    assert sharded.keys() == single.keys()
    for name, tensor in single.items():
        assert torch.equal(sharded[name], tensor), name


def test_model_loads_from_a_sharded_checkpoint(sharded_checkpoint, tiny_checkpoint):
    a, b = build_model(sharded_checkpoint), build_model(tiny_checkpoint("llama3_tied"))
    expected = b.state_dict()
    for name, param in a.state_dict().items():
        assert torch.equal(param, expected[name]), name


def test_dummy_weights_are_random_and_the_same_every_run(tiny_checkpoint):
    from replicas.models import dummy_model
    from replicas.parallel import ParallelContext

    config = ModelConfig.from_pretrained(tiny_checkpoint("llama3_tied"))
    a, b = (dummy_model(config, ParallelContext(), torch.device("cpu")) for _ in range(2))
    for (name, param), other in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(param, other), name
        if name.endswith("norm.weight"):
            assert torch.equal(param, torch.ones_like(param)), name
        elif param.numel() > 1000:
            assert 0.015 < param.std().item() < 0.025 and abs(param.mean().item()) < 0.005, name


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_shard_named_by_the_index(sharded_checkpoint, tmp_path):
    path = _copy(sharded_checkpoint, tmp_path / "ckpt")
    victim = checkpoint_files(path)[-1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=victim.name):
        checkpoint_files(path)


def test_corrupt_file_is_a_checkpoint_error(tiny_checkpoint, tmp_path):
    path = _copy(tiny_checkpoint("qwen2"), tmp_path / "ckpt")
    (path / "model.safetensors").write_bytes(b"\x07\x00\x00\x00\x00\x00\x00\x00not json")
    with pytest.raises(CheckpointError, match="model.safetensors"):
        list(iterate_weights(path))


def test_truncated_file_is_a_checkpoint_error(tiny_checkpoint, tmp_path):
    path = _copy(tiny_checkpoint("qwen2"), tmp_path / "ckpt")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError):
        list(iterate_weights(path))


def test_no_weights_or_only_pickles(tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        checkpoint_files(tmp_path / "absent")
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        checkpoint_files(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(CheckpointError, match="pytorch_model.bin"):
        checkpoint_files(tmp_path)


def test_weights_that_do_not_fit_the_model(tiny_checkpoint):
    model = build_model(tiny_checkpoint("qwen2"))
    weights = dict(iterate_weights(tiny_checkpoint("qwen2")))
    with pytest.raises(CheckpointError, match="o_proj"):
        model.load_weights({**weights, "model.layers.0.self_attn.o_proj.weight": torch.zeros(64, 32)}.items())
    with pytest.raises(CheckpointError, match="no place"):
        model.load_weights({**weights, "model.layers.9.mlp.up_proj.weight": torch.zeros(96, 64)}.items())
    with pytest.raises(CheckpointError, match="qkv_proj.bias"):
        model.load_weights((k, v) for k, v in weights.items() if k != "model.layers.1.self_attn.k_proj.bias")


# ---- config ---------------------------------------------------------------------------------


def test_parses_llama3_rope_tied_and_eos_list(tiny_checkpoint, tmp_path):
    path = _copy(tiny_checkpoint("llama3_tied"), tmp_path / "ckpt")
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 7],
                                                             "temperature": 0.6}))
    cfg = ModelConfig.from_pretrained(path, device="cpu")
    assert (cfg.architecture, cfg.num_key_value_heads, cfg.head_dim, cfg.tie_word_embeddings) == \
        ("LlamaForCausalLM", 2, 16, True)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling.rope_type == "llama3"
    assert (cfg.rope_scaling.factor, cfg.rope_scaling.original_max_position_embeddings) == (8.0, 32)
    assert cfg.eos_token_ids == (2, 7) and cfg.generation_config["temperature"] == 0.6
    assert cfg.dtype == torch.float32  # auto on CPU


def test_v4_style_rope_fields_and_biases():
    base = dict(architectures=["LlamaForCausalLM"], vocab_size=10, hidden_size=8, intermediate_size=16,
                num_hidden_layers=1, num_attention_heads=2, rope_theta=1e4, attention_bias=True,
                rope_scaling={"type": "linear", "factor": 4.0}, eos_token_id=3)
    cfg = ModelConfig.from_dict(base, dtype="bfloat16")
    assert (cfg.num_key_value_heads, cfg.head_dim, cfg.rope_scaling.rope_type, cfg.rope_scaling.factor) == \
        (2, 4, "linear", 4.0)
    assert (cfg.qkv_bias, cfg.o_proj_bias, cfg.mlp_bias, cfg.eos_token_ids, cfg.dtype) == \
        (True, True, False, (3,), torch.bfloat16)
    qwen = ModelConfig.from_dict({**base, "architectures": ["Qwen2ForCausalLM"], "rope_scaling": None})
    assert (qwen.qkv_bias, qwen.o_proj_bias, qwen.rope_scaling.rope_type, qwen.qk_norm) == (True, False, "default",
                                                                                           False)
    qwen3 = ModelConfig.from_dict({**base, "architectures": ["Qwen3ForCausalLM"], "attention_bias": False})
    assert (qwen3.model_type, qwen3.qk_norm, qwen3.qkv_bias, qwen3.o_proj_bias) == ("qwen3", True, False, False)
    with pytest.raises(ModelConfigError, match="Qwen3 per-layer sliding window"):
        ModelConfig.from_dict({**base, "architectures": ["Qwen3ForCausalLM"], "use_sliding_window": True})


@pytest.mark.parametrize("change,match", [
    ({"architectures": ["GPT2LMHeadModel"]}, "not supported"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 0.0}}, "factor > 0"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
    ({"hidden_size": None}, "malformed"),
    ({"num_key_value_heads": 3}, "key/value heads"),
])
def test_bad_configs(change, match):
    raw = dict(architectures=["LlamaForCausalLM"], vocab_size=10, hidden_size=8, intermediate_size=16,
               num_hidden_layers=1, num_attention_heads=2)
    with pytest.raises(ModelConfigError, match=match):
        ModelConfig.from_dict({**raw, **change})


def test_bad_dtype_tp_and_missing_dir(tmp_path):
    raw = dict(architectures=["MistralForCausalLM"], vocab_size=10, hidden_size=8, intermediate_size=16,
               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    with pytest.raises(ModelConfigError, match="int8"):
        ModelConfig.from_dict(raw, dtype="int8")
    assert ModelConfig.from_dict(raw, dtype="auto", device="cuda").dtype == torch.bfloat16
    with pytest.raises(ModelConfigError, match="tensor_parallel_size 4"):
        ModelConfig.from_dict(raw).check_tp(4)
    ModelConfig.from_dict(raw).check_tp(2)  # one kv head replicated on two ranks is fine
    with pytest.raises(ModelConfigError, match="config.json"):
        ModelConfig.from_pretrained(tmp_path)
