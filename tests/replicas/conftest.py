"""Tiny random HF checkpoints and a mixed-batch step runner shared by the replicas tests.

Checkpoints are written once per session with transformers' own
save_pretrained, with weights re-drawn larger than HF's init (std 0.02 would
make every logit near zero and every comparison trivially close).
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from replicas.attention import AttentionMetadata, allocate_kv_caches
from replicas.models import LlamaForCausalLM, load_model
from replicas.model_config import ModelConfig
from replicas.parallel import ParallelContext

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, head_dim=16,
            max_position_embeddings=256, rms_norm_eps=1e-5)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}  # wavelengths fall in all three llama3 bands
CHECKPOINTS = {
    "llama3_tied": ("LlamaConfig", dict(num_key_value_heads=2, vocab_size=128, tie_word_embeddings=True,
                                      rope_theta=500000.0, rope_scaling=LLAMA3_ROPE)),
    "llama_mqa_bias": ("LlamaConfig", dict(num_key_value_heads=1, vocab_size=121, attention_bias=True, mlp_bias=True,
                                         rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "mistral_swa": ("MistralConfig", dict(num_key_value_heads=2, vocab_size=128, sliding_window=5)),
    "qwen2": ("Qwen2Config", dict(num_key_value_heads=2, vocab_size=128)),
    # YaRN as Qwen2.5 / Qwen3 ship it for long context; theta 100 and an original context of 64 put the 8
    # frequencies in all three of its regions (kept, blended, divided by factor)
    "qwen2_yarn": ("Qwen2Config", dict(num_key_value_heads=2, vocab_size=128, rope_theta=100.0,
                                       rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                     "original_max_position_embeddings": 64})),
    # head_dim 16 is not hidden / heads (64 / 2 = 32), as in Qwen3-0.6B (128 against 1024 / 16)
    "qwen3": ("Qwen3Config", dict(num_key_value_heads=1, vocab_size=128, num_attention_heads=2,
                                  tie_word_embeddings=True)),
    # sliding layers (window 6, local theta) and full ones (global theta, linear scaling), qk norms, soft-capped
    # logits, a query scalar apart from head_dim, tied embeddings scaled by sqrt(hidden)
    "gemma3": ("Gemma3TextConfig", dict(num_key_value_heads=2, vocab_size=128, sliding_window=6,
                                        layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=12,
                                        final_logit_softcapping=5.0, rope_local_base_freq=100.0,
                                        rope_scaling={"rope_type": "linear", "factor": 2.0})),
    # Granite's four multipliers, none of them 1
    "granite": ("GraniteConfig", dict(num_key_value_heads=2, vocab_size=128, embedding_multiplier=3.0,
                                      attention_multiplier=0.2, residual_multiplier=0.5, logits_scaling=4.0)),
    # both soft caps, every second layer a window of 5, one rope
    "gemma2": ("Gemma2Config", dict(num_key_value_heads=2, vocab_size=128, sliding_window=5,
                                    query_pre_attn_scalar=20, attn_logit_softcapping=1.5,
                                    final_logit_softcapping=4.0)),
    # fused qkv_proj / gate_up_proj tensors; a window of 8 that MIXED_STEPS' longer sequences cross; Phi3Config's
    # default pad id (32000) lies outside a tiny vocabulary
    "phi3": ("Phi3Config", dict(num_key_value_heads=2, vocab_size=128, sliding_window=8, bos_token_id=1,
                                eos_token_id=2, pad_token_id=3)),
}

# One engine-like run: each step lists (sequence, new tokens). Step 2 mixes a second prefill
# chunk (a), a decode (b) and a fresh prefill (c); later steps mix decodes with a long prefill (d).
MIXED_STEPS = [[("a", 5), ("b", 7)],
               [("a", 4), ("b", 1), ("c", 4)],
               [("a", 1), ("b", 1), ("c", 1), ("d", 10)],
               [("a", 1), ("c", 1), ("d", 1)],
               [("d", 1)],
               [("d", 1)]]
BLOCK_SIZE, NUM_BLOCKS = 4, 24


def randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if "norm" in name else (0.5 if "embed" in name else 0.08) * noise)


def write_checkpoint(path: Path, name: str, seed: int = 0, overrides: dict | None = None, **save_kwargs) -> Path:
    """CHECKPOINTS[name] (its config fields updated by ``overrides``) saved by transformers at ``path``."""
    import transformers  # imported here: TP worker processes import this module and need no transformers

    config_cls, fields = CHECKPOINTS[name]
    config = getattr(transformers, config_cls)(**{**TINY, **fields, **(overrides or {})})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(model, seed)
    model.save_pretrained(path, safe_serialization=True, **save_kwargs)
    return path


def over_demo_tokenizer(demo, path: Path, name: str = "phi3", **fields: Any) -> Path:
    """The CHECKPOINTS[name] checkpoint (its config changed by fields) over the demo tokenizer's vocabulary,
    with that tokenizer, at path."""
    demo_config = json.loads((demo.model_dir / "config.json").read_text())
    ids = {key: demo_config[key] for key in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")}
    write_checkpoint(path, name, overrides={**ids, **fields})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo.model_dir / name, path / name)
    return path


def write_peft_adapter(model_dir: Path, out: Path, seed: int, **lora_config: Any) -> Path:
    """A PEFT adapter on the transformers model at model_dir, written by peft to out, its A and B drawn (seeded)
    large enough to move greedy tokens (PEFT's own init leaves B zero)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                          LoraConfig(init_lora_weights=False, **lora_config))
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.copy_(0.3 * torch.randn_like(p))
    peft.save_pretrained(out)
    return out


def peft_greedy_reference(model_dir: Path, adapters: dict[str, Path], prompts: list[str],
                          names: list[str | None], steps: int, patch: Callable | None = None,
                          patch_peft: Callable | None = None) -> list[tuple[list[int], list[float]]]:
    """Greedy (tokens, their logprobs) from transformers + PEFT, one request at a time, every step computed over the
    whole sequence (no KV cache); names[i] None: the base model (adapters may then be empty: no PEFT).
    patch(model): changes the transformers model before PEFT wraps it; patch_peft(model) the PEFT model."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    # eager: transformers' sdpa path has no attention soft cap (Gemma 2), and 5.17 (the GPU machine's) picks
    # it by default: 0.07 off in logprob there, where ours came out the same with Triton's attention or ours
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    if patch is not None:
        patch(model)
    if adapters:
        first, *rest = sorted(adapters)
        model = PeftModel.from_pretrained(model, adapters[first], adapter_name=first)
        for name in rest:
            model.load_adapter(adapters[name], adapter_name=name)
        if patch_peft is not None:
            patch_peft(model)
    results = []
    for prompt, name in zip(prompts, names, strict=True):
        ids = tok(prompt, return_tensors="pt").input_ids
        tokens, logprobs = [], []
        for _ in range(steps):
            with torch.no_grad():
                if name is None:
                    with model.disable_adapter() if adapters else contextlib.nullcontext():
                        logits = model(ids).logits[0, -1]
                else:
                    model.set_adapter(name)
                    logits = model(ids).logits[0, -1]
            lp = torch.log_softmax(logits.float(), -1)
            tokens.append(int(lp.argmax()))
            logprobs.append(float(lp[tokens[-1]]))
            ids = torch.cat([ids, torch.tensor([[tokens[-1]]])], dim=1)
        results.append((tokens, logprobs))
    return results


# Every Llama-family projection, as PEFT names them
EVERY_PROJECTION = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_peft_adapters(model_dir: Path, root: Path, first_seed: int, configs: dict[str, dict],
                        **common: Any) -> dict[str, Path]:
    """{name: directory} of write_peft_adapter's adapters, one per configs entry (its LoraConfig fields over
    common), seeded first_seed, first_seed + 1, ... in configs' order."""
    return {name: write_peft_adapter(model_dir, root / name, first_seed + i, **{**common, **config})
            for i, (name, config) in enumerate(configs.items())}


