"""A Qwen3 checkpoint (per-head q/k RMSNorm, head_dim apart from hidden / heads, tied embeddings) with PEFT
adapters on every projection: the engine's greedy tokens and logprobs against transformers + PEFT.

The model layers alone are compared with transformers in test_model_vs_hf.py (the "qwen3" checkpoint);
here the LoRA path runs too: q, k and v take their adapters' deltas before the head norms read them.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from lora_core.request import LoRARequest
from replicas.llm import LLM
from replicas.sampling_params import SamplingParams
from tests.replicas.conftest import TINY, peft_greedy_reference, randomize, write_peft_adapter

STEPS = 8
PROMPTS = ["The quick brown fox", "SELECT", "Once upon a time in a city far away,"]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def qwen3(demo, tmp_path_factory):
    """(model dir with the demo's tokenizer, {name: adapter dir}) written by transformers and peft."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    root = tmp_path_factory.mktemp("qwen3")
    model_dir = root / "model"
    demo_config = json.loads((demo.model_dir / "config.json").read_text())
    config = Qwen3Config(**{**TINY, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
                            "tie_word_embeddings": True, "vocab_size": demo_config["vocab_size"],
                            "bos_token_id": demo_config["bos_token_id"], "eos_token_id": demo_config["eos_token_id"]})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(model, seed=3)
    model.save_pretrained(model_dir, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo.model_dir / name, model_dir / name)
    adapters = {name: write_peft_adapter(model_dir, root / name, 10 + i, r=rank, lora_alpha=2 * rank,
                                         target_modules=TARGETS)
                for i, (name, rank) in enumerate((("q-r8", 8), ("q-r4", 4)))}
    return model_dir, adapters


def test_qwen3_with_adapters_matches_hf_peft(qwen3):
    model_dir, adapters = qwen3
    names = [None, "q-r4", "q-r4", "q-r8", None, "q-r8"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    requests = {name: LoRARequest(name, i + 1, str(adapters[name])) for i, name in enumerate(sorted(adapters))}
    llm = LLM(str(model_dir), enable_lora=True, max_loras=2, max_lora_rank=8, dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, logprobs=1, ignore_eos=True)
    outputs = llm.generate(prompts, params, [requests[n] if n else None for n in names])
    want = peft_greedy_reference(model_dir, adapters, prompts, names, STEPS)
    for out, (tokens, logprobs), name in zip(outputs, want, names, strict=True):
        got = out.outputs[0]
        assert out.error is None and got.token_ids == tokens, f"{name}: {got.token_ids} != {tokens}"
        # float32 on CPU; on a GPU the Triton kernels' float32 dots run in TF32
        error = max(abs(step[t] - lp) for step, t, lp in zip(got.logprobs, tokens, logprobs, strict=True))
        assert error < (2e-2 if torch.cuda.is_available() else 2e-3), name
    # the adapters move the output: requests 0 and 3 share a prompt (base, q-r8), as do 1 and 4 (q-r4, base)
    assert outputs[0].outputs[0].token_ids != outputs[3].outputs[0].token_ids
    assert outputs[1].outputs[0].token_ids != outputs[4].outputs[0].token_ids
