"""The Llama family (Llama 2/3/3.x, Mistral, Qwen2, Qwen3) over tensor-parallel layers and a paged KV cache.

Module names follow HF with q/k/v packed into ``qkv_proj`` and gate/up into
``gate_up_proj`` (as vLLM), e.g. "model.layers.0.self_attn.qkv_proj".
Sharding lives in the layers; this file reads like the architecture.

To build on a GPU without a CPU copy, construct under ``with torch.device("cuda"):``.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from lora_core.punica.pending import PendingExpand
from replicas.attention import Attention, AttentionBackend, AttentionMetadata
from replicas.layers import (GeluTanhAndMul, MergedColumnParallelLinear, ParallelLMHead, QKVParallelLinear, RMSNorm,
                             RotaryEmbedding, RowParallelLinear, SiluAndMul, VocabParallelEmbedding, forward_pending)
from replicas.layers.row_scale import RowScale, scales_with_input
from replicas.loader import CheckpointError, default_weight_loader
from replicas.model_config import ModelConfig
from replicas.parallel import ParallelContext

KVCache = tuple[torch.Tensor, torch.Tensor]
# A decoder layer's (hidden, residual, the LoRA expand its down_proj left owed to hidden, or None): the next
# layer's input add + RMSNorm (or the model's final norm) adds it (lora_core/punica/pending.py).
LayerOutput = tuple[torch.Tensor, torch.Tensor, PendingExpand | None]


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, ctx: ParallelContext, backend: AttentionBackend | None,
                 layer: int = 0) -> None:
        super().__init__()
        dtype, hd = config.dtype, config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, hd, config.num_attention_heads,
                                          config.num_key_value_heads, config.qkv_bias, ctx, dtype)
        self.o_proj = RowParallelLinear(config.num_attention_heads * hd, config.hidden_size,
                                        config.o_proj_bias, ctx, dtype)
        self.q_size = self.qkv_proj.num_heads * hd
        self.kv_size = self.qkv_proj.num_kv_heads * hd
        theta, scaling = config.layer_rope(layer)  # Gemma 3's sliding layers have their own
        self.rotary_emb = RotaryEmbedding(hd, theta, scaling, config.rotary_dim)
        if config.qk_norm:  # Qwen3, Gemma 3: one weight for every head, so each rank holds all of it
            self.q_norm = RMSNorm(hd, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(hd, config.rms_norm_eps, dtype)
        self.head_dim, self.qk_norm = hd, config.qk_norm
        # longrope and yarn scale cos and sin by attention_factor: over whole heads q.k by its square (1
        # otherwise); a partly turned head's cos and sin carry it themselves (RotaryEmbedding.cos_sin_factor)
        factor = 1.0 if self.rotary_emb.partial else scaling.attention_factor
        scale = (config.attn_scale or hd ** -0.5) * factor ** 2
        self.attn = Attention(self.qkv_proj.num_heads, hd, self.qkv_proj.num_kv_heads, scale,
                              config.layer_window(layer), backend, softcap=config.attn_logit_softcapping)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        return self.o_proj(self.attn(*self.project(positions, hidden), kv_cache, meta))

    def project(self, positions: torch.Tensor, hidden: torch.Tensor,
                row_scale: RowScale | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden [T, H] -> q, k, v (rotary applied): everything before the attention proper. row_scale: the
        input norm's per-row factor, still owed to hidden (replicas/layers/row_scale.py)."""
        # A LoRA qkv_proj may leave its expand to the rotary kernel, which adds it as it rotates (v in place).
        qkv, lora = forward_pending(self.qkv_proj, hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm:
            if row_scale is not None:  # the decoder layer leaves none to a qk-norm model (_norm's defer)
                raise ValueError("a qk-norm attention takes its input normed: no row_scale")
            q, k = self._norm_heads(q, k, lora)
            lora = None
        q, k = self.rotary_emb(positions, q, k, lora=lora, v=v, row_scale=row_scale)
        return q, k, v

    def _norm_heads(self, q: torch.Tensor, k: torch.Tensor,
                    lora: PendingExpand | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Qwen3's per-head RMSNorm of q and k. The LoRA expand the rotary kernel would have added as it read
        them goes into qkv first: the head norms read the finished values."""
        if lora is not None:
            lora.apply()  # into qkv, whose views q, k and v are
        hd = self.head_dim
        q = self.q_norm(q.contiguous().view(-1, hd)).view(q.shape)
        k = self.k_norm(k.contiguous().view(-1, hd)).view(k.shape)
        return q, k


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, ctx: ParallelContext) -> None:
        super().__init__()
        inter, dtype = config.intermediate_size, config.dtype
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], config.mlp_bias, ctx, dtype)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, config.mlp_bias, ctx, dtype)
        self.act_fn = SiluAndMul() if config.hidden_act == "silu" else GeluTanhAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, lora = self.forward_pending(x)
        if lora is not None:
            lora.apply()
        return y

    def forward_pending(self, x: torch.Tensor,
                        row_scale: RowScale | None = None) -> tuple[torch.Tensor, PendingExpand | None]:
        """(y, down_proj's LoRA expand left to the add + RMSNorm that reads y next, or None). row_scale: the
        norm's per-row factor, still owed to x."""
        # A LoRA gate_up_proj may leave its expand to SiluAndMul, which adds it as it reads gate and up.
        gate_up, lora = forward_pending(self.gate_up_proj, x)
        return forward_pending(self.down_proj, self.act_fn(gate_up, lora, row_scale))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, ctx: ParallelContext, backend: AttentionBackend | None,
                 layer: int = 0) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, ctx, backend, layer)
        self.mlp = LlamaMLP(config, ctx)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: KVCache, meta: AttentionMetadata, lora: PendingExpand | None = None) -> LayerOutput:
        q, k, v, residual = self.attention_inputs(positions, hidden, residual, lora)
        return self.attention_outputs(self.self_attn.attn(q, k, v, kv_cache, meta), residual)

    def fp8_norm_readers(self) -> list[tuple[RMSNorm, nn.Module]]:
        """(norm, the linear layer that alone reads the norm's output): where the norm may write that layer's FP8
        input too (quantization.link_fp8_norms)."""
        return [(self.input_layernorm, self.self_attn.qkv_proj), (self.post_attention_layernorm, self.mlp.gate_up_proj)]

    # The two halves of the layer around its attention: replicas/piecewise_graphs.py captures them
    # in CUDA graphs and runs the attention between them eagerly.
    def attention_inputs(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                         lora: PendingExpand | None = None):
        """-> q, k, v, residual. lora: the previous layer's down_proj expand, still owed to hidden."""
        if residual is None:
            return (*self.self_attn.project(positions, self.input_layernorm(hidden)), hidden)
        # Qwen3's head norms read q and k whole: the input norm then scales its rows itself
        hidden, residual, scale = _norm(self.input_layernorm, hidden, residual, lora, self.self_attn.qkv_proj,
                                        defer=not self.self_attn.qk_norm)
        return (*self.self_attn.project(positions, hidden, scale), residual)

    def attention_outputs(self, attn: torch.Tensor, residual: torch.Tensor) -> LayerOutput:
        """attention output [T, heads * head_dim] -> hidden, residual, the expand still owed to hidden
        (o_proj, norm, MLP). A LoRA o_proj or down_proj may leave its expand to the add + RMSNorm after it."""
        out, lora = forward_pending(self.self_attn.o_proj, attn)
        hidden, residual, scale = _norm(self.post_attention_layernorm, out, residual, lora, self.mlp.gate_up_proj)
        hidden, lora = self.mlp.forward_pending(hidden, scale)
        return hidden, residual, lora


