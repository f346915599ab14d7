"""One GPU slot's adapter folded into a linear layer's base weight: W [out, in] += B [out, r] @ A [r, in].

The serving engine merges an adapter into the base weights while every row of
its steps uses that one adapter (replicas/lora_merge.py), so those steps run
no LoRA kernel at all. This is the arithmetic only: it reads the slot as the
kernels do (LoRASlotBuffers: the scaling already folded into B, zeros past the
adapter's rank, so the padded rank adds nothing) and knows no model.

Taking the delta back out must give the base weight bit for bit, or every
switch would leave it a little further off. W + BA rounded, minus BA rounded,
is W again for most elements but not all (where the sum crossed into a larger
binade, or the delta dwarfs the weight). So the delta is computed one way
only, each element in float32 from the factors in a fixed order, and a merge
first runs the removal in registers (count_fixups, reading the weight only),
then writes W + BA and keeps W's value where the removal would not restore it
(apply_merge): a few bytes per such element, where a copy of the weights costs
two per element. On the GPU one Triton kernel does all three passes
(merge_kernel.py: 3 passes over the weights a merge, 2 an unmerge); elsewhere
the plain-torch reference below, whose products and sums each round alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lora_core.errors import LoRAConfigError
from lora_core.module_spec import LoRAKind
from lora_core.slot_buffers import LoRASlotBuffers

Factor = tuple[int, torch.Tensor, torch.Tensor]  # (first row of the slice, B [width, R], A [R, in])


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


def slot_factors(weight: torch.Tensor, buffers: LoRASlotBuffers, slot: int) -> list[Factor]:
    """Private copies of the factors of the adapter in ``slot``, per output slice of ``weight`` [sum(output_slices),
    in] (this rank's, as torch's Linear holds it), so that a slot reused while the adapter is merged changes
    nothing."""
    check_mergeable(buffers)
    a, b = buffers.lora_a[:, slot], buffers.lora_b[slot]  # [S, R, in], [out, R]
    if weight.shape != (b.shape[0], a.shape[-1]):
        raise LoRAConfigError(f"{buffers.spec.name}: weight {tuple(weight.shape)} does not match the slots' "
                              f"[{b.shape[0]}, {a.shape[-1]}]")
    if not weight.is_contiguous():
        raise LoRAConfigError(f"{buffers.spec.name}: a merge keeps flat indices into the weight: it must be contiguous")
    factors, offset = [], 0
    for index, width in enumerate(buffers.output_slices):  # contiguous: the kernel reads rows of R and of in
        factors.append((offset, b.narrow(0, offset, width).clone(memory_format=torch.contiguous_format),
                        a[index].clone(memory_format=torch.contiguous_format)))
        offset += width
    return factors


@dataclass
class MergeUndo:
    """What takes a merged slot's delta back out of one weight: the delta's factors per output slice, and the
    base values of the elements the subtraction does not restore."""

    factors: list[Factor]
    fix_index: torch.Tensor  # int32 [n], flat indices into the weight
    fix_value: torch.Tensor  # [n], the base weight there

    @property
    def fixups(self) -> int:
        return self.fix_index.numel()

    @property
    def nbytes(self) -> int:
        tensors = [t for _, b, a in self.factors for t in (b, a)] + [self.fix_index, self.fix_value]
        return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class FixupCount:
    """count_fixups' answer for one weight, on the device: ``total`` (an int tensor) and, for the kernel, each
    tile's count, slice after slice (where each tile's fixups go)."""

    total: torch.Tensor
    tiles: torch.Tensor | None = None


def _use_kernel(weight: torch.Tensor) -> bool:
    return weight.is_cuda


def count_fixups(weight: torch.Tensor, factors: list[Factor]) -> FixupCount:
    """How many base values a merge of these factors must keep, without writing the weight or syncing."""
    if _use_kernel(weight):
        from lora_core import merge_kernel
        return merge_kernel.count_fixups(weight, factors)
    total = torch.zeros((), dtype=torch.int64, device=weight.device)
    for _, _, differs in _reference_passes(weight, factors):
        total += differs.sum()
    return FixupCount(total)


def allocate_undo(weight: torch.Tensor, factors: list[Factor], fixups: int) -> MergeUndo:
    """The undo for ``fixups`` base values (count_fixups' total), allocated before anything is written (an
    allocation that fails leaves the weight as it was)."""
    return MergeUndo(factors, torch.empty(fixups, dtype=torch.int32, device=weight.device),
                     torch.empty(fixups, dtype=weight.dtype, device=weight.device))


def apply_merge(weight: torch.Tensor, count: FixupCount, undo: MergeUndo) -> None:
    """weight = weight + the factors' delta, rounded once into its dtype, filling undo's base values."""
    if _use_kernel(weight):
        from lora_core import merge_kernel
        merge_kernel.apply_merge(weight, count, undo)
        return
    flat, found = weight.view(-1), 0
    for offset, merged, differs in _reference_passes(weight, undo.factors):
        index = torch.nonzero(differs.view(-1)).squeeze(1) + offset * weight.shape[1]
        undo.fix_index[found:found + index.numel()] = index.to(torch.int32)
        undo.fix_value[found:found + index.numel()] = flat[index]
        found += index.numel()
        weight.narrow(0, offset, merged.shape[0]).copy_(merged)
    if found != undo.fixups:
        raise RuntimeError(f"a merge found {found} base values to keep where its count said {undo.fixups}")


def remove_merge(weight: torch.Tensor, undo: MergeUndo) -> None:
    """The base weight back, bit for bit, from a weight that apply_merge merged (and nothing since)."""
    if _use_kernel(weight):
        from lora_core import merge_kernel
        merge_kernel.remove_delta(weight, undo.factors)
    else:
        for offset, b, a in undo.factors:
            rows = weight.narrow(0, offset, b.shape[0])
            rows.copy_((rows.float() - _reference_delta(b, a)).to(weight.dtype))
    weight.view(-1).index_put_((undo.fix_index.long(),), undo.fix_value)


def _reference_delta(b: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """B A in float32, one rank row at a time, each product and each sum rounded alone: elementwise ops, so a
    merge and its unmerge get the same bits wherever the tensors lie (a GEMM's blocking may depend on that)."""
    delta = torch.zeros(b.shape[0], a.shape[1], dtype=torch.float32, device=b.device)
    for k in range(b.shape[1]):
        delta += b[:, k, None].float() * a[k, None, :].float()
    return delta


def _reference_passes(weight: torch.Tensor, factors: list[Factor]):
    """Per slice: (first row, the merged rows, where the removal would not give the base value back)."""
    for offset, b, a in factors:
        rows = weight.narrow(0, offset, b.shape[0])
        delta = _reference_delta(b, a)
        merged = (rows.float() + delta).to(weight.dtype)
        back = (merged.float() - delta).to(weight.dtype)
        yield offset, merged, _bits(back) != _bits(rows)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """t's bits as integers of its width (so NaN, -0.0 and +0.0 compare as what they are)."""
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
