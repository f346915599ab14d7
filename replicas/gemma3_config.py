"""Gemma 3's config.json fields beyond the Llama family's (Gemma3ForCausalLM: Gemma 3 1B, and the text-only
models fine-tuned from the larger ones).

Layers alternate between sliding-window attention over local rope (rope_local_base_freq, no scaling) and full
attention over global rope (rope_theta and rope_scaling): layer_types, or, in older configs, every
sliding_window_pattern-th layer full. Attention is scaled by query_pre_attn_scalar ** -0.5, the MLP is
gelu_pytorch_tanh(gate) * up, embeddings are scaled by sqrt(hidden_size), and logits may be soft-capped.
Read as transformers reads them, both layouts: v4 (rope_theta, rope_local_base_freq, rope_scaling) and v5
(rope_parameters by layer type).
"""

from __future__ import annotations

import math
from typing import Any

from replicas.errors import ModelConfigError
from replicas.rope_config import RopeScaling, parse_rope

LAYER_TYPES = ("sliding_attention", "full_attention")
# Gemma3TextConfig's defaults: the multimodal checkpoints' config.json (Gemma 3 4B-27B) writes only the fields of
# its text_config that differ from them
TEXT_DEFAULTS = dict(vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                     num_attention_heads=8, num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh",
                     max_position_embeddings=131_072, rms_norm_eps=1e-6, tie_word_embeddings=True,
                     attention_bias=False, query_pre_attn_scalar=256, sliding_window=4096, bos_token_id=2,
                     eos_token_id=1)
GLOBAL_THETA, LOCAL_THETA = 1_000_000.0, 10_000.0  # transformers' defaults


def text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """A Gemma3ForConditionalGeneration config.json as its text model's: text_config over TEXT_DEFAULTS, with
    the architecture and the checkpoint's dtype. Its vision tower is not served (text prompts only)."""
    text = {**TEXT_DEFAULTS, **(raw.get("text_config") or {})}
    for key in ("architectures", "dtype", "torch_dtype"):
        if raw.get(key) is not None:
            text[key] = raw[key]
    return text


def gemma3_fields(raw: dict[str, Any], hidden_size: int, num_layers: int, where: str) -> dict[str, Any]:
    """ModelConfig's fields for a Gemma 3 config: rope_theta and rope_scaling (the full layers'), local_rope
    (the sliding layers' theta and scaling), layer_sliding_windows, attn_scale, hidden_act, embed_scale,
    final_logit_softcapping. ModelConfigError for what this engine does not compute."""
    for name, refused in (("attn_logit_softcapping", None), ("use_bidirectional_attention", False)):
        if raw.get(name) not in (refused, None):
            raise ModelConfigError(f"{where}: {name} {raw[name]!r} is not supported for gemma3")
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ModelConfigError(f"{where}: hidden_activation {act!r} is not supported for gemma3 "
                               f"(only gelu_pytorch_tanh)")
    layer_types = raw.get("layer_types")
    if layer_types is None:
        pattern = int(raw.get("sliding_window_pattern", 6))
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    if len(layer_types) != num_layers or any(t not in LAYER_TYPES for t in layer_types):
        raise ModelConfigError(f"{where}: layer_types must give each of the {num_layers} layers one of "
                               f"{LAYER_TYPES}, got {layer_types!r}")
    window = raw.get("sliding_window")
    full, local = _ropes(raw, where)
    scalar = raw.get("query_pre_attn_scalar", 256)
    cap = raw.get("final_logit_softcapping")
    return dict(rope=full, local_rope=local, hidden_act=act, attn_scale=float(scalar) ** -0.5,
                layer_sliding_windows=tuple(window if t == "sliding_attention" else None for t in layer_types),
                embed_scale=math.sqrt(hidden_size), final_logit_softcapping=None if cap is None else float(cap))


def _ropes(raw: dict[str, Any], where: str) -> tuple[tuple[float, RopeScaling], tuple[float, RopeScaling]]:
    """(theta, scaling) of the full layers, then of the sliding ones."""
    params = raw.get("rope_parameters") or {}
    if any(t in params for t in LAYER_TYPES):  # v5: one rope dict per layer type
        full = parse_rope({"rope_parameters": params.get("full_attention") or {}, "rope_theta": GLOBAL_THETA}, where)
        local = parse_rope({"rope_parameters": params.get("sliding_attention") or {}, "rope_theta": LOCAL_THETA},
                           where)
        return full, local
    full = parse_rope({"rope_scaling": raw.get("rope_scaling"), "rope_parameters": raw.get("rope_parameters"),
                       "rope_theta": raw.get("rope_theta", GLOBAL_THETA)}, where)
    return full, (float(raw.get("rope_local_base_freq", LOCAL_THETA)), RopeScaling())
