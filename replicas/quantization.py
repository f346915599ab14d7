"""FP8 base weights (EngineArgs.quantization="fp8"): the linear layers' weights in float8 e4m3, LoRA as before.

A decode step reads every weight once, so its time is mostly the weights' bytes: in FP8 they are half of
bfloat16's (an 8B model's 15 GB -> 7.5 GB), and the memory freed goes to the KV cache. As vLLM's
`--quantization fp8` does for a bfloat16 checkpoint, the engine quantizes each linear layer's weight when it
loads it, and each GEMM's input as it runs:

- weights per output channel: w_q = round_fp8(w / s_n), s_n = max |w[n, :]| / 448 over the whole row (a
  row-parallel layer's ranks agree on it through one all-reduce at load, so the weights do not depend on the
  tensor-parallel size);
- inputs per token, on each rank's part of the row: x_q = round_fp8(x / s_t), s_t = max |x[t, :]| / 448;
- y = (x_q @ w_q^T) * s_t * s_n in the model's dtype: torch._scaled_mm on CUDA (one cuBLASLt FP8 GEMM with
  both scales; Hopper and later), the same products in float32 elsewhere (fp8_linear_reference: the CPU
  path, and the definition the GPU is checked against).

What stays in the model's dtype: embeddings, the LM head, norms, and every LoRA (the adapters' shrink and
expand read the unquantized input, as vLLM's LoRA over FP8 does). A quantized layer cannot merge an adapter
into its weights (replicas/lora_merge.py): the engine turns merging off. Adapters' A rows stacked beside its
weight run only when asked for (lora_stacked_max_tokens), as FP8 rows whose shrink is then FP8's
(replicas/fp8_lora.py).
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
METHODS = ("fp8",)
# a row of zeros keeps a scale that divides safely (its values quantize to 0 whatever the scale)
MIN_SCALE = 1e-12


def check_method(quantization: str | None) -> str | None:
    if quantization is not None and quantization not in METHODS:
        raise ValueError(f"quantization must be None or one of {', '.join(METHODS)}, got {quantization!r}")
    return quantization


def quantize_model(model: torch.nn.Module, method: str, dtype: torch.dtype, device: torch.device) -> int:
    """Quantize every linear layer of a loaded model (those with quantize_fp8: not the embeddings nor the LM
    head); returns how many. Raises ValueError where this GPU or dtype has no FP8 GEMM to run them."""
    check_method(method)
    layers = fp8_layers(model, dtype, device)
    for layer in layers:
        layer.quantize_fp8()
    return len(layers)


def fp8_layers(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> list[torch.nn.Module]:
    """The model's linear layers (those with quantize_fp8: not the embeddings nor the LM head), once checked
    that this device can run them in FP8 (ValueError where it cannot)."""
    if device.type == "cuda" and dtype == torch.float16:
        raise ValueError("FP8 weights run bfloat16 models on CUDA (the FP8 GEMM's row-wise scales write "
                         "bfloat16), not float16")
    # torch._scaled_mm's row-wise scales run on Hopper and later (Ada's FP8 GEMM takes one scale a tensor)
    if device.type == "cuda" and dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) < (9, 0):
        raise ValueError(f"FP8 weights need a GPU of compute capability 9.0 or later (Hopper, Blackwell) for "
                         f"the row-wise FP8 GEMM, not {torch.cuda.get_device_name(device)}")
    layers = [m for m in model.modules() if hasattr(m, "quantize_fp8")]
    if device.type == "cuda" and dtype == torch.bfloat16:
        for layer in layers:  # cuBLASLt's FP8 GEMM takes this rank's [N, K] weight only in steps of 16
            if any(size % 16 for size in layer.weight.shape):
                raise ValueError(f"FP8 weights: a linear layer's weight on this rank is {tuple(layer.weight.shape)}, "
                                 f"and the FP8 GEMM needs both sizes multiples of 16")
        _unit_scale(device)  # now: made inside a CUDA graph's capture, it would hold 1.0 only once replayed
    return layers


def row_scales(t: torch.Tensor) -> torch.Tensor:
    """[rows, K] -> [rows] float32: max |row| / FP8_MAX (at least MIN_SCALE)."""
    peak = t.abs().amax(dim=-1).float()
    # divided by a tensor on peak's device: torch on CUDA turns a division by a Python number into a product
    # with its reciprocal (an ulp off at times), and the Triton quantizer divides rounding correctly
    return (peak / peak.new_full((), FP8_MAX)).clamp_(min=MIN_SCALE)


def quantize_rows(t: torch.Tensor, scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, K] -> (float8 [rows, K], float32 scales [rows]): t / scale rounded to the nearest FP8 value
    (saturated at +-448), each row with its own scale (row_scales(t) unless given)."""
    scales = row_scales(t) if scales is None else scales
    q = (t.float() / scales.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scales


def quantize_rows_into(t: torch.Tensor, out: torch.Tensor, out_scales: torch.Tensor) -> None:
    """quantize_rows(t) written into out (float8 [rows, K]) and out_scales (float32 [rows]): by one Triton launch
    for a CUDA tensor, else in torch."""
    if t.is_cuda:
        from replicas.kernels.fp8 import quantize_rows as quantize_on_gpu  # triton: CUDA only here

        quantize_on_gpu(t, out=out, out_scales=out_scales)
        return
    q, scales = quantize_rows(t)
    out.copy_(q)
    out_scales.copy_(scales)


def fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         bias: torch.Tensor | None = None, input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (the model's dtype) @ an FP8 weight [N, K] with per-row scales [N] -> [..., N] in x's dtype:
    x quantized per token (or with input_scale [1], a checkpoint's static one), the products in float32, both
    scales applied to the sum, then the bias."""
    rows = x.reshape(-1, x.shape[-1])
    xq, x_scale = quantize_rows(rows, None if input_scale is None else input_scale.expand(rows.shape[0]))
    y = (xq.float() @ weight.float().t()) * x_scale.unsqueeze(1) * weight_scale.unsqueeze(0)
    y = y.to(x.dtype)
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None, input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """fp8_linear_reference's result: for bfloat16 on CUDA, the input quantized by one Triton launch (or its
    FP8 copy taken, where the kernel that wrote x attached one: fp8_copy), then torch._scaled_mm; elsewhere
    (CPU, float32 on CUDA: tests) the reference. Up to UNIT_SCALE_ROWS rows (decode batches) the product runs
    with unit scales into float32 and a Triton epilogue applies both scales (bench/fp8_gemm.py: _scaled_mm's
    row-wise form took about twice its per-tensor form's time there, up to 1.8 x the bfloat16 GEMM); above, the
    row-wise form, whose float32 sums a larger batch would write twice."""
    if not x.is_cuda or x.dtype != torch.bfloat16:
        return fp8_linear_reference(x, weight, weight_scale, bias, input_scale)
    from replicas.kernels.fp8 import quantize_rows as quantize_on_gpu, scale_product  # triton: CUDA only here

    rows = x.reshape(-1, x.shape[-1])
    copy = fp8_copy(x) if input_scale is None else None
    if copy is not None and copy[0].shape == rows.shape:  # quantized by the kernel that wrote x (an RMSNorm)
        xq, x_scale = copy
    else:
        xq, x_scale = quantize_on_gpu(rows, input_scale)
    if rows.shape[0] <= UNIT_SCALE_ROWS:
        unit = _unit_scale(x.device)
        acc = torch._scaled_mm(xq, weight.t(), scale_a=unit, scale_b=unit, out_dtype=torch.float32)
        y = scale_product(acc, x_scale, weight_scale, bias, x.dtype)
    else:
        y = torch._scaled_mm(xq, weight.t(), scale_a=x_scale.unsqueeze(1), scale_b=weight_scale.unsqueeze(0),
                             out_dtype=x.dtype)
        if bias is not None:  # added as the reference adds it: after the product's rounding to x's dtype
            y = y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])


UNIT_SCALE_ROWS = 256

# A tensor's per-token FP8 copy, made by the kernel that wrote the tensor (the RMSNorm before an FP8 layer:
# link_fp8_norms), which fp8_linear reads instead of quantizing the tensor again: one launch and one read of
# the row fewer per layer. An attribute of that tensor object, so a view, a copy or any other tensor has none,
# and the GEMM then quantizes as before; the copy equals what kernels.fp8.quantize_rows makes of the tensor.
_FP8_COPY = "_lorafleet_fp8_copy"


def attach_fp8_copy(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> None:
    """x [..., K] carries q (float8 [rows, K]) and scales (float32 [rows]): x's rows quantized per token."""
    setattr(x, _FP8_COPY, (q, scales))


def fp8_copy(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The (q, scales) attached to this tensor object by attach_fp8_copy, or None."""
    return getattr(x, _FP8_COPY, None)


def link_fp8_norms(model: torch.nn.Module) -> int:
    """Mark each RMSNorm whose output only an FP8 layer with per-token input scales reads (the decoder layers'
    fp8_norm_readers pairs) to write that layer's FP8 input beside its own output (RMSNorm.fp8_output); returns
    how many. A layer with a checkpoint's static input scale quantizes with it instead: its norm is left alone."""
    linked = 0
    for module in model.modules():
        pairs = getattr(module, "fp8_norm_readers", None)
        for norm, reader in pairs() if callable(pairs) else ():
            if reader.quantized and reader.input_scale is None:
                norm.fp8_output = True
                linked += 1
    return linked
_UNIT_SCALES: dict[torch.device, torch.Tensor] = {}


def _unit_scale(device: torch.device) -> torch.Tensor:
    """A float32 1.0 on device, made once (by fp8_layers, at load)."""
    if device.type == "cuda" and device.index is None:  # "cuda" and "cuda:0" name one device, one key
        device = torch.device("cuda", torch.cuda.current_device())
    unit = _UNIT_SCALES.get(device)
    if unit is None:
        unit = _UNIT_SCALES[device] = torch.ones((), dtype=torch.float32, device=device)
    return unit
