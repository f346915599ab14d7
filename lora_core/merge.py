"""One GPU slot's adapter folded into a linear layer's base weight: W [out, in] += B [out, r] @ A [r, in].

The serving engine merges an adapter into the base weights while every row of
its steps uses that one adapter (replicas/lora_merge.py), so those steps run
no LoRA kernel at all. This is the arithmetic only: it reads the slot as the
kernels do (LoRASlotBuffers: the scaling already folded into B, zeros past the
adapter's rank, so the padded rank adds nothing) and knows no model.
"""

from __future__ import annotations

import torch

from lora_core.errors import LoRAConfigError
from lora_core.module_spec import LoRAKind
from lora_core.slot_buffers import LoRASlotBuffers


def check_mergeable(buffers: LoRASlotBuffers) -> None:
    """Raise LoRAConfigError unless a slot of these buffers can be merged into this rank's weight."""
    name = buffers.spec.name
    if buffers.spec.kind is not LoRAKind.LINEAR:
        raise LoRAConfigError(f"{name}: only linear layers merge, not {buffers.spec.kind.name.lower()} ones")
    if buffers.lora_a.shape[2] != buffers.lora_b.shape[2]:
        # Fully-sharded column layers hold r / tp rows of A: this rank's delta needs all of them.
        raise LoRAConfigError(f"{name}: a fully-sharded A ({buffers.lora_a.shape[2]} of "
                              f"{buffers.lora_b.shape[2]} rank rows on this rank) cannot be merged locally")
    if buffers.bias is not None:
        raise LoRAConfigError(f"{name}: LoRA bias slots (bias_enabled) cannot be merged")


def add_slot_delta(weight: torch.Tensor, buffers: LoRASlotBuffers, slot: int,
                   base: torch.Tensor | None = None) -> None:
    """weight [sum(output_slices), in] (this rank's, as torch's Linear holds it) = base (default: weight itself)
    + the delta of the adapter in ``slot``, slice by slice.

    One addmm per output slice, so the sum rounds once into the weight's dtype, as PEFT's merge does; with
    ``base`` the weight is written once and never read.
    """
    check_mergeable(buffers)
    a, b = buffers.lora_a[:, slot], buffers.lora_b[slot]  # [S, R, in], [out, R]
    if weight.shape != (b.shape[0], a.shape[-1]):
        raise LoRAConfigError(f"{buffers.spec.name}: weight {tuple(weight.shape)} does not match the slots' "
                              f"[{b.shape[0]}, {a.shape[-1]}]")
    offset = 0
    for index, width in enumerate(buffers.output_slices):
        rows = weight.narrow(0, offset, width)
        lora_b, lora_a = b.narrow(0, offset, width).to(weight.dtype), a[index].to(weight.dtype)
        if base is None:
            rows.addmm_(lora_b, lora_a)
        else:
            torch.addmm(base.narrow(0, offset, width), lora_b, lora_a, out=rows)
        offset += width
