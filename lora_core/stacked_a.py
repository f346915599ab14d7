"""Stacked A: a linear layer's LoRA A slots kept as extra rows under its base weight, so that one GEMM
computes the base output and the shrink of every slot below a bound.

    W_stacked [out + L*S*R, in] = [ W ; A[slot 0][slice 0] ; A[0][1] ; ... ; A[L-1][S-1] ]
    x @ W_stacked[:out + bound*S*R]^T = [ y | s[slot 0] | ... | s[slot bound-1] ]     (each s: [S, R])

Why: at decode sizes a LoRA site's shrink is a latency-bound kernel of its own (3-6 us on an H200; an 8B
decode step runs 128 sites) while its bytes are a few percent of the GEMM's, which streams the base
weight anyway. The expand then reads each row's slot columns of the GEMM's output (PunicaWrapper.
add_expand_stacked; torch_ops.gather_shrunk and triton_ops.use_bgmv_stacked are its backends' parts).
The GEMM covers the slots below the step's slot bound (its highest slot in use, rounded up to a power of
four, so that few CUDA graphs cover every step); slots past the bound cost nothing, idle ones below it
their A bytes. Large steps (prompts) keep the shrink kernel, which reads only the rows' own
adapters: there the GEMM's FLOPs for every slot would count. bench/RESULTS.md measures both.

The A rows are what LoRAModelManager holds as those modules' ``lora_a`` (a [S, L, R, in] view); the
manager's arena then keeps the rest of each slot (slot_layout.SlotLayout.arena_bytes).
"""

from __future__ import annotations

import torch

from lora_core.errors import LoRAConfigError
from lora_core.slot_layout import SlotLayout

# Idle slots below a step's bound cost the GEMM their A rows. Past about this many idle rank rows per slice
# (40 rank-16 slots, 10 rank-64 ones) reading them takes longer than the shrink kernel they replace: on an
# H200 a rank-64 step of 8 rows over 5 adapters in slots up to 31 ran its qkv LoRA in 20.1 us stacked
# against 14.3 us with the shrink kernel, while rank 16 broke even there (bench/lora_site.py, RESULTS.md).
IDLE_RANK_ROWS = 640


def max_idle_slots(max_rank: int) -> int:
    """Idle slots below the bound a stacked step may carry (PunicaWrapper(stacked_max_idle_slots=...))."""
    return max(1, IDLE_RANK_ROWS // max_rank)


def stack_weight(weight: torch.Tensor, num_slots: int, num_slices: int, rank: int) -> torch.Tensor:
    """A new [out + num_slots*num_slices*rank, in] tensor: ``weight``'s rows, then zeroed A rows."""
    out, width = weight.shape
    stacked = torch.zeros(out + num_slots * num_slices * rank, width, dtype=weight.dtype, device=weight.device)
    stacked[:out].copy_(weight)
    return stacked


def stack_bias(bias: torch.Tensor | None, stacked: torch.Tensor) -> torch.Tensor | None:
    """The base bias zero-padded to the stacked weight's rows (the A rows have no bias), or None."""
    if bias is None:
        return None
    out = torch.zeros(stacked.shape[0], dtype=bias.dtype, device=bias.device)
    out[:bias.shape[0]].copy_(bias)
    return out


def a_rows(stacked: torch.Tensor, out: int, num_slots: int, num_slices: int, rank: int) -> torch.Tensor:
    """The A rows of a stacked weight as LoRAModelManager takes them: [num_slots, S, R, in] (a view)."""
    return stacked[out:].view(num_slots, num_slices, rank, stacked.shape[1])


def check_stacked_a(stacked_a: dict[str, torch.Tensor], layout: SlotLayout, num_slots: int,
                    device: torch.device) -> dict[str, torch.Tensor]:
    """stacked_a as LoRAModelManager keeps it, after checking that it covers every linear module of the
    layout (their A rows are the last regions of a slot image) with the slots' shape, dtype and device."""
    if set(stacked_a) != set(layout.a_last):
        missing, extra = sorted(layout.a_last - set(stacked_a)), sorted(set(stacked_a) - layout.a_last)
        raise LoRAConfigError(f"stacked A rows must cover every linear LoRA module: missing {missing}, "
                              f"not linear or unknown {extra}")
    for name, rows in stacked_a.items():
        want = (num_slots, *layout.a_shape(name))
        elsewhere = rows.device.type != device.type or device.index not in (None, rows.device.index)
        if tuple(rows.shape) != want or rows.dtype != layout.dtype or elsewhere:
            raise LoRAConfigError(f"{name}: stacked A rows are {rows.dtype} {tuple(rows.shape)} on {rows.device}, "
                                  f"the slots need {layout.dtype} {want} on {device}")
        if not rows[0].is_contiguous():
            raise LoRAConfigError(f"{name}: each slot's stacked A rows must be contiguous")
    return dict(stacked_a)
