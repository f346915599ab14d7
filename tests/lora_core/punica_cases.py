"""Shared builders for punica tests and bench/punica_kernels.py: adapter popularity shapes and stacked weights."""

from __future__ import annotations

import math

import torch

POPULARITY = ("identical", "distinct", "uniform", "zipf")


def token_slots(num_tokens: int, num_slots: int, popularity: str, generator: torch.Generator,
                none_fraction: float = 0.0) -> list[int]:
    """Slot per token (-1 = no adapter) for a popularity shape.

    identical: every token the same adapter; distinct: each token its own
    (up to num_slots); uniform: sqrt(T) adapters drawn uniformly; zipf: slot k
    drawn with weight 1/(k+1)^1.5.
    """
    if popularity == "identical":
        slots = [0] * num_tokens
    elif popularity == "distinct":
        slots = [i % num_slots for i in range(num_tokens)]
    elif popularity == "uniform":
        k = max(1, min(num_slots, round(math.sqrt(num_tokens))))
        slots = torch.randint(0, k, (num_tokens,), generator=generator).tolist()
    elif popularity == "zipf":
        weights = torch.tensor([1.0 / (k + 1) ** 1.5 for k in range(num_slots)])
        slots = torch.multinomial(weights, num_tokens, replacement=True, generator=generator).tolist()
    else:
        raise ValueError(popularity)
    if none_fraction:
        drop = torch.rand(num_tokens, generator=generator) < none_fraction
        slots = [-1 if d else s for s, d in zip(slots, drop.tolist())]
    return slots


def stacked_weights(num_slots: int, max_rank: int, hidden: int, output_slices: tuple[int, ...],
                    ranks: list[int], dtype: torch.dtype, device, generator: torch.Generator):
    """Random slot buffers in the LoRASlotBuffers layout; rows/cols past each slot's rank are zero."""
    num_slices = len(output_slices)
    a = torch.randn(num_slices, num_slots, max_rank, hidden, generator=generator) / math.sqrt(hidden)
    b = torch.randn(num_slots, sum(output_slices), max_rank, generator=generator) / math.sqrt(max_rank)
    rank_table = torch.zeros(num_slices, num_slots, dtype=torch.int32)
    for slot in range(num_slots):
        r = ranks[slot % len(ranks)]
        rank_table[:, slot] = r
        a[:, slot, r:] = 0
        b[slot, :, r:] = 0
    return a.to(device, dtype), b.to(device, dtype), rank_table.to(device)


def lora_linear_both(mapping, ids: list[int], x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, y0: torch.Tensor,
                     slices: tuple[int, ...], ranks: torch.Tensor, scale: float = 0.5, max_tokens: int = 16):
    """add_lora_linear of the same step through the torch reference (float32) and the Triton backend:
    (want [float32], got [y0's dtype], the Triton wrapper, for its metadata)."""
    from lora_core.punica import PunicaWrapper

    want, got = y0.float().clone(), y0.clone()
    wrappers = [PunicaWrapper(max_tokens, len(ids), x.device, backend=backend) for backend in ("torch", "triton")]
    for w, out, args in zip(wrappers, (want, got), ((x.float(), a.float(), b.float()), (x, a, b))):
        w.update_metadata(mapping, ids)
        w.add_lora_linear(out, *args, None, scale, slices, ranks)
    return want, got, wrappers[1]
