"""Gemma 2's and Gemma 3's config.json fields beyond the Llama family's.

Layers alternate between sliding-window and full attention: layer_types, or, in older configs, every second
layer full (Gemma 2) or every sliding_window_pattern-th (Gemma 3). Gemma 3's sliding layers have their own
rope (rope_local_base_freq, no scaling), its full ones rope_theta and rope_scaling; Gemma 2 has one rope.
Attention is scaled by query_pre_attn_scalar ** -0.5 (Gemma 2 also soft-caps its scores), the MLP is
gelu_pytorch_tanh(gate) * up, embeddings are scaled by sqrt(hidden_size), and logits may be soft-capped.
Read as transformers reads them, both layouts: v4 (rope_theta, rope_local_base_freq, rope_scaling) and v5
(Gemma 3: rope_parameters by layer type).
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


def gemma_fields(raw: dict[str, Any], model_type: str, hidden_size: int, num_layers: int,
                 where: str) -> dict[str, Any]:
    """ModelConfig's fields for a Gemma 2 or 3 config (model_type "gemma2" / "gemma3"): rope_theta and
    rope_scaling (the full layers'), local_rope (Gemma 3's sliding layers' theta and scaling),
    layer_sliding_windows, attn_scale, attn_logit_softcapping, hidden_act, embed_scale,
    final_logit_softcapping. ModelConfigError for what this engine does not compute."""
    if raw.get("use_bidirectional_attention"):
        raise ModelConfigError(f"{where}: use_bidirectional_attention is not supported for {model_type}")
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ModelConfigError(f"{where}: hidden_activation {act!r} is not supported for {model_type} "
                               f"(only gelu_pytorch_tanh)")
    gemma2 = model_type == "gemma2"
    layer_types = raw.get("layer_types")
    if layer_types is None:
        pattern = 2 if gemma2 else int(raw.get("sliding_window_pattern", 6))
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    if len(layer_types) != num_layers or any(t not in LAYER_TYPES for t in layer_types):
        raise ModelConfigError(f"{where}: layer_types must give each of the {num_layers} layers one of "
                               f"{LAYER_TYPES}, got {layer_types!r}")
    window = raw.get("sliding_window", 4096)
    if gemma2:  # one rope for every layer; both soft caps on by default (transformers' Gemma2Config)
        full, local = parse_rope(raw, where), None
        attn_cap, final_cap = raw.get("attn_logit_softcapping", 50.0), raw.get("final_logit_softcapping", 30.0)
    else:
        full, local = _ropes(raw, where)
        attn_cap, final_cap = raw.get("attn_logit_softcapping"), raw.get("final_logit_softcapping")
    scalar = raw.get("query_pre_attn_scalar", 256)
    return dict(rope=full, local_rope=local, hidden_act=act, attn_scale=float(scalar) ** -0.5,
                layer_sliding_windows=tuple(window if t == "sliding_attention" else None for t in layer_types),
                embed_scale=math.sqrt(hidden_size), attn_logit_softcapping=_cap(attn_cap, "attn", where),
                final_logit_softcapping=_cap(final_cap, "final", where))


def _cap(value: Any, which: str, where: str) -> float | None:
    if value is None:
        return None
    if not isinstance(value, (int, float)) or value <= 0:
        raise ModelConfigError(f"{where}: {which}_logit_softcapping must be a positive number, got {value!r}")
    return float(value)


def _ropes(raw: dict[str, Any], where: str) -> tuple[tuple[float, RopeScaling], tuple[float, RopeScaling]]:
    """(theta, scaling) of the full layers, then of the sliding ones."""
    params = raw.get("rope_parameters") or {}
    if any(t in params for t in LAYER_TYPES):  # v5: one rope dict per layer type
        full = parse_rope({"rope_parameters": params.get("full_attention") or {}, "rope_theta": GLOBAL_THETA}, where)
        local = parse_rope({"rope_parameters": params.get("sliding_attention") or {}, "rope_theta": LOCAL_THETA},
                           where)
        return full, local
    full = parse_rope({"rope_scaling": raw.get("rope_scaling"), "rope_parameters": raw.get("rope_parameters"),
                       "rope_theta": raw.get("rope_theta") or GLOBAL_THETA}, where)
    return full, (float(raw.get("rope_local_base_freq") or LOCAL_THETA), RopeScaling())
