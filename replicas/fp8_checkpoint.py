"""Checkpoints whose linear layers are already FP8: config.json's quantization_config, read.

Two formats cover the FP8 Llama-family checkpoints on the Hub:

- compressed-tensors (llm-compressor, "RedHatAI/...-FP8-dynamic", "...-FP8"): quant_method
  "compressed-tensors", format "float-quantized", one config group targeting Linear layers whose weights are
  8-bit floats, scaled per channel (`weight_scale` [out, 1]) or per tensor ([1]); inputs dynamic per token,
  or static per tensor (`input_scale` [1]).
- AutoFP8's: quant_method "fp8", `activation_scheme` "dynamic" or "static", per-tensor `weight_scale`
  (and `input_scale` when static).

The engine keeps one layout for both (replicas/quantization.py): a float32 scale per weight row (a per-tensor
scale repeated over its tensor's rows, so q, k and v packed into one layer keep their own) and, for static
inputs, the layer's input scale (the largest of the tensors packed into it, as vLLM takes). Anything else a
quantization_config may say (block-wise FP8, integer weights, other bit widths, linear layers left out of
the quantization) is a ModelConfigError naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from replicas.errors import ModelConfigError


@dataclass(frozen=True)
class Fp8Checkpoint:
    static_input: bool  # inputs quantized with the checkpoint's per-tensor input_scale (else per token)
    # compressed-tensors' kv_cache_scheme: calibrated k_scale / v_scale tensors per layer, which an FP8 cache
    # (kv_cache_dtype="fp8") stores K and V divided by (replicas/attention.py Attention)
    kv_scales: bool = False


def parse_fp8_checkpoint(raw: dict[str, Any], where: str) -> Fp8Checkpoint | None:
    """config.json -> its FP8 scheme, None without a quantization_config; ModelConfigError otherwise."""
    config = raw.get("quantization_config")
    if config is None:
        return None
    where = f"{where}: quantization_config"
    if not isinstance(config, dict):
        raise ModelConfigError(f"{where} must be an object")
    method = config.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(config, where)
    if method == "fp8":
        if config.get("weight_block_size") is not None:
            raise ModelConfigError(f"{where}: block-wise FP8 (weight_block_size) is not supported; per-channel and "
                                   f"per-tensor FP8 are")
        scheme = config.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise ModelConfigError(f"{where}.activation_scheme must be 'dynamic' or 'static', got {scheme!r}")
        _check_ignored(config.get("ignored_layers") or config.get("modules_to_not_convert") or [], where)
        return Fp8Checkpoint(static_input=scheme == "static")
    raise ModelConfigError(f"{where}.quant_method {method!r} is not supported: FP8 checkpoints ('fp8', "
                           f"'compressed-tensors' float-quantized) are, or quantization='fp8' over a bfloat16 one")


def _compressed_tensors(config: dict[str, Any], where: str) -> Fp8Checkpoint:
    fmt = config.get("format")
    if fmt != "float-quantized":
        raise ModelConfigError(f"{where}.format {fmt!r} is not supported (only 'float-quantized': FP8 weights)")
    groups = config.get("config_groups") or {}
    if len(groups) != 1:
        raise ModelConfigError(f"{where}.config_groups: one group for every Linear layer is supported, "
                               f"got {len(groups)}")
    (name, group), = groups.items()
    at = f"{where}.config_groups.{name}"
    if group.get("targets") != ["Linear"]:
        raise ModelConfigError(f"{at}.targets must be ['Linear'], got {group.get('targets')!r}")
    weights, inputs = group.get("weights") or {}, group.get("input_activations")
    _check_fp8(weights, f"{at}.weights")
    if weights.get("strategy") not in ("channel", "tensor") or weights.get("dynamic"):
        raise ModelConfigError(f"{at}.weights: strategy 'channel' or 'tensor', not dynamic, is supported; got "
                               f"{weights.get('strategy')!r}{' (dynamic)' if weights.get('dynamic') else ''}")
    if inputs is None:
        raise ModelConfigError(f"{at}.input_activations: weight-only FP8 is not supported (inputs in FP8 are)")
    _check_fp8(inputs, f"{at}.input_activations")
    dynamic = bool(inputs.get("dynamic"))
    if (dynamic, inputs.get("strategy")) not in ((True, "token"), (False, "tensor")):
        raise ModelConfigError(f"{at}.input_activations: dynamic per 'token' or static per 'tensor' is supported, "
                               f"got strategy {inputs.get('strategy')!r}, dynamic {dynamic}")
    if group.get("output_activations") is not None:
        raise ModelConfigError(f"{at}.output_activations: quantized outputs are not supported")
    _check_ignored(config.get("ignore") or [], where)
    return Fp8Checkpoint(static_input=not dynamic, kv_scales=config.get("kv_cache_scheme") is not None)


def _check_fp8(part: dict[str, Any], where: str) -> None:
    if part.get("type") != "float" or part.get("num_bits") != 8 or part.get("symmetric") is False:
        raise ModelConfigError(f"{where}: only symmetric 8-bit float is supported, got type {part.get('type')!r}, "
                               f"num_bits {part.get('num_bits')!r}")


def _check_ignored(ignored: list, where: str) -> None:
    # the LM head (and embeddings) stay unquantized here anyway; a decoder layer's linear left out is refused
    kept = [name for name in ignored if not str(name).endswith(("lm_head", "embed_tokens"))]
    if kept:
        raise ModelConfigError(f"{where}: layers left unquantized ({kept[:3]}) are not supported: every linear "
                               f"layer of the decoder must be FP8")
