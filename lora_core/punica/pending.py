"""An expand left to the pointwise op after a LoRA layer, which adds it to y as it reads y.

A stacked step (lora_core/stacked_a.py) leaves every slot's shrink in the
columns beside the base output, so what remains of the LoRA is the expand:
y[t] += shrunk[t, slot(t)'s columns] @ B[slot(t)]^T. As its own kernel, that
expand is one more dependent launch per LoRA site of a decode step, whose few
microseconds are latency (load the slot, then B and the shrink, then y, store;
the next kernel loads y again), not bytes. The ops that read gate_up_proj's and
qkv_proj's outputs next are pointwise kernels with many programs per row
(SiluAndMul; the rotary embedding, which also writes v's part in place), so
they add the expand themselves (replicas.kernels.fused.silu_and_mul,
replicas.kernels.lora_rotary, from what a PendingExpand holds). So does the
add + RMSNorm after o_proj and down_proj (replicas.kernels.lora_norm), whose
norm needs whole rows: its programs take column chunks as the expand kernel
does and meet per row through PunicaWrapper.arrival_workspace (a first version
with one program per row streamed each row's whole B and ran slower;
bench/pending_expand.py). `apply()` is the same
expand into y as a kernel of its own, for every consumer that cannot fuse it
(and the CPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from lora_core.punica.wrapper import PunicaWrapper


@dataclass(frozen=True)
class PendingExpand:
    """y [T, sum(output_slices)] += per slice k: shrunk[t, slot's slice k] @ lora_b[slot, slice k]^T, not yet run.

    y: the layer's output it is owed to (consumers may get views of it); shrunk [T, >= bound * S * R]: the
    stacked GEMM's shrink columns, slot-major, R = lora_b.shape[2] columns per slice; lora_b [L, sum(n_k), R];
    ranks [S, L] (columns past a slot's rank, rounded up to triton_kernels.RANK_MASK_GROUP, are never read); the
    step's slot per row is the PunicaWrapper's token metadata, so a PendingExpand is good for the step that made
    it only.
    """
    punica: PunicaWrapper
    y: torch.Tensor
    shrunk: torch.Tensor
    lora_b: torch.Tensor
    output_slices: tuple[int, ...]
    ranks: torch.Tensor

    @property
    def slots(self) -> torch.Tensor:
        """[T] int32, -1 for a row without an adapter."""
        return self.punica.token_meta.slots

    @property
    def slice_rank(self) -> int:
        """R: the shrink columns of one slice of one slot."""
        return self.lora_b.shape[2]

    def apply(self) -> None:
        """Run the expand into y in place, as a kernel of its own (PunicaWrapper.add_expand_stacked)."""
        self.punica.add_expand_stacked(self.y, self.shrunk, self.lora_b, self.output_slices, self.ranks)

    def fusable(self, widths: tuple[int, ...]) -> bool:
        """Whether a fused consumer of slices of these widths can take this expand: its slices, and the layouts
        its kernel indexes (unit stride along the shrink's columns and along B's rank)."""
        return (tuple(self.output_slices) == tuple(widths) and self.shrunk.stride(1) == 1
                and self.lora_b.stride(2) == 1 and self.shrunk.dtype == self.lora_b.dtype)

    def splits_y(self, parts: tuple[torch.Tensor, ...]) -> bool:
        """Whether parts are y's column blocks, in order and covering it (as y.split(output_slices, -1) gives):
        what a consumer of views of y must hand over, so that apply() reaches them."""
        y, col = self.y, 0
        for t in parts:
            if t.dim() != y.dim() or t.stride() != y.stride() or t.shape[:-1] != y.shape[:-1] \
                    or t.data_ptr() != y.data_ptr() + col * y.stride(-1) * y.element_size():
                return False
            col += t.shape[-1]
        return col == y.shape[-1]

    def kernel_args(self) -> tuple:
        """(slots, shrunk, lora_b, ranks, shrunk row stride, shrunk slot stride, B slot stride, B row stride,
        ranks slice stride, R): what a fused kernel's row_slot / row_expand read."""
        s, b = self.shrunk, self.lora_b
        per_slot = len(self.output_slices) * self.slice_rank
        return (self.slots, s, b, self.ranks, s.stride(0), per_slot * s.stride(1), b.stride(0), b.stride(1),
                self.ranks.stride(0), self.slice_rank)