def generate_against_peft(model_dir: Path, adapters: dict[str, Path], prompts: list[str],
                          names: list[str | None], steps: int, tp: int = 1, fully_sharded: bool = False,
                          patch: Callable | None = None, tolerance: float | None = None,
                          reference_dir: Path | None = None, patch_peft: Callable | None = None,
                          **engine: Any) -> list:
    """The engine's greedy outputs (LoRA at rank up to 8, two slots; TP over the GPUs where there are tp of
    them, else gloo) for prompts under names (None: the base model), each asserted equal to transformers +
    PEFT's tokens, logprobs within 2e-3 (2e-2 on a GPU, whose float32 dots run in TF32) or tolerance. engine:
    more LLM arguments; patch, patch_peft: peft_greedy_reference's, on the checkpoint at reference_dir (default
    model_dir)."""
    from lora_core.request import LoRARequest
    from replicas.llm import LLM
    from replicas.sampling_params import SamplingParams

    requests = {name: LoRARequest(name, i + 1, str(adapters[name])) for i, name in enumerate(sorted(adapters))}
    device = "cuda" if torch.cuda.device_count() >= tp else "cpu"
    llm = LLM(str(model_dir), enable_lora=True, max_loras=2, max_lora_rank=8, dtype="float32", device=device,
              tensor_parallel_size=tp, fully_sharded_loras=fully_sharded, **engine)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=steps, logprobs=1, ignore_eos=True)
        outputs = llm.generate(prompts, params, [requests[n] if n else None for n in names])
    finally:
        llm.shutdown()
    want = peft_greedy_reference(reference_dir or model_dir, adapters, prompts, names, steps, patch, patch_peft)
    for out, (tokens, logprobs), name in zip(outputs, want, names, strict=True):
        got = out.outputs[0]
        assert out.error is None and got.token_ids == tokens, f"{name}: {got.token_ids} != {tokens}"
        error = max(abs(step[t] - lp) for step, t, lp in zip(got.logprobs, tokens, logprobs, strict=True))
        assert error < (tolerance or (2e-2 if device == "cuda" else 2e-3)), name
    return outputs


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """tiny_checkpoint(name) -> path of that CHECKPOINTS entry, written once per session."""
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            cache[name] = write_checkpoint(tmp_path_factory.mktemp(name), name)
        return cache[name]

    return get