def _norm(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor, lora: PendingExpand | None,
          reader: nn.Module, defer: bool = True) -> tuple[torch.Tensor, torch.Tensor, RowScale | None]:
    """norm(x, residual, lora=lora) -> (y, h, row_scale): with an expand to add, the norm's LoRA kernel may leave
    each row's 1 / rms to the op after `reader` (the linear layer that reads y) when that layer has no biases
    and defer allows it."""
    if lora is not None and defer and scales_with_input(reader):
        return norm.forward_deferred(x, residual, lora)
    return (*norm(x, residual, lora=lora), None)


class LlamaModel(nn.Module):
    layer_class = LlamaDecoderLayer

    def __init__(self, config: ModelConfig, ctx: ParallelContext, backend: AttentionBackend | None) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, ctx, config.dtype)
        self.layers = nn.ModuleList(self.layer_class(config, ctx, backend, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata) -> torch.Tensor:
        hidden, residual, lora = self.embed(input_ids), None, None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual, lora = layer(positions, hidden, residual, kv_cache, meta, lora)
        hidden, _ = self.norm(hidden, residual, lora=lora)
        return hidden

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward_piece(self, i: int, positions: torch.Tensor, input_ids: torch.Tensor | None,
                      attn: torch.Tensor | None, residual: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """Piece i of num_layers + 1 between the attentions (forward == the pieces with attention between).

        Piece 0 embeds input_ids and returns layer 0's (q, k, v, residual); piece i takes layer i-1's
        attention output and returns layer i's (q, k, v, residual); the last returns (final hidden,).
        """
        if i == 0:
            return self.layers[0].attention_inputs(positions, self.embed(input_ids), None)
        hidden, residual, lora = self.layers[i - 1].attention_outputs(attn, residual)
        if i < len(self.layers):
            return self.layers[i].attention_inputs(positions, hidden, residual, lora)
        return (self.norm(hidden, residual, lora=lora)[0],)


class LlamaForCausalLM(nn.Module):
    """forward(input_ids [T], positions [T], kv_caches, meta) -> hidden [T, H]; compute_logits -> [N, V]."""

    decoder_class = LlamaModel
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    # (packed param name, checkpoint name, shard id)
    stacked_params_mapping = [(".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"),
                              (".qkv_proj", ".v_proj", "v"), (".gate_up_proj", ".gate_proj", 0),
                              (".gate_up_proj", ".up_proj", 1)]

    def __init__(self, config: ModelConfig, ctx: ParallelContext | None = None,
                 attn_backend: AttentionBackend | None = None) -> None:
        super().__init__()
        ctx = ctx or ParallelContext()
        config.check_tp(ctx.tp_size)
        self.config, self.ctx = config, ctx
        self.model = self.decoder_class(config, ctx, attn_backend)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, ctx, config.dtype)
        if config.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                attn_meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, attn_meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] (the rows to sample) -> logits [N, vocab_size] on every rank."""
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named full tensors; each parameter cuts its own shard. Returns the loaded param names.

        Raises CheckpointError for a tensor the model has no place for, a shape
        that does not fit, or a parameter the checkpoint never provided.
        """
        params = dict(self.named_parameters())  # a tied lm_head.weight is listed once, as embed_tokens
        shards: dict[str, set] = {}  # param name -> shard ids loaded (None for a whole tensor)
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or "rotary_emb.cos_cached" in name or "rotary_emb.sin_cached" in name:
                continue  # recomputed from the config
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # tied: the embedding table is the head
            fp8 = self.config.fp8_checkpoint
            if fp8 is not None and fp8.kv_scales and name.endswith((".k_scale", ".v_scale")):
                # calibrated FP8 cache scales: the layer's Attention keeps them (used with an FP8 cache)
                owner, _, which = name.rpartition(".")
                try:
                    attn = self.get_submodule(owner + ".attn")
                except AttributeError:
                    raise CheckpointError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}") from None
                setattr(attn, which, float(tensor.float().reshape(-1)[0]))
                continue
            target, shard_id = name, None
            for packed, sub, sid in self.stacked_params_mapping:
                if sub in name:
                    target, shard_id = name.replace(sub, packed), sid
                    break
            param = params.get(target)
            if param is None:
                raise CheckpointError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            loader = getattr(param, "weight_loader", default_weight_loader)
            try:
                loader(param, tensor, shard_id) if shard_id is not None else loader(param, tensor)
            except CheckpointError as exc:
                raise CheckpointError(f"{name}: {exc}") from None
            shards.setdefault(target, set()).add(shard_id)
        missing = sorted(name for name in params if None not in shards.get(name, ())
                         and not shards.get(name, set()) >= self._shards_needed(name))
        if missing:
            raise CheckpointError(f"checkpoint lacks weights for {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        return set(shards)

    def _shards_needed(self, param_name: str) -> set:
        for packed in {p for p, _, _ in self.stacked_params_mapping}:
            if packed + "." in param_name:
                return {sid for p, _, sid in self.stacked_params_mapping if p == packed}
        return {None}
