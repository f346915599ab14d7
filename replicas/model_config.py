"""ModelConfig: what the engine needs from an HF-format model directory.

Reads config.json (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2 and 3, Granite architectures) and, when present,
generation_config.json; the rope fields in replicas/rope_config.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from replicas.errors import ModelConfigError
from replicas.fp8_checkpoint import Fp8Checkpoint, parse_fp8_checkpoint
from replicas.gemma_config import gemma_fields, text_config
from replicas.rope_config import RopeScaling, check_longrope_factors, parse_rope, rotary_dim_of

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                           "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "Phi3ForCausalLM": "phi3",
                           "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3",
                           "Gemma3ForConditionalGeneration": "gemma3", "GraniteForCausalLM": "granite"}
DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16, "half": torch.float16}


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
    # Gemma 3 (replicas/gemma_config.py): each layer's window (None: full attention) and the sliding layers'
    # rope, the attention's scale (else head_dim ** -0.5), the MLP's activation, the embeddings' scale and the
    # logits' soft cap
    layer_sliding_windows: tuple[int | None, ...] | None = None
    local_rope: tuple[float, RopeScaling] | None = None
    attn_scale: float | None = None
    attn_logit_softcapping: float | None = None  # Gemma 2: scores -> cap * tanh(score / cap)
    hidden_act: str = "silu"
    embed_scale: float | None = None
    final_logit_softcapping: float | None = None
    # Granite: each layer's attention and MLP outputs times residual_multiplier before the residual add, the
    # logits divided by logits_scaling (its embedding_multiplier is embed_scale, attention_multiplier attn_scale)
    residual_multiplier: float | None = None
    logits_scaling: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: torch.dtype = torch.float32
    fp8_checkpoint: Fp8Checkpoint | None = None  # the linear layers' weights are FP8 in the checkpoint
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
        fp8 = parse_fp8_checkpoint(raw, where)  # at the top level, also for a multimodal config
        if arch == "Gemma3ForConditionalGeneration":  # served as its text model
            raw = text_config(raw)
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
        if model_type in ("gemma2", "gemma3"):
            extra = gemma_fields(raw, model_type, hidden, values["num_hidden_layers"], where)
            theta, scaling = extra.pop("rope")
        else:
            if raw.get("hidden_act", "silu") != "silu":
                raise ModelConfigError(f"{where}: hidden_act {raw['hidden_act']!r} is not supported (only silu)")
            theta, scaling = parse_rope(raw, where)
            extra = _granite(raw, where) if model_type == "granite" else {}
        rotary_dim = rotary_dim_of(raw, model_type, values["head_dim"], where)
        if scaling.rope_type == "longrope":
            check_longrope_factors(scaling, rotary_dim or values["head_dim"], where)
        if scaling.rope_type == "yarn":  # the context YaRN stretches to, as vLLM serves it: original x factor
            values["max_position_embeddings"] = max(values["max_position_embeddings"],
                                                    int(scaling.original_max_position_embeddings * scaling.factor))
        gen = dict(generation_config or {})
        return cls(architecture=arch, model_type=model_type, **values, rope_theta=theta, rope_scaling=scaling,
                   **_biases(raw, model_type), qk_norm=model_type in ("qwen3", "gemma3"), rotary_dim=rotary_dim,
                   sliding_window=_sliding_window(raw, model_type, where),
                   bos_token_id=gen.get("bos_token_id", raw.get("bos_token_id")),
                   eos_token_ids=_token_ids(gen.get("eos_token_id", raw.get("eos_token_id"))),
                   dtype=resolve_dtype(dtype, raw.get("dtype") or raw.get("torch_dtype"), device),
                   path=path, generation_config=gen, fp8_checkpoint=fp8, **extra)

    def layer_window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window (None: it attends to every key before it)."""
        return self.layer_sliding_windows[layer] if self.layer_sliding_windows is not None else self.sliding_window

    def layer_rope(self, layer: int) -> tuple[float, RopeScaling]:
        """Layer `layer`'s rope theta and scaling (Gemma 3's sliding layers have their own)."""
        if self.local_rope is not None and self.layer_window(layer) is not None:
            return self.local_rope
        return self.rope_theta, self.rope_scaling

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


def _granite(raw: dict[str, Any], where: str) -> dict[str, float]:
    """Granite's four multipliers (transformers' GraniteConfig: 1 where absent), as ModelConfig's fields."""
    names = dict(embed_scale="embedding_multiplier", attn_scale="attention_multiplier",
                 residual_multiplier="residual_multiplier", logits_scaling="logits_scaling")
    values = {field: raw.get(key, 1.0) for field, key in names.items()}
    bad = [names[f] for f, v in values.items() if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0]
    if bad:
        raise ModelConfigError(f"{where}: {', '.join(bad)} must be positive numbers")
    return {field: float(v) for field, v in values.items()}


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
