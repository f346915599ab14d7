"""RowScale: an RMSNorm's per-row factor, left to the op after the linear layer the norm feeds.

RMSNorm gives y = w * h / rms(h), rms over the whole row. Its LoRA kernel
(replicas/kernels/lora_norm.py) splits each row over many programs to read the
pending expand's B at full width, so the row's rms is known only when all its
programs are done: the last one to arrive made a second, serial pass over the
row (~1.5 us per site on an H200). A
linear layer without biases commutes with a per-row factor (W (c x) = c W x,
the LoRA shrink and expand too), so the norm can write w * h and the row's
sum-of-squares parts instead, and the op that reads the layer's output next
(the rotary embedding after qkv_proj, SiluAndMul after gate_up_proj)
multiplies each row by 1 / rms as it reads it. Where that op cannot (the CPU,
an expand it does not fuse), `apply_` scales the layer's output first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RowScale:
    """Row t of the consumer's input is inv(t) = rsqrt(sum(partials[t]) * inv_n + eps) times what the linear
    layer made of the unscaled norm output. partials [T, chunks] float32; good until the next RMSNorm runs."""
    partials: torch.Tensor
    eps: float
    inv_n: float

    def inv(self) -> torch.Tensor:
        """[T, 1] float32."""
        return torch.rsqrt(self.partials.sum(1, keepdim=True) * self.inv_n + self.eps)

    def apply_(self, *parts: torch.Tensor) -> None:
        """Scale these [T, width] tensors (views of the layer's output) in place, each product rounded to their
        dtype as the fused consumers round it."""
        inv = self.inv()
        for t in parts:
            t.copy_((t.float() * inv).to(t.dtype))

    def kernel_args(self) -> tuple:
        """(partials, its row stride, eps, inv_n): what fused._row_inv reads."""
        return self.partials, self.partials.stride(0), float(self.eps), float(self.inv_n)

    @property
    def chunks(self) -> int:
        return self.partials.shape[1]


def scales_with_input(layer) -> bool:
    """Whether layer(c * x) == c * layer(x) for a per-row c: no base bias and no LoRA bias (a LoRA layer
    answers for itself), so an RMSNorm before it may leave it a RowScale."""
    own = getattr(layer, "scales_with_input", None)
    if callable(own):
        return own()
    return getattr(layer, "bias", None) is None
