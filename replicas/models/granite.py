"""Granite (GraniteForCausalLM: IBM Granite 3.x dense models): the Llama computation with four multipliers.

The embeddings are multiplied by embedding_multiplier (a LoRA on embed_tokens with them, as the model applies
the multiplier after the embedding), attention is scaled by attention_multiplier instead of head_dim ** -0.5
(LlamaAttention reads ModelConfig.attn_scale), each layer's attention and MLP outputs are multiplied by
residual_multiplier before they join the residual, and the logits are divided by logits_scaling.
"""

from __future__ import annotations

import torch

from replicas.attention import AttentionBackend
from replicas.layers import forward_pending
from replicas.model_config import ModelConfig
from replicas.models.llama import LayerOutput, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from replicas.parallel import ParallelContext


class GraniteDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: ModelConfig, ctx: ParallelContext, backend: AttentionBackend | None,
                 layer: int = 0) -> None:
        super().__init__(config, ctx, backend, layer)
        self.residual_multiplier = config.residual_multiplier

    def attention_outputs(self, attn: torch.Tensor, residual: torch.Tensor) -> LayerOutput:
        """attention output -> (the MLP's output times the multiplier, the residual it joins, None): the LoRA
        expands are added where they are owed, since the multiplier scales each output whole."""
        out, lora = forward_pending(self.self_attn.o_proj, attn)
        if lora is not None:
            lora.apply()
        hidden, residual = self.post_attention_layernorm(out * self.residual_multiplier, residual)
        return self.mlp(hidden) * self.residual_multiplier, residual, None


class GraniteModel(LlamaModel):
    layer_class = GraniteDecoderLayer

    def __init__(self, config: ModelConfig, ctx: ParallelContext, backend: AttentionBackend | None) -> None:
        super().__init__(config, ctx, backend)
        self.embedding_multiplier = config.embed_scale

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embedding_multiplier


class GraniteForCausalLM(LlamaForCausalLM):
    decoder_class = GraniteModel

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / self.config.logits_scaling
