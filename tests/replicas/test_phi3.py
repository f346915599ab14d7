"""Phi-3 (HF's Phi3ForCausalLM): fused qkv_proj / gate_up_proj checkpoint tensors, a sliding window, and the config
fields we refuse.

The model's logits are compared with transformers in test_model_vs_hf.py (the "phi3" checkpoint, window 8); here
the engine generates greedily from text at TP = 1 and 2 against transformers, each rank's shard of the fused
tensors is checked row by row, the window is shown to matter, and the refusals name their field.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from replicas.llm import LLM
from replicas.loader import CheckpointError, iterate_weights
from replicas.model_config import ModelConfig, ModelConfigError
from replicas.models import Phi3ForCausalLM, load_model
from replicas.parallel import ParallelContext
from replicas.sampling_params import SamplingParams
from tests.replicas.conftest import (build_model, generate_against_peft, over_demo_tokenizer, peft_greedy_reference,
                                     run_steps, write_peft_adapters)

STEPS = 8
WINDOW = 8  # CHECKPOINTS["phi3"]'s sliding_window
PROMPTS = ["The quick brown fox", "Once upon a time in a city far away, there lived", "SELECT"]


@pytest.fixture(scope="module")
def phi3_dir(demo, tmp_path_factory):
    """The "phi3" checkpoint over the demo tokenizer's vocabulary, with that tokenizer."""
    return over_demo_tokenizer(demo, tmp_path_factory.mktemp("phi3"))


@pytest.fixture(scope="module")
def hf_greedy(phi3_dir):
    return peft_greedy_reference(phi3_dir, {}, PROMPTS, [None] * len(PROMPTS), STEPS)


@pytest.mark.parametrize("tp", [1, 2])
def test_greedy_generation_matches_hf(phi3_dir, hf_greedy, tp):
    # NCCL over two GPUs where there are two, else gloo over CPU processes
    device = "cuda" if torch.cuda.device_count() >= tp else "cpu"
    llm = LLM(str(phi3_dir), tensor_parallel_size=tp, dtype="float32", device=device)
    try:
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=STEPS, logprobs=1,
                                                       ignore_eos=True))
    finally:
        llm.shutdown()
    # a prompt crosses the window in its prefill, every one in decode
    assert max(len(out.prompt_token_ids) for out in outputs) > WINDOW
    for out, (tokens, logprobs), prompt in zip(outputs, hf_greedy, PROMPTS, strict=True):
        got = out.outputs[0]
        assert out.error is None and got.token_ids == tokens, f"{prompt!r}: {got.token_ids} != {tokens}"
        # float32 on CPU; on a GPU the Triton kernels' float32 dots run in TF32
        error = max(abs(step[t] - lp) for step, t, lp in zip(got.logprobs, tokens, logprobs, strict=True))
        assert error < (2e-2 if device == "cuda" else 2e-3), prompt


def test_the_window_is_what_transformers_computes(tiny_checkpoint):
    """Without the window our logits equal HF's up to position WINDOW - 1 (which sees WINDOW keys) and differ
    from there on: the window test_model_vs_hf.py matches is one that changes the output."""
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint("phi3")
    config = ModelConfig.from_pretrained(path, dtype="float32")
    assert config.sliding_window == WINDOW
    unwindowed = load_model(path, dataclasses.replace(config, sliding_window=None))
    ids = torch.arange(2 * WINDOW) * 5 % config.vocab_size
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        want = hf(ids[None]).logits[0]
    got = run_steps(unwindowed, [[("s", len(ids))]], {"s": ids.tolist()})["s"]
    torch.testing.assert_close(got[:WINDOW], want[:WINDOW], atol=1e-4, rtol=0)
    assert all((got[i] - want[i]).abs().max() > 1e-3 for i in range(WINDOW, len(ids)))


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_loads_its_heads_of_the_fused_tensors(tiny_checkpoint, rank):
    """TP = 2: rank r holds q heads 2r, 2r + 1, kv head r and half r of gate and of up, cut from the fused rows."""
    path = tiny_checkpoint("phi3")
    model = build_model(path, ParallelContext(rank, 2))
    assert isinstance(model, Phi3ForCausalLM)
    weights = dict(iterate_weights(path))
    cfg, hd = model.config, model.config.head_dim
    q, kv, inter = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd, cfg.intermediate_size
    for i, layer in enumerate(model.model.layers):
        qkv = weights[f"model.layers.{i}.self_attn.qkv_proj.weight"]
        q_rows, kv_rows = q // 2, kv // 2
        want = torch.cat([qkv[rank * q_rows : (rank + 1) * q_rows],
                          qkv[q + rank * kv_rows : q + (rank + 1) * kv_rows],
                          qkv[q + kv + rank * kv_rows : q + kv + (rank + 1) * kv_rows]])
        torch.testing.assert_close(layer.self_attn.qkv_proj.weight, want, atol=0, rtol=0)
        gate_up, half = weights[f"model.layers.{i}.mlp.gate_up_proj.weight"], inter // 2
        want = torch.cat([gate_up[rank * half : (rank + 1) * half],
                          gate_up[inter + rank * half : inter + (rank + 1) * half]])
        torch.testing.assert_close(layer.mlp.gate_up_proj.weight, want, atol=0, rtol=0)


