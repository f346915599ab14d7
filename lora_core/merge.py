"""One GPU slot's adapter folded into a linear layer's base weight: W [out, in] += B [out, r] @ A [r, in].

The serving engine merges an adapter into the base weights while every row of
its steps uses that one adapter (replicas/lora_merge.py), so those steps run
no LoRA kernel at all. This is the arithmetic only: it reads the slot as the
kernels do (LoRASlotBuffers: the scaling already folded into B, zeros past the
adapter's rank, so the padded rank adds nothing) and knows no model.

Taking the delta back out must give the base weight bit for bit, or every
switch would leave it a little further off. W + BA rounded, minus BA rounded,
is W again for most elements but not all (where the sum crossed into a larger
binade, or the delta dwarfs the weight). merge_slot_delta therefore runs the
very removal that remove_slot_delta will run (the same op on the same memory,
so the same bits), compares it with W, and keeps W's value where they differ:
a few bytes per such element, where a copy of the weights costs two per element.
"""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass
class MergeUndo:
    """What takes a merged slot's delta back out of one weight: the delta's factors per output slice (private
    copies, so a slot reused meanwhile changes nothing), and the base values of the elements the subtraction
    does not restore."""

    factors: list[tuple[int, torch.Tensor, torch.Tensor]]  # (first row, B [width, R], A [R, in]), weight's dtype
    fix_index: torch.Tensor  # int32 [n], flat indices into the weight
    fix_value: torch.Tensor  # [n], the base weight there

    @property
    def fixups(self) -> int:
        return self.fix_index.numel()

    @property
    def nbytes(self) -> int:
        tensors = [t for _, b, a in self.factors for t in (b, a)] + [self.fix_index, self.fix_value]
        return sum(t.numel() * t.element_size() for t in tensors)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """t's bits as integers of its width (so NaN, -0.0 and +0.0 compare as what they are)."""
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _subtract(weight: torch.Tensor, factors: list[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
    for offset, b, a in factors:
        weight.narrow(0, offset, b.shape[0]).addmm_(b, a, alpha=-1)


def merge_slot_delta(weight: torch.Tensor, buffers: LoRASlotBuffers, slot: int, max_fixups: int) -> MergeUndo | None:
    """add_slot_delta, keeping what remove_slot_delta needs to give the base weight back bit for bit; None,
    with the weight untouched, where more than max_fixups elements would need their base value kept.
    Reads the fixup count back to the host (one sync)."""
    if not weight.is_contiguous():
        raise LoRAConfigError(f"{buffers.spec.name}: a merge keeps flat indices into the weight: it must be contiguous")
    base = weight.clone()
    merged = torch.empty_like(weight)
    add_slot_delta(merged, buffers, slot, base=base)  # checks the buffers and shapes first
    a_all, b_all = buffers.lora_a[:, slot], buffers.lora_b[slot]
    factors, offset = [], 0
    for index, width in enumerate(buffers.output_slices):
        factors.append((offset, b_all.narrow(0, offset, width).to(weight.dtype, copy=True),
                        a_all[index].to(weight.dtype, copy=True)))
        offset += width
    try:
        weight.copy_(merged)
        _subtract(weight, factors)  # what remove_slot_delta will compute, in the same memory
        bad = torch.nonzero((_bits(weight) != _bits(base)).view(-1)).squeeze(1)
        if bad.numel() > max_fixups:
            weight.copy_(base)
            return None
        undo = MergeUndo(factors, bad.to(torch.int32), base.view(-1)[bad])
    except BaseException:  # also where an allocation fails
        weight.copy_(base)
        raise
    weight.copy_(merged)
    return undo


def remove_slot_delta(weight: torch.Tensor, undo: MergeUndo) -> None:
    """The base weight back, bit for bit, from a weight that merge_slot_delta merged (and nothing since)."""
    _subtract(weight, undo.factors)
    weight.view(-1).index_put_((undo.fix_index,), undo.fix_value)