@pytest.fixture(scope="session")
def sharded_checkpoint(tmp_path_factory) -> Path:
    """llama3_tied split over several files with a model.safetensors.index.json."""
    return write_checkpoint(tmp_path_factory.mktemp("llama3_sharded"), "llama3_tied", max_shard_size="40KB")


def sequence_tokens(steps, vocab_size: int, seed: int = 0) -> dict[str, list[int]]:
    """Random token ids for every sequence in ``steps``, as many as the steps consume."""
    lengths: dict[str, int] = {}
    for step in steps:
        for seq, n in step:
            lengths[seq] = lengths.get(seq, 0) + n
    gen = torch.Generator().manual_seed(seed)
    return {seq: torch.randint(0, vocab_size, (n,), generator=gen).tolist() for seq, n in lengths.items()}


def build_model(path: Path, ctx: ParallelContext | None = None) -> LlamaForCausalLM:
    return load_model(path, ModelConfig.from_pretrained(path, dtype="float32"), ctx)


@torch.no_grad()
def run_steps(model: LlamaForCausalLM, steps, tokens: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    """Feed ``steps`` through the paged cache (blocks scattered, not in order); logits [len, V] per sequence."""
    cfg = model.config
    caches = allocate_kv_caches(cfg.num_hidden_layers, NUM_BLOCKS, BLOCK_SIZE,
                                cfg.num_local_kv_heads(model.ctx.tp_size), cfg.head_dim, cfg.dtype)
    free = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(1)).tolist()
    tables = {seq: [free.pop() for _ in range(-(-len(ids) // BLOCK_SIZE))] for seq, ids in tokens.items()}
    done = dict.fromkeys(tokens, 0)
    logits: dict[str, list[torch.Tensor]] = {seq: [] for seq in tokens}
    for step in steps:
        ids, positions, query_lens, seq_lens = [], [], [], []
        for seq, n in step:
            start = done[seq]
            ids += tokens[seq][start : start + n]
            positions += range(start, start + n)
            query_lens.append(n)
            seq_lens.append(start + n)
            done[seq] = start + n
        meta = AttentionMetadata.build(query_lens, seq_lens, [tables[s] for s, _ in step], BLOCK_SIZE)
        hidden = model(torch.tensor(ids), torch.tensor(positions), caches, meta)
        for (seq, _), part in zip(step, model.compute_logits(hidden).split(query_lens)):
            logits[seq].append(part)
    return {seq: torch.cat(parts) for seq, parts in logits.items()}


@pytest.fixture(scope="session")
def demo(tmp_path_factory):
    """The demo checkpoint (a small Llama + 4 PEFT adapters), built once per test session."""
    from replicas.demo_checkpoint import ensure_demo_checkpoint

    return ensure_demo_checkpoint(tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="session")
def loras(demo):
    """name -> LoRARequest for every demo adapter, ids 1..4 in name order."""
    from lora_core.request import LoRARequest

    return {name: LoRARequest(name, i + 1, str(demo.adapters[name])) for i, name in enumerate(sorted(demo.adapters))}
