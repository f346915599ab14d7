"""The demo checkpoint: loadable by transformers, PEFT and lora_core; deterministic; built once, atomically."""

from __future__ import annotations

import json
import warnings

import peft
import pytest
import torch
import transformers

from lora_core.config import LoRAConfig
from lora_core.lora_model import LoRAModel
from lora_core.module_spec import LoRAKind, LoRAModuleSpec
from replicas import demo_checkpoint
from replicas.demo_checkpoint import ADAPTERS, MODEL_CONFIG, ensure_demo_checkpoint

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPT = "The quick brown fox"
STEPS = 16


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return ensure_demo_checkpoint(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def prompt_ids(demo):
    return transformers.AutoTokenizer.from_pretrained(demo.model_dir)(PROMPT, return_tensors="pt").input_ids


def hf_model(demo, adapter: str | None = None):
    model = transformers.AutoModelForCausalLM.from_pretrained(demo.model_dir, dtype=torch.float32)
    if adapter is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = peft.PeftModel.from_pretrained(model, demo.adapters[adapter])
    return model.eval()


def greedy(model, prompt_ids) -> list[int]:
    with torch.no_grad():
        out = model.generate(prompt_ids, max_new_tokens=STEPS, do_sample=False, pad_token_id=3)
    return out[0, prompt_ids.shape[1]:].tolist()


@pytest.fixture(scope="module")
def base_tokens(demo, prompt_ids):
    return greedy(hf_model(demo), prompt_ids)


def test_loads_in_transformers(demo, base_tokens):
    config = transformers.AutoConfig.from_pretrained(demo.model_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(demo.model_dir)
    assert config.architectures == ["LlamaForCausalLM"] and not config.tie_word_embeddings
    assert config.vocab_size == len(tokenizer) and 1000 <= config.vocab_size <= 2000
    assert (config.hidden_size, config.num_hidden_layers, config.num_key_value_heads) == (128, 4, 2)
    model = hf_model(demo)
    state = model.state_dict()
    assert set(state) == set(transformers.AutoModelForCausalLM.from_config(config).state_dict())
    assert all(torch.isfinite(t).all() for t in state.values())
    generation = transformers.GenerationConfig.from_pretrained(demo.model_dir)
    assert generation.eos_token_id == tokenizer.eos_token_id == 2
    assert len(set(base_tokens)) >= STEPS // 2, f"greedy output too repetitive: {base_tokens}"
    assert not set(base_tokens) & {0, 1, 2, 3}  # special tokens are never the greedy pick


@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_adapter_changes_hf_peft_greedy_output(demo, prompt_ids, base_tokens, name):
    model = hf_model(demo, name)
    assert isinstance(model, peft.PeftModel)
    fields = json.loads((demo.adapters[name] / "adapter_config.json").read_text())
    lora_config = model.peft_config["default"]
    assert (lora_config.r, lora_config.use_rslora) == (fields["r"], fields.get("use_rslora", False))
    assert set(lora_config.target_modules) == set(fields["target_modules"])
    tokens = greedy(model, prompt_ids)
    assert tokens != base_tokens and tokens[:4] != base_tokens[:4], f"{name} barely changes the output"


@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_adapter_loads_in_lora_core(demo, name):
    c = MODEL_CONFIG
    h, inter, q, kv = c["hidden_size"], c["intermediate_size"], 4 * 32, 2 * 32
    packed = {"self_attn.qkv_proj": (h, (q, kv, kv), ("q_proj", "k_proj", "v_proj")),
              "self_attn.o_proj": (q, (h,), ("o_proj",)), "mlp.gate_up_proj": (h, (inter, inter),
                                                                              ("gate_proj", "up_proj")),
              "mlp.down_proj": (inter, (h,), ("down_proj",))}
    specs = [LoRAModuleSpec(f"model.layers.{i}.{n}", LoRAKind.LINEAR, d_in, outs, subs)
             for i in range(c["num_hidden_layers"]) for n, (d_in, outs, subs) in packed.items()]
    fields = ADAPTERS[name][1]
    lora = LoRAModel.from_local_checkpoint(demo.adapters[name], PROJ, lora_model_id=1, module_specs=specs,
                                           lora_config=LoRAConfig(max_loras=1, max_lora_rank=32))
    assert lora.rank == fields["r"]
    assert len(lora.loras) == c["num_hidden_layers"] * len(fields["target_modules"])
    assert all(w.lora_b.abs().max() > 0 for w in lora.loras.values())


def test_build_is_deterministic(demo, tmp_path):
    other = ensure_demo_checkpoint(tmp_path / "elsewhere")
    files = [p.relative_to(demo.model_dir.parent) for p in demo.model_dir.parent.rglob("*") if p.is_file()]
    assert len(files) == 5 + 2 * len(ADAPTERS)
    for rel in files:  # every file, the safetensors included, byte for byte
        assert (other.model_dir.parent / rel).read_bytes() == (demo.model_dir.parent / rel).read_bytes(), rel


def test_build_is_cached(tmp_path, monkeypatch):
    first = ensure_demo_checkpoint(tmp_path)
    stamp = (first.model_dir / "model.safetensors").stat().st_mtime_ns

    def fail(out):
        raise AssertionError("rebuilt although the cache is complete")
    monkeypatch.setattr(demo_checkpoint, "write_demo", fail)
    assert ensure_demo_checkpoint(tmp_path) == first
    assert (first.model_dir / "model.safetensors").stat().st_mtime_ns == stamp


def test_cache_location_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("LORAFLEET_CACHE", str(tmp_path))
    paths = ensure_demo_checkpoint()
    assert paths.model_dir.is_relative_to(tmp_path / "demo")
    assert set(paths.adapters) == set(ADAPTERS) and all(d.is_dir() for d in paths.adapters.values())


def test_crash_leaves_no_partial_checkpoint(tmp_path, monkeypatch):
    def crash(fields, seed):
        raise RuntimeError("disk full")
    monkeypatch.setattr(demo_checkpoint, "adapter_weights", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        ensure_demo_checkpoint(tmp_path)
    assert list(tmp_path.iterdir()) == []  # neither the final directory nor the temporary one
    monkeypatch.undo()
    paths = ensure_demo_checkpoint(tmp_path)
    assert (paths.adapters["demo-chat"] / "adapter_model.safetensors").is_file()


def test_damaged_cache_is_rebuilt(tmp_path):
    paths = ensure_demo_checkpoint(tmp_path)
    (paths.adapters["demo-sql"] / "adapter_model.safetensors").unlink()
    assert ensure_demo_checkpoint(tmp_path) == paths
    assert (paths.adapters["demo-sql"] / "adapter_model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == [paths.model_dir.parent.name]
