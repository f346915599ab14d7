"""The rope fields of config.json: theta, scaling (linear, llama3, longrope, yarn) and partial rotary, in
either transformers layout (v4: top-level rope_theta + rope_scaling; v5: rope_parameters), as RopeScaling.
replicas/layers/rotary.py turns them into frequencies."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from replicas.errors import ModelConfigError

ROPE_TYPES = ("default", "linear", "llama3", "longrope", "su", "yarn")  # "su": longrope's older name

# Added to a position to make the rotary embedding turn it with longrope's long factors below the original
# context (replicas/layers/rotary.py): a power of two past any context served.
LONG_ROPE = 1 << 32
NEVER_LONG = 1 << 62  # where a rotary embedding with one set of frequencies would take a second


@dataclass(frozen=True)
class RopeScaling:
    """rope_type "default" (none), "linear" (positions / factor), "llama3" (Llama 3.1 frequency bands),
    "longrope" (Phi-3-128k, Phi-3.5, Phi-4-mini: per-frequency factors, short_factor within the original
    context and long_factor past it (replicas/layers/rotary.py), cos and sin scaled by attention_factor) or
    "yarn" (Qwen2.5 / Qwen3 past 32 K: each frequency interpolated, extrapolated or a blend by how many turns
    it makes in the original context, between beta_slow and beta_fast; cos and sin scaled by
    attention_factor)."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True


def rope_params(raw: dict[str, Any]) -> dict[str, Any]:
    """The rope fields of either layout: v4's rope_scaling, v5's rope_parameters."""
    return {**(raw.get("rope_scaling") or {}), **(raw.get("rope_parameters") or {})}


def parse_rope(raw: dict[str, Any], where: str) -> tuple[float, RopeScaling]:
    params = rope_params(raw)
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:  # e.g. Phi-3-128k / Phi-3.5 / Phi-4-mini's "longrope" (or "su")
        field = "rope_parameters" if raw.get("rope_parameters") else "rope_scaling"
        raise ModelConfigError(f"{where}: {field} type {rope_type!r} is not supported; supported: {ROPE_TYPES}")
    if rope_type == "default":
        return theta, RopeScaling()
    try:
        if rope_type in ("longrope", "su"):
            return theta, _longrope(raw, params)
        if rope_type == "yarn":
            return theta, _yarn(raw, params, where)
        if rope_type == "linear":
            return theta, RopeScaling("linear", factor=float(params["factor"]))
        return theta, RopeScaling("llama3", factor=float(params["factor"]),
                                  low_freq_factor=float(params["low_freq_factor"]),
                                  high_freq_factor=float(params["high_freq_factor"]),
                                  original_max_position_embeddings=int(params["original_max_position_embeddings"]))
    except KeyError as exc:
        raise ModelConfigError(f"{where}: {rope_type} rope scaling lacks {exc.args[0]!r}") from None


def _longrope(raw: dict[str, Any], params: dict[str, Any]) -> RopeScaling:
    """LongRoPE as transformers computes it: frequencies divided by short_factor within the original context,
    by long_factor past it, cos and sin times attention_factor (given, else sqrt(1 + ln(factor) / ln(original))
    with factor = max_position_embeddings / original, 1 where that is <= 1). KeyError for a missing field."""
    original = int(params.get("original_max_position_embeddings") or raw["original_max_position_embeddings"])
    factor = float(params.get("factor") or int(raw.get("max_position_embeddings", original)) / original)
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeScaling("longrope", factor=factor, original_max_position_embeddings=original,
                       short_factor=tuple(float(f) for f in params["short_factor"]),
                       long_factor=tuple(float(f) for f in params["long_factor"]), attention_factor=float(attention))


def _yarn(raw: dict[str, Any], params: dict[str, Any], where: str) -> RopeScaling:
    """YaRN's fields as transformers reads them: the original context from the top level (where a config has
    it there), else the rope fields, else max_position_embeddings; factor, else max_position_embeddings over
    the original; attention_factor, else 0.1 ln(factor) + 1 (the ratio of two such terms with mscale and
    mscale_all_dim); beta_fast 32 and beta_slow 1 where absent or 0."""
    max_positions = int(raw.get("max_position_embeddings", 2048))
    original = int(raw.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
                   or max_positions)
    factor = float(params["factor"]) if params.get("factor") is not None else max_positions / original
    if not factor > 0 or original <= 0:
        raise ModelConfigError(f"{where}: yarn rope scaling needs factor > 0 and original_max_position_embeddings "
                               f"> 0, got {factor} and {original}")

    def mscale(scale: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0

    attention = params.get("attention_factor")
    if attention is None:
        given, all_dims = params.get("mscale"), params.get("mscale_all_dim")
        attention = mscale(float(given)) / mscale(float(all_dims)) if given and all_dims else mscale()
    return RopeScaling("yarn", factor=factor, original_max_position_embeddings=original,
                       attention_factor=float(attention), beta_fast=float(params.get("beta_fast") or 32),
                       beta_slow=float(params.get("beta_slow") or 1), truncate=bool(params.get("truncate", True)))


def check_longrope_factors(scaling: RopeScaling, rotary_dim: int, where: str) -> None:
    """Refuse a short_factor or long_factor that does not give each rotary frequency one factor."""
    for name, factors in (("short_factor", scaling.short_factor), ("long_factor", scaling.long_factor)):
        if len(factors) != rotary_dim // 2:
            raise ModelConfigError(f"{where}: longrope {name} has {len(factors)} factors, expected one per rotary "
                                   f"frequency: {rotary_dim // 2}")


def rotary_dim_of(raw: dict[str, Any], model_type: str, head_dim: int, where: str) -> int | None:
    """partial_rotary_factor (top level or in the rope fields) as the dimensions it turns; None for all of them.
    Only Phi-3's transformers code lets the rest of a head pass through (Phi-4-mini: 0.75): elsewhere such a
    config is refused rather than computed some other way."""
    rotary_dim = None
    for value in (raw.get("partial_rotary_factor"), rope_params(raw).get("partial_rotary_factor")):
        try:
            partial = None if value is None else float(value)
        except (TypeError, ValueError):
            raise ModelConfigError(f"{where}: malformed partial_rotary_factor {value!r}") from None
        if partial is None or partial == 1.0:
            continue
        dim = int(head_dim * partial)  # transformers' rounding
        if model_type != "phi3":
            raise ModelConfigError(f"{where}: partial_rotary_factor {partial} is not supported for {model_type} "
                                   f"(only Phi-3 turns part of a head)")
        if not 0 < partial < 1 or dim % 2:
            raise ModelConfigError(f"{where}: partial_rotary_factor {partial} must turn an even number of a "
                                   f"head's {head_dim} dimensions, got {dim}")
        rotary_dim = dim
    return rotary_dim
