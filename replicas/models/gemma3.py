"""Gemma 3 (Gemma3ForCausalLM) and Gemma 2 (Gemma2ForCausalLM): the Llama computation with Gemma's
differences.

Each layer norms its attention output and its MLP output before adding them to the residual (four norms a
layer: input, post-attention, pre- and post-feedforward), q and k get a per-head norm as in Qwen3, the MLP
is gelu_tanh(gate) * up, embeddings are scaled by sqrt(hidden_size) (a LoRA on embed_tokens with them, as PEFT
scales it), and attention alternates between sliding-window layers over local rope and full layers over
global rope (ModelConfig.layer_window / layer_rope, replicas/gemma_config.py). Gemma 2 is the same without
the q/k norms and the local rope, with its attention scores and logits soft-capped (ModelConfig's fields).
Gemma's RMSNorm multiplies by 1 + weight: the loader adds the 1, so the norms here are Llama's
(transformers multiplies in float32 before rounding to the activation dtype, we round first: equal in
float32, an ulp apart at most in bfloat16).
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch
from torch import nn

from lora_core.multimodal_names import image_only, text_model_name
from replicas.attention import AttentionBackend
from replicas.layers import RMSNorm, forward_pending
from replicas.model_config import ModelConfig
from replicas.models.llama import LayerOutput, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from replicas.parallel import ParallelContext

Weights = Iterable[tuple[str, torch.Tensor]]


class Gemma3DecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: ModelConfig, ctx: ParallelContext, backend: AttentionBackend | None,
                 layer: int = 0) -> None:
        super().__init__(config, ctx, backend, layer)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)

    def fp8_norm_readers(self) -> list[tuple[RMSNorm, nn.Module]]:
        # the post-attention norm feeds the residual add; the pre-feedforward one feeds gate_up_proj
        return [(self.input_layernorm, self.self_attn.qkv_proj),
                (self.pre_feedforward_layernorm, self.mlp.gate_up_proj)]

    def attention_outputs(self, attn: torch.Tensor, residual: torch.Tensor) -> LayerOutput:
        """attention output -> (the MLP's output normed, the residual it is to be added to, None): every
        LoRA expand is added where it is owed (a norm reads each output whole before any add)."""
        out, lora = forward_pending(self.self_attn.o_proj, attn)
        if lora is not None:
            lora.apply()
        hidden, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(out), residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual, None


class Gemma3Model(LlamaModel):
    layer_class = Gemma3DecoderLayer

    def __init__(self, config: ModelConfig, ctx: ParallelContext, backend: AttentionBackend | None) -> None:
        super().__init__(config, ctx, backend)
        # transformers rounds the scale to the weights' dtype first (sqrt(1152) is 34.0 in bfloat16)
        self.embed_scale = float(torch.tensor(config.embed_scale, dtype=config.dtype))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embed_scale


class Gemma3ForCausalLM(LlamaForCausalLM):
    """LlamaForCausalLM with Gemma 3's layers, norms (1 + weight) and logits' soft cap."""

    decoder_class = Gemma3Model

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def load_weights(self, weights: Weights) -> set[str]:
        return super().load_weights(_one_plus_norms(weights))


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    """Gemma 2 (2B, 9B, 27B): Gemma 3's computation as its config sets it (no q/k norms, one rope, soft caps)."""


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """Gemma 3 4B-27B's multimodal checkpoints served as their text model: the language model's tensors
    (under language_model.model., or model.language_model. as transformers v5 writes them) load as
    Gemma3ForCausalLM's; the vision tower and projector are not read (text prompts only)."""

    def load_weights(self, weights: Weights) -> set[str]:
        return super().load_weights(_text_model(weights))


def _text_model(weights: Weights) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        if not image_only(name):
            yield text_model_name(name), tensor


def _one_plus_norms(weights: Weights) -> Iterator[tuple[str, torch.Tensor]]:
    """Gemma's norm weights w as the 1 + w a Llama RMSNorm multiplies by (added in float32)."""
    for name, tensor in weights:
        if name.endswith("norm.weight"):
            tensor = (tensor.float() + 1.0).to(tensor.dtype)
        yield name, tensor
