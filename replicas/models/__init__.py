"""Model definitions, picked by the checkpoint's architecture."""

from __future__ import annotations

from pathlib import Path

import torch

from replicas.attention import AttentionBackend
from replicas.loader import iterate_weights
from replicas.model_config import ModelConfig
from replicas.models.gemma3 import Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3ForConditionalGeneration
from replicas.models.granite import GraniteForCausalLM
from replicas.models.llama import LlamaForCausalLM
from replicas.models.phi3 import Phi3ForCausalLM
from replicas.parallel import ParallelContext
from replicas.quantization import fp8_layers

MODEL_REGISTRY = {"LlamaForCausalLM": LlamaForCausalLM, "MistralForCausalLM": LlamaForCausalLM,
                  "Qwen2ForCausalLM": LlamaForCausalLM, "Qwen3ForCausalLM": LlamaForCausalLM,
                  "Phi3ForCausalLM": Phi3ForCausalLM, "Gemma2ForCausalLM": Gemma2ForCausalLM,
                  "Gemma3ForCausalLM": Gemma3ForCausalLM,
                  "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,
                  "GraniteForCausalLM": GraniteForCausalLM}


def model_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    """The class serving ``config.architecture`` (ModelConfig has already refused unsupported ones)."""
    return MODEL_REGISTRY[config.architecture]


def load_model(path: str | Path, config: ModelConfig | None = None, ctx: ParallelContext | None = None,
               device: torch.device | str = "cpu", attn_backend: AttentionBackend | None = None) -> LlamaForCausalLM:
    """Build the model for ``path`` directly on ``device`` and load this rank's shards of its weights."""
    config = config or ModelConfig.from_pretrained(path, device=device)
    with torch.device(device):
        model = model_class(config)(config, ctx, attn_backend)
    if config.fp8_checkpoint is not None:  # FP8 weights and their scales, loaded as they are
        for layer in fp8_layers(model, config.dtype, torch.device(device)):
            layer.expect_fp8(config.fp8_checkpoint.static_input)
    model.load_weights(iterate_weights(path))
    return model.eval()


def dummy_model(config: ModelConfig, ctx: ParallelContext, device: torch.device,
                attn_backend: AttentionBackend | None = None) -> LlamaForCausalLM:
    """The model with random weights (std 0.02, norms 1) drawn on the device, the same on every run
    (load_format="dummy": benchmarks of model shapes with no checkpoint)."""
    with torch.device(device):
        model = model_class(config)(config, ctx, attn_backend)
    gen = torch.Generator(device=device).manual_seed(1234 + ctx.tp_rank)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
        else:
            param.data.normal_(0.0, 0.02, generator=gen)
    return model.eval()


__all__ = ["Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration", "GraniteForCausalLM",
           "LlamaForCausalLM",
           "MODEL_REGISTRY", "Phi3ForCausalLM", "dummy_model", "load_model", "model_class"]
