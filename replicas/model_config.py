"""ModelConfig: what the engine needs from an HF-format model directory.

Reads config.json (Llama, Mistral, Qwen2, Qwen3, Phi-3 architectures) and, when present,
generation_config.json. Both the transformers v4 layout (top-level
``rope_theta`` + ``rope_scaling``) and the v5 one (``rope_parameters``) parse
to the same RopeScaling.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                           "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "Phi3ForCausalLM": "phi3"}
ROPE_TYPES = ("default", "linear", "llama3", "longrope", "su", "yarn")  # "su": longrope's older name
DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16, "half": torch.float16}


# Added to a position to make the rotary embedding turn it with longrope's long factors below the original
# context (replicas/layers/rotary.py): a power of two past any context served.
LONG_ROPE = 1 << 32
NEVER_LONG = 1 << 62  # where a rotary embedding with one set of frequencies would take a second


class ModelConfigError(ValueError):
    """A model directory's config cannot be served (unsupported, malformed, or bad engine settings)."""


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


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head of q and k, before the rotary embedding
    # The leading dimensions of a head that the rotary embedding turns (partial_rotary_factor x head_dim: Phi-4-mini
    # turns 96 of 128); the rest pass through. None: the whole head.
    rotary_dim: int | None = None
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: torch.dtype = torch.float32
    path: str | None = None
    generation_config: dict[str, Any] = field(default_factory=dict, compare=False)

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: str | torch.dtype = "auto",
                        device: str | torch.device | None = None) -> "ModelConfig":
        """Parse ``path``/config.json (+ generation_config.json).

        dtype "auto": float32 on CPU; on GPU the checkpoint's bfloat16/float16,
        bfloat16 for a float32 or unmarked checkpoint. ``device`` defaults to
        CUDA when available.
        """
        path = Path(path)
        raw = _read_json(path / "config.json", required=True)
        gen = _read_json(path / "generation_config.json", required=False) or {}
        return cls.from_dict(raw, dtype=dtype, device=device, generation_config=gen, path=str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], dtype: str | torch.dtype = "auto",
                  device: str | torch.device | None = None, generation_config: dict[str, Any] | None = None,
                  path: str | None = None) -> "ModelConfig":
        where = path or "config"
        arch = _architecture(raw, where)
        model_type = SUPPORTED_ARCHITECTURES[arch]
        try:
            hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
            values = dict(vocab_size=int(raw["vocab_size"]), hidden_size=hidden,
                          intermediate_size=int(raw["intermediate_size"]),
                          num_hidden_layers=int(raw["num_hidden_layers"]), num_attention_heads=heads,
                          num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
                          head_dim=int(raw.get("head_dim") or hidden // heads),
                          rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                          max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                          tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)))
        except KeyError as exc:
            raise ModelConfigError(f"{where}: config.json lacks {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise ModelConfigError(f"{where}: config.json has a malformed field: {exc}") from None
        if heads % values["num_key_value_heads"]:
            raise ModelConfigError(f"{where}: {heads} attention heads are not a multiple of "
                                   f"{values['num_key_value_heads']} key/value heads")
        if raw.get("hidden_act", "silu") != "silu":
            raise ModelConfigError(f"{where}: hidden_act {raw['hidden_act']!r} is not supported (only silu)")
        theta, scaling = _rope(raw, where)
        rotary_dim = _rotary_dim(raw, model_type, values["head_dim"], where)
        if scaling.rope_type == "longrope":
            _check_longrope_factors(scaling, rotary_dim or values["head_dim"], where)
        if scaling.rope_type == "yarn":  # the context YaRN stretches to, as vLLM serves it: original x factor
            values["max_position_embeddings"] = max(values["max_position_embeddings"],
                                                    int(scaling.original_max_position_embeddings * scaling.factor))
        gen = dict(generation_config or {})
        return cls(architecture=arch, model_type=model_type, **values, rope_theta=theta, rope_scaling=scaling,
                   **_biases(raw, model_type), qk_norm=model_type == "qwen3", rotary_dim=rotary_dim,
                   sliding_window=_sliding_window(raw, model_type, where),
                   bos_token_id=gen.get("bos_token_id", raw.get("bos_token_id")),
                   eos_token_ids=_token_ids(gen.get("eos_token_id", raw.get("eos_token_id"))),
                   dtype=resolve_dtype(dtype, raw.get("dtype") or raw.get("torch_dtype"), device),
                   path=path, generation_config=gen)

    @property
    def long_rope_from(self) -> int | None:
        """longrope: the original context, from which positions turn with long_factor and past which a prompt
        turns with it at every position (replicas/layers/rotary.py); None for every other rope type."""
        s = self.rope_scaling
        return s.original_max_position_embeddings if s.rope_type == "longrope" else None

    def check_tp(self, tp_size: int) -> None:
        """Raise ModelConfigError unless heads, kv heads and the MLP split evenly over tp_size ranks."""
        kv = self.num_key_value_heads
        problems = []
        if self.num_attention_heads % tp_size:
            problems.append(f"{self.num_attention_heads} attention heads")
        if (kv % tp_size) if kv >= tp_size else (tp_size % kv):
            problems.append(f"{kv} key/value heads (need a multiple or a divisor of tp_size)")
        if self.intermediate_size % tp_size:
            problems.append(f"intermediate_size {self.intermediate_size}")
        if problems:
            raise ModelConfigError(f"tensor_parallel_size {tp_size} does not split " + ", ".join(problems))

    def num_local_kv_heads(self, tp_size: int) -> int:
        """KV heads held by each rank: replicated (1 per rank) when there are fewer kv heads than ranks."""
        return max(1, self.num_key_value_heads // tp_size)


def resolve_dtype(dtype: str | torch.dtype, checkpoint_dtype: str | None,
                  device: str | torch.device | None) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ModelConfigError(f"dtype {dtype} is not supported; use float32, bfloat16 or float16")
        return dtype
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ModelConfigError(f"dtype {dtype!r} is not supported; use auto, float32, bfloat16 or float16")
        return DTYPES[dtype]
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu":
        return torch.float32  # CPU half-precision matmuls are slow and lossy
    ckpt = DTYPES.get(str(checkpoint_dtype).removeprefix("torch."))
    return ckpt if ckpt in (torch.bfloat16, torch.float16) else torch.bfloat16


def _read_json(path: Path, required: bool) -> dict[str, Any] | None:
    if not path.is_file():
        if required:
            raise ModelConfigError(f"{path} not found: not an HF-format model directory")
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelConfigError(f"{path}: unreadable JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ModelConfigError(f"{path}: expected a JSON object")
    return data


def _architecture(raw: dict[str, Any], where: str) -> str:
    archs = raw.get("architectures") or []
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    if not archs:  # a bare config (no "architectures") still names its model_type
        by_type = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
        if raw.get("model_type") in by_type:
            return by_type[raw["model_type"]]
    raise ModelConfigError(f"{where}: architecture {archs or raw.get('model_type')!r} is not supported; "
                           f"supported: {sorted(SUPPORTED_ARCHITECTURES)}")


def _rope_params(raw: dict[str, Any]) -> dict[str, Any]:
    """The rope fields of either layout: v4's rope_scaling, v5's rope_parameters."""
    return {**(raw.get("rope_scaling") or {}), **(raw.get("rope_parameters") or {})}


def _rope(raw: dict[str, Any], where: str) -> tuple[float, RopeScaling]:
    params = _rope_params(raw)
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


def _check_longrope_factors(scaling: RopeScaling, rotary_dim: int, where: str) -> None:
    """Refuse a short_factor or long_factor that does not give each rotary frequency one factor."""
    for name, factors in (("short_factor", scaling.short_factor), ("long_factor", scaling.long_factor)):
        if len(factors) != rotary_dim // 2:
            raise ModelConfigError(f"{where}: longrope {name} has {len(factors)} factors, expected one per rotary "
                                   f"frequency: {rotary_dim // 2}")


def _rotary_dim(raw: dict[str, Any], model_type: str, head_dim: int, where: str) -> int | None:
    """partial_rotary_factor (top level or in the rope fields) as the dimensions it turns; None for all of them.
    Only Phi-3's transformers code lets the rest of a head pass through (Phi-4-mini: 0.75): elsewhere such a
    config is refused rather than computed some other way."""
    rotary_dim = None
    for value in (raw.get("partial_rotary_factor"), _rope_params(raw).get("partial_rotary_factor")):
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


def _biases(raw: dict[str, Any], model_type: str) -> dict[str, bool]:
    if model_type == "phi3":  # HF's Phi3 builds its projections without biases, whatever attention_bias says
        return dict(qkv_bias=False, o_proj_bias=False, mlp_bias=False)
    if model_type == "qwen2":  # Qwen2 always has q/k/v bias and no o_proj/MLP bias
        return dict(qkv_bias=True, o_proj_bias=False, mlp_bias=False)
    attn = bool(raw.get("attention_bias", False))
    return dict(qkv_bias=attn, o_proj_bias=attn, mlp_bias=bool(raw.get("mlp_bias", False)))


def _sliding_window(raw: dict[str, Any], model_type: str, where: str) -> int | None:
    if model_type in ("mistral", "phi3"):  # HF: query q sees keys k in (q - window, q]
        return raw.get("sliding_window")
    if model_type in ("qwen2", "qwen3") and raw.get("use_sliding_window"):
        raise ModelConfigError(f"{where}: {model_type.capitalize()} per-layer sliding window attention is not "
                               f"supported")
    return None


def _token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, (list, tuple)) else (int(value),)
