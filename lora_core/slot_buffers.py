"""LoRASlotBuffers: the stacked GPU buffers of one LoRA-able layer.

Allocated once by LoRAModelManager as strided views of one device tensor
holding every module's slots (slot_layout.SlotLayout: the slot stride is a
whole slot of all modules), written slot by slot, read by every PunicaWrapper
op through their strides. Shapes are local to this tensor-parallel rank:

    lora_a  [S, L, R_a, in]   per output slice S, per slot L; rows past the
                              adapter's rank are zero (as B's columns past it):
                              kernels may read them (see ranks)
            EMBEDDING: [1, L, vocab, R] (a lookup table per slot)
    lora_b  [L, out, R_b]     all slices concatenated along out, in slice order
    ranks   [S, L] int32      the rank each slot really has for each slice on
                              this TP rank (0 = empty slot or untargeted slice);
                              kernels mask by it, rounded up to 8 ranks so that
                              their loads vectorize (triton_kernels.rank_mask);
                              stacked steps read the whole width R (stacked_a.py,
                              punica/column_expand.py), zeros included
    bias    [L, out] or None  PEFT lora_bias, already scaled

R_a == R_b == max_lora_rank, except that fully-sharded column layers hold
R_a = max_lora_rank / tp_size rows of A (the shrink output is all-gathered).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lora_core.module_spec import LoRAModuleSpec


@dataclass
class LoRASlotBuffers:
    spec: LoRAModuleSpec
    lora_a: torch.Tensor
    lora_b: torch.Tensor
    ranks: torch.Tensor
    output_slices: tuple[int, ...]  # local widths, sum == lora_b.shape[1]
    bias: torch.Tensor | None = None

    @property
    def num_slots(self) -> int:
        return self.lora_b.shape[0]

    def num_bytes(self) -> int:
        tensors = [self.lora_a, self.lora_b] + ([self.bias] if self.bias is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)
