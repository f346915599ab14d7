"""Fixtures: a tiny random Llama and real PEFT adapters saved from it.

The adapters come from peft itself (LoraConfig + get_peft_model +
save_pretrained) so that the loader is tested against the format PEFT really
writes, not against our idea of it. PEFT initialises lora_B to zero, which
would make every delta zero and every comparison vacuous, so A and B are
filled with random values before saving.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import Embedding as PeftLoraEmbedding
from peft.tuners.lora import LoraLayer
from transformers import LlamaConfig, LlamaForCausalLM

from lora_core.module_spec import LoRAKind, LoRAModuleSpec

HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, VOCAB = 64, 96, 2, 4, 2, 128
EXPECTED_LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                         "embed_tokens", "lm_head")
ALL_PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _tiny_llama(**overrides) -> LlamaForCausalLM:
    config = LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=VOCAB,
        max_position_embeddings=128, tie_word_embeddings=False, **overrides)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="session")
def tiny_llama() -> LlamaForCausalLM:
    """Shared base model; adapters are built on deep copies because PEFT edits the model in place."""
    return _tiny_llama()


@pytest.fixture(scope="session")
def tiny_llama_with_bias() -> LlamaForCausalLM:
    """Base layers with biases: PEFT allows lora_bias only on layers that have one."""
    return _tiny_llama(attention_bias=True, mlp_bias=True)


@pytest.fixture(scope="session")
def expected_lora_modules() -> tuple[str, ...]:
    return EXPECTED_LORA_MODULES


@pytest.fixture(scope="session")
def llama_module_specs() -> list[LoRAModuleSpec]:
    """What a served tiny Llama (with merged qkv_proj / gate_up_proj) reports to lora_core."""
    kv = KV_HEADS * (HIDDEN // HEADS)
    specs = [
        LoRAModuleSpec("model.embed_tokens", LoRAKind.EMBEDDING, VOCAB, (HIDDEN,), ("embed_tokens",)),
        LoRAModuleSpec("lm_head", LoRAKind.LOGITS, HIDDEN, (VOCAB,), ("lm_head",)),
    ]
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        specs += [
            LoRAModuleSpec(f"{p}.self_attn.qkv_proj", LoRAKind.LINEAR, HIDDEN, (HIDDEN, kv, kv),
                           ("q_proj", "k_proj", "v_proj")),
            LoRAModuleSpec(f"{p}.self_attn.o_proj", LoRAKind.LINEAR, HIDDEN, (HIDDEN,), ("o_proj",)),
            LoRAModuleSpec(f"{p}.mlp.gate_up_proj", LoRAKind.LINEAR, HIDDEN, (INTERMEDIATE, INTERMEDIATE),
                           ("gate_proj", "up_proj")),
            LoRAModuleSpec(f"{p}.mlp.down_proj", LoRAKind.LINEAR, INTERMEDIATE, (HIDDEN,), ("down_proj",)),
        ]
    return specs


@pytest.fixture(scope="session")
def make_peft_adapter(tmp_path_factory, tiny_llama, tiny_llama_with_bias) -> Callable[..., tuple[Path, object]]:
    """make_peft_adapter(with_bias=False, seed=0, **LoraConfig kwargs) -> (adapter dir, peft model)."""

    def make(*, with_bias: bool = False, seed: int = 0, **lora_kwargs) -> tuple[Path, object]:
        base = copy.deepcopy(tiny_llama_with_bias if with_bias else tiny_llama)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # PEFT warns about saving embedding layers etc.
            peft_model = get_peft_model(base, LoraConfig(**lora_kwargs))
            gen = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                for name, param in peft_model.named_parameters():
                    if "lora_" in name:
                        param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
            out = tmp_path_factory.mktemp("adapter")
            peft_model.save_pretrained(out)
        return out, peft_model

    return make


def peft_lora_layers(peft_model) -> dict[str, LoraLayer]:
    """PEFT's LoRA layers by the module name our loader uses (no base_model.model. prefix)."""
    return {name.removeprefix("base_model.model."): module for name, module in peft_model.named_modules()
            if isinstance(module, LoraLayer) and "default" in module.scaling}


def peft_delta_in_out(layer: LoraLayer) -> torch.Tensor:
    """PEFT's delta in our [in, out] layout.

    For a Linear PEFT returns the update of W [out, in], so it is transposed.
    For an Embedding PEFT already returns the table's update [vocab, dim],
    which is our [in, out] with in = vocab.
    """
    with torch.no_grad():
        delta = layer.get_delta_weight("default").float()
    return delta if isinstance(layer, PeftLoraEmbedding) else delta.T


@pytest.fixture(scope="session")
def peft_deltas() -> Callable[[object], dict[str, torch.Tensor]]:
    return lambda peft_model: {n: peft_delta_in_out(m) for n, m in peft_lora_layers(peft_model).items()}


@pytest.fixture(scope="session")
def peft_layers() -> Callable[[object], dict[str, LoraLayer]]:
    return peft_lora_layers


ALL_PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Real PEFT adapters the loader and the config parser are checked against, by name.
PEFT_CASES = {
    "plain": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "rslora": dict(r=8, lora_alpha=16, use_rslora=True, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "rank_pattern": dict(r=4, lora_alpha=8, target_modules=ALL_PROJ,
                         rank_pattern={"q_proj": 8, r"model\.layers\.1\.mlp\.down_proj": 2}),
    "alpha_pattern": dict(r=4, lora_alpha=8, target_modules=ALL_PROJ,
                          alpha_pattern={"v_proj": 32, r"layers\.0\.mlp\.up_proj": 2}),
    "regex": dict(r=4, lora_alpha=4, target_modules=r".*layers\.1\.(self_attn\.(q|k)_proj|mlp\.gate_proj)"),
    "all_linear": dict(r=4, lora_alpha=8, target_modules="all-linear"),
    "embed_lm_head": dict(r=4, lora_alpha=8, target_modules=["embed_tokens", "lm_head", "q_proj", "down_proj"]),
    "layers_to_transform": dict(r=4, lora_alpha=8, target_modules=ALL_PROJ, layers_to_transform=[1]),
    "layers_pattern": dict(r=4, lora_alpha=8, target_modules=["q_proj", "up_proj"], layers_to_transform=0,
                           layers_pattern="layers"),
}
