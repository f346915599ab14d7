"""Pointwise layers of the Llama block: RMSNorm (optionally fused with the residual add) and SiluAndMul.

Each layer's forward_native is the plain-torch definition; forward runs the
fused Triton kernel of replicas.kernels.fused instead when fused_ops(x) says so.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lora_core.punica.pending import PendingExpand
from replicas.layers.row_scale import RowScale


def fused_ops(x: torch.Tensor):
    """replicas.kernels.fused when its kernels should run on x (x on CUDA, unless LORAFLEET_FUSED_OPS=0), else None."""
    if not x.is_cuda:
        return None
    from replicas.kernels import fused  # imported here: triton is optional off the GPU
    return fused if fused.enabled() else None


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in float32 and cast back (as HF Llama).

    forward(x) -> y; forward(x, residual) adds first: h = x + residual, and
    returns (norm(h), h) so the caller carries h on as the next residual.

    fp8_output: y is read only by an FP8 layer that quantizes it per token (set by
    quantization.link_fp8_norms): on CUDA the fused kernel then writes that FP8 copy of a bfloat16 y too and
    attaches it to y (quantization.fp8_copy), so the layer's GEMM skips its own quantizer launch.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.fp8_output = False
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=params_dtype or torch.get_default_dtype()),
                                   requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, lora: PendingExpand | None = None):
        """lora: the expand of the layer that made x (o_proj, down_proj), left to this op
        (lora_core/punica/pending.py): on CUDA one kernel adds it, the residual and the norm
        (replicas.kernels.lora_norm); elsewhere, and for slots above its LORA_NORM_MAX_RANK, it runs into x first."""
        fused = fused_ops(x)
        if lora is not None:
            if fused is not None and residual is not None:
                from replicas.kernels import lora_norm  # triton: CUDA only here
                if lora.slice_rank <= lora_norm.LORA_NORM_MAX_RANK and lora_norm.fusable(x, residual, lora):
                    return lora_norm.add_rms_norm_lora(x, residual, self.weight, self.eps, lora)
            lora.apply()  # into x: the output it is owed to
        if fused is None:
            return self.forward_native(x, residual)
        quantize = self.fp8_output and x.dtype == torch.bfloat16 and fused.fp8_norm_enabled()
        if residual is None:
            return fused.rms_norm(x, self.weight, self.eps, quantize)
        return fused.fused_add_rms_norm(x, residual, self.weight, self.eps, quantize)

    def forward_deferred(self, x: torch.Tensor, residual: torch.Tensor, lora: PendingExpand):
        """forward(x, residual, lora) -> (y, h, row_scale): where the LoRA kernel runs (CUDA, bfloat16 or
        float32, slots within its rank) it leaves each row's 1 / rms to the op after the linear layer that
        reads y (y = weight * h; replicas/layers/row_scale.py: only for a layer without biases), else
        row_scale is None and y is normed. float16 keeps the norm: an unnormed row may overflow its range."""
        fused = fused_ops(x)
        if fused is not None and x.dtype != torch.float16:
            from replicas.kernels import lora_norm  # triton: CUDA only here
            if lora.slice_rank <= lora_norm.LORA_NORM_MAX_RANK and lora_norm.fusable(x, residual, lora):
                return lora_norm.add_rms_norm_lora_deferred(x, residual, self.weight, self.eps, lora)
        return (*self(x, residual, lora=lora), None)

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class SiluAndMul(nn.Module):
    """x [..., 2I] = [gate | up] -> silu(gate) * up [..., I]."""

    gelu_tanh = False  # the fused kernel's activation: silu

    def forward(self, x: torch.Tensor, lora: PendingExpand | None = None,
                row_scale: RowScale | None = None) -> torch.Tensor:
        """lora: gate_up_proj's expand, left to this op (lora_core/punica/pending.py): the fused kernel adds
        it as it reads x; elsewhere (for any x or expand fused.silu_and_mul would refuse, and for slots above
        fused.LORA_SILU_MAX_RANK, where the fused kernel is slower) it runs into x first. row_scale: the
        RowScale the norm before gate_up_proj left, applied next (by the fused kernel; off CUDA to x first)."""
        fused = fused_ops(x)
        if lora is not None and (fused is None or not fused.silu_fusable(x, lora)
                                 or lora.slice_rank > fused.LORA_SILU_MAX_RANK):
            lora.apply()  # into x: the output it is owed to
            lora = None
        if fused is None:
            if row_scale is not None:
                row_scale.apply_(x)
            return self.forward_native(x)
        return fused.silu_and_mul(x, lora=lora, row_scale=row_scale, gelu_tanh=self.gelu_tanh)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(SiluAndMul):
    """x [..., 2I] = [gate | up] -> gelu_tanh(gate) * up [..., I] (Gemma's MLP: transformers' gelu_pytorch_tanh);
    the same fused kernel as SiluAndMul on CUDA, with its activation switched."""

    gelu_tanh = True

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up
