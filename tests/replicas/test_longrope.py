"""longrope (Phi-3-mini-128k, Phi-3.5-mini, Phi-4-mini) over the whole context, against transformers.

transformers picks short_factor or long_factor for a whole forward pass by the sequence's length so far: a
prompt that fits the original context is turned with the short factors and every token past it with the long
ones; a longer prompt is turned with the long factors at every position. The engine does the same per token
(replicas/layers/rotary.py), through chunked prefill, mixed batches, prefix caching and TP = 2; the
reference here is transformers generating with its KV cache, one request at a time.
"""

from __future__ import annotations

import math

import pytest
import torch

from replicas.layers import RotaryEmbedding
from replicas.llm import LLM
from replicas.model_config import ModelConfig
from replicas.rope_config import LONG_ROPE
from replicas.sampling_params import SamplingParams
from tests.replicas.conftest import peft_greedy_reference, over_demo_tokenizer, write_peft_adapter

ORIGINAL = 32  # the tiny checkpoints' original context, of 128
SHORT = [1.0, 1.5, 2.0, 1.2, 1.1, 3.0, 1.0, 2.5]
LONG = [9.0, 7.0, 5.0, 4.0, 3.0, 2.0, 1.5, 1.0]
PHI3_5 = dict(architectures=["Phi3ForCausalLM"], vocab_size=32, hidden_size=16, intermediate_size=32,
              num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=131072,
              original_max_position_embeddings=4096)
FACTORS = dict(short_factor=[1.0] * 4, long_factor=[2.0] * 4, original_max_position_embeddings=4096)


@pytest.mark.parametrize("layout", [
    {"rope_scaling": {"type": "longrope", **FACTORS}},  # Phi-3.5-mini's config.json
    {"rope_scaling": {"type": "su", **FACTORS}},  # Phi-3-mini-128k's older name
    {"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, **FACTORS}},  # transformers v5
], ids=["longrope", "su", "v5"])
def test_longrope_is_parsed_and_served_over_the_whole_context(layout):
    cfg = ModelConfig.from_dict({**PHI3_5, **layout})
    s = cfg.rope_scaling
    assert (s.rope_type, s.short_factor, s.long_factor) == ("longrope", (1.0,) * 4, (2.0,) * 4)
    assert (cfg.max_position_embeddings, cfg.long_rope_from) == (131072, 4096)
    assert s.attention_factor == pytest.approx(math.sqrt(1 + math.log(131072 / 4096) / math.log(4096)))
    given = ModelConfig.from_dict({**PHI3_5, "rope_scaling": {"type": "longrope", **FACTORS, "attention_factor": 1.1}})
    assert given.rope_scaling.attention_factor == 1.1
    assert ModelConfig.from_dict({**PHI3_5, "rope_scaling": None}).long_rope_from is None


def test_a_position_takes_the_long_factors_past_the_original_context_or_encoded():
    cfg = ModelConfig.from_dict({**PHI3_5, "hidden_size": 32, "rope_scaling": {"type": "longrope", **dict(
        FACTORS, short_factor=SHORT, long_factor=LONG)}})
    rope = RotaryEmbedding(16, 10000.0, cfg.rope_scaling)
    positions = torch.tensor([5, 4095, 4096, 9000, 5 + LONG_ROPE])
    cos, sin = rope.cos_sin(positions, torch.float32)

    def expected(position: int, factors: list[float]) -> torch.Tensor:  # transformers' longrope frequencies
        inv_freq = 1.0 / (torch.tensor(factors) * 10000.0 ** (torch.arange(0, 16, 2).float() / 16))
        return torch.cat([position * inv_freq] * 2)

    for row, (position, factors) in enumerate([(5, SHORT), (4095, SHORT), (4096, LONG), (9000, LONG), (5, LONG)]):
        torch.testing.assert_close(cos[row, 0], expected(position, factors).cos())
        torch.testing.assert_close(sin[row, 0], expected(position, factors).sin())


@pytest.fixture(scope="module")
def longrope_dir(demo, tmp_path_factory):
    """Phi-3.5's recipe, tiny: longrope with uneven factors, an original context of 32 of 128 (so an attention
    factor of sqrt(1 + ln 4 / ln 32)), over the demo tokenizer."""
    return over_demo_tokenizer(
        demo, tmp_path_factory.mktemp("longrope"), max_position_embeddings=128,
        original_max_position_embeddings=ORIGINAL, sliding_window=None,
        rope_scaling={"type": "longrope", "short_factor": SHORT, "long_factor": LONG})


@pytest.fixture(scope="module")
def phi4_mini_like_dir(demo, tmp_path_factory):
    """Phi-4-mini's recipe, tiny: half of each head turned (partial_rotary_factor 0.5 of head_dim 16, the torch
    rotary path), longrope with a factor per turned frequency. (Its embeddings are not tied, as Phi-4-mini's
    are: tied, this tiny model gives its top token a probability of ~1 whatever the rotary does, and the
    comparison would show nothing.)"""
    return over_demo_tokenizer(
        demo, tmp_path_factory.mktemp("phi4-mini"), max_position_embeddings=128,
        original_max_position_embeddings=ORIGINAL, sliding_window=None, partial_rotary_factor=0.5,
        rope_scaling={"type": "longrope", "short_factor": SHORT[:4], "long_factor": LONG[:4]})


def hf_cached_greedy(model_dir, prompts: list[list[int]], steps: int) -> list[tuple[list[int], list[float]]]:
    """transformers' greedy tokens and their logprobs, with its KV cache (a forward pass per new token: the
    passes' lengths decide its longrope factors), one prompt at a time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    results = []
    for prompt in prompts:
        tokens, logprobs = [], []
        with torch.no_grad():
            out = model(torch.tensor([prompt]), use_cache=True)
            for _ in range(steps):
                lp = torch.log_softmax(out.logits[0, -1].float(), -1)
                tokens.append(int(lp.argmax()))
                logprobs.append(float(lp[tokens[-1]]))
                out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
        results.append((tokens, logprobs))
    return results


def _prompts(vocab: int) -> dict[str, list[int]]:
    """Prompt ids by length around the original context (32): one that crosses it while generating, one that
    ends on it, one a token past it, and a long one that starts as the first does (a prefix cache could
    offer it the first one's blocks, turned with the short factors)."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(10, vocab, (80,), generator=g).tolist()
    return {"crosses": ids[:20], "fits": ids[20:52], "one past": ids[:33], "long": ids[:20] + ids[40:80]}


def _assert_matches(outputs, want) -> None:
    for out, (tokens, logprobs) in zip(outputs, want, strict=True):
        got = out.outputs[0]
        assert got.token_ids == tokens
        assert max(abs(step[t] - lp) for step, t, lp in zip(got.logprobs, tokens, logprobs, strict=True)) < 2e-3


STEPS = 24  # "crosses" generates from position 20 to 43
# On a GPU: the Triton rotary kernels (and qkv_proj's fused one with LoRA), decode and piecewise CUDA graphs
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("checkpoint", ["longrope_dir", "phi4_mini_like_dir"])
def test_generation_matches_hf_across_the_original_context(checkpoint, request):
    """All four prompts in one batch, the long one's prefill in chunks of 16 (its first chunk lies wholly
    within the original context); then the long prompt again, after the "crosses" one left its blocks in the
    prefix cache."""
    model_dir = request.getfixturevalue(checkpoint)
    llm = LLM(str(model_dir), dtype="float32", device=DEVICE, max_num_batched_tokens=16, max_num_seqs=4,
              enable_prefix_caching=True)
    prompts = _prompts(llm.engine.model_config.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, logprobs=1, ignore_eos=True)
    try:
        assert llm.engine.max_model_len == 128
        batch = llm.generate([{"prompt_token_ids": p} for p in prompts.values()], params)
        again = llm.generate([{"prompt_token_ids": prompts["crosses"]}], params)
        long_again = llm.generate([{"prompt_token_ids": prompts["long"]}], params)
    finally:
        llm.shutdown()
    want = dict(zip(prompts, hf_cached_greedy(model_dir, list(prompts.values()), STEPS), strict=True))
    _assert_matches(batch, want.values())
    _assert_matches(again + long_again, [want["crosses"], want["long"]])


def test_tp2_matches_hf_across_the_original_context(longrope_dir):
    prompts = _prompts(ModelConfig.from_pretrained(longrope_dir, device="cpu").vocab_size)
    chosen = [prompts["crosses"], prompts["long"]]
    llm = LLM(str(longrope_dir), tensor_parallel_size=2, dtype="float32", device="cpu")
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in chosen],
                               SamplingParams(temperature=0.0, max_tokens=16, logprobs=1, ignore_eos=True))
    finally:
        llm.shutdown()
    _assert_matches(outputs, hf_cached_greedy(longrope_dir, chosen, 16))


