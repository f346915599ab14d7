"""SlotCopies: an adapter's tensors written into its slot image in a few torch calls, not one or two per tensor."""

from __future__ import annotations

import math

import torch


class SlotCopies:
    """dst = src * scale for many small tensors with disjoint dsts, in a few torch calls (an 8B adapter has ~450):
    each call gives the GIL up and takes it back, and a load on a thread beside the engine's steps may wait for
    the GIL at every one of them (replicas/gil.py). As LoRALayerWeights.optimize, the product is the exact one
    rounded once into the slot's dtype. A copy then an in-place multiply by a power of two (alpha = 2r, rsLoRA's
    16 / sqrt(16), ...) gives that wherever the dtypes match; any other scale, or a change of dtype, multiplies
    into the slot tensor by tensor (torch's batched multiply rounds the scale to the tensor's dtype first)."""

    def __init__(self) -> None:
        self._copy: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        self._scale: dict[float, list[torch.Tensor]] = {}
        self._across: list[tuple[torch.Tensor, torch.Tensor, float]] = []

    def add(self, dst: torch.Tensor, src: torch.Tensor, scale: float) -> None:
        if scale != 1.0 and (src.dtype != dst.dtype or math.frexp(scale)[0] != 0.5):
            self._across.append((dst, src, scale))
            return
        self._copy[0].append(dst)
        self._copy[1].append(src)
        if scale != 1.0:
            self._scale.setdefault(scale, []).append(dst)

    def run(self) -> None:
        batched = hasattr(torch, "_foreach_copy_") and hasattr(torch, "_foreach_mul_")  # private, since torch 2.1
        if batched and self._copy[0]:
            torch._foreach_copy_(*self._copy)  # one call: on CPU it runs each tensor's copy_
        elif self._copy[0]:
            for dst, src in zip(*self._copy):
                dst.copy_(src)
        for scale, dsts in self._scale.items():
            if batched:
                torch._foreach_mul_(dsts, scale)
            else:
                for dst in dsts:
                    dst.mul_(scale)
        for dst, src, scale in self._across:
            torch.mul(src, scale, out=dst)