def test_a_fused_tensor_of_the_wrong_size_is_a_checkpoint_error(tiny_checkpoint):
    model = build_model(tiny_checkpoint("phi3"))
    weights = dict(iterate_weights(tiny_checkpoint("phi3")))
    name = "model.layers.1.self_attn.qkv_proj.weight"
    weights[name] = weights[name][:-16]  # one kv head short
    with pytest.raises(CheckpointError, match=r"layers\.1\.self_attn\.qkv_proj\.weight: 112 rows, expected 64 \+ "
                                              r"32 \+ 32"):
        model.load_weights(weights.items())


# ---- config ---------------------------------------------------------------------------------

# Phi-3-mini-4k-instruct's config.json, smaller
PHI3 = dict(architectures=["Phi3ForCausalLM"], model_type="phi3", vocab_size=32, hidden_size=16,
            intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
            hidden_act="silu", sliding_window=2047, attention_bias=False, rope_scaling=None, rope_theta=10000.0,
            tie_word_embeddings=False, max_position_embeddings=4096, original_max_position_embeddings=4096)
LONGROPE = dict(short_factor=[1.0] * 4, long_factor=[2.0] * 4, original_max_position_embeddings=4096)


def test_parses_phi3_4k():
    cfg = ModelConfig.from_dict(PHI3)
    assert (cfg.architecture, cfg.model_type, cfg.sliding_window, cfg.rope_scaling.rope_type, cfg.head_dim) == \
        ("Phi3ForCausalLM", "phi3", 2047, "default", 8)
    assert (cfg.qkv_bias, cfg.o_proj_bias, cfg.mlp_bias, cfg.tie_word_embeddings) == (False,) * 4
    # transformers v5 writes a partial_rotary_factor of 1 into rope_parameters; Phi-4-mini ties its embeddings
    v5 = ModelConfig.from_dict({**PHI3, "rope_parameters": {"rope_type": "default", "rope_theta": 250000.0,
                                                            "partial_rotary_factor": 1.0},
                                "sliding_window": None, "tie_word_embeddings": True})
    assert (v5.rope_theta, v5.sliding_window, v5.tie_word_embeddings) == (250000.0, None, True)
    # HF's Phi3 has no projection biases, whatever attention_bias says
    assert not ModelConfig.from_dict({**PHI3, "attention_bias": True}).qkv_bias


@pytest.mark.parametrize("change,match", [
    ({"partial_rotary_factor": 0.375}, "0.375 must turn an even number of a head's 8 dimensions, got 3"),
    ({"architectures": ["LlamaForCausalLM"], "partial_rotary_factor": 0.5}, "not supported for llama"),
    ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 1.5}}, "partial_rotary_factor 1.5 must"),
    ({"partial_rotary_factor": "most"}, "malformed partial_rotary_factor"),
    ({"rope_scaling": {"type": "dynamic", "factor": 4.0}}, "rope_scaling type 'dynamic' is not supported"),
    ({"rope_scaling": {"type": "longrope", **LONGROPE, "short_factor": [1.0] * 3}}, "short_factor has 3 factors"),
    ({"rope_scaling": {"type": "longrope", "long_factor": [2.0] * 4}}, "lacks 'short_factor'"),
    ({"rope_scaling": {"type": "longrope", **LONGROPE, "long_factor": [1.0] * 5}}, "long_factor has 5 factors"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [2.0] * 4}}, "lacks 'long_factor'"),
], ids=["odd-dims", "llama", "above-1", "malformed", "dynamic", "short-factors", "no-short-factor", "long-factors",
        "no-long-factor"])
def test_refused_phi3_configs_name_the_field(change, match):
    with pytest.raises(ModelConfigError, match=match):
        ModelConfig.from_dict({**PHI3, **change})


def test_partial_rotary_is_parsed_for_phi3():
    v4 = ModelConfig.from_dict({**PHI3, "partial_rotary_factor": 0.75, "head_dim": 16})  # Phi-4-mini: 96 of 128
    v5 = ModelConfig.from_dict({**PHI3, "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}})
    assert (v4.rotary_dim, v5.rotary_dim, ModelConfig.from_dict(PHI3).rotary_dim) == (12, 4, None)


FUSED_TARGETS = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]  # Phi-3's module names, as PEFT targets them


@pytest.fixture(scope="module")
def phi3_adapters(phi3_dir, tmp_path_factory):
    """Two PEFT adapters on the fused modules (ranks 8 and 4, a rank pattern on qkv_proj), written by peft."""
    root = tmp_path_factory.mktemp("phi3-adapters")
    configs = {"fused-r8": dict(r=8, lora_alpha=16), "fused-r4": dict(r=4, lora_alpha=4, rank_pattern={"qkv_proj": 2})}
    return write_peft_adapters(phi3_dir, root, 20, configs, target_modules=FUSED_TARGETS)


@pytest.mark.parametrize("tp,fully_sharded", [(1, False), (2, True)])
def test_fused_module_adapters_match_hf_peft(phi3_dir, phi3_adapters, tp, fully_sharded):
    """Adapters on qkv_proj and gate_up_proj, cut into q/k/v and gate/up slices by the loader, give
    transformers + PEFT's greedy tokens and logprobs, mixed with the base model in one batch."""
    names = [None, "fused-r4", "fused-r8", "fused-r4", None, "fused-r8"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    outputs = generate_against_peft(phi3_dir, phi3_adapters, prompts, names, STEPS, tp, fully_sharded)
    # the adapters move the output: requests 0 and 3 share a prompt (base, fused-r4), as do 2 and 5 (r8, r8)
    assert outputs[0].outputs[0].token_ids != outputs[3].outputs[0].token_ids