TEXT_PROMPTS = ["The quick brown fox", "Once upon a time in a city far away, there lived", "SELECT"]
TEXT_STEPS = 8


def test_an_adapter_on_a_partly_turned_head_matches_hf_peft(phi4_mini_like_dir, tmp_path):
    """A LoRA on the fused qkv_proj of a partly turned head (on CUDA the rotary kernel adds its expand to the
    turned and the passed dimensions; on CPU the expand runs first): transformers + PEFT's tokens, base and
    adapter in one batch, within the original context."""
    from lora_core.request import LoRARequest

    adapters = {"fused": write_peft_adapter(phi4_mini_like_dir, tmp_path / "fused", 30, r=8, lora_alpha=16,
                                            target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])}
    names = [None, "fused", "fused"]
    llm = LLM(str(phi4_mini_like_dir), enable_lora=True, max_loras=1, max_lora_rank=8, dtype="float32",
              device=DEVICE)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=TEXT_STEPS, logprobs=1, ignore_eos=True)
        lora = LoRARequest("fused", 1, str(adapters["fused"]))
        outputs = llm.generate(TEXT_PROMPTS, params, [lora if n else None for n in names])
    finally:
        llm.shutdown()
    want = peft_greedy_reference(phi4_mini_like_dir, adapters, TEXT_PROMPTS, names, TEXT_STEPS)
    for out, (tokens, logprobs), name in zip(outputs, want, names, strict=True):
        got = out.outputs[0]
        assert got.token_ids == tokens, name
        assert max(abs(step[t] - lp) for step, t, lp in zip(got.logprobs, tokens, logprobs, strict=True)) < 2e-3, name
