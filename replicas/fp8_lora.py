"""Stacked A rows under FP8 base weights: the decode steps' LoRA shrink inside the FP8 GEMM (opt-in).

Over bfloat16 weights a stacked step computes the base output and every slot's shrink in one GEMM
(lora_core/stacked_a.py). Over FP8 weights (replicas/quantization.py) the GEMM multiplies float8 inputs by
float8 rows, so A's rows join it quantized as the weights are: each rank row of each slot in float8 e4m3 with
its own scale, which the GEMM's epilogue applies as it applies a weight row's. The shrink then reads the
input as quantized per token for the base product, and a decode step runs no shrink kernel (bench/engine.py,
8B on an H200: one adapter's decode step over FP8 weights ran each site's shrink and expand, 1.07 ms more
than no adapter; bench/RESULTS.md measures this path against it).

What changes numerically: the shrink's products are FP8's, as the base layer's are (an e4m3 step is 1/16 of
a value; the products' sum errs about as the base output's does), where the unstacked path reads bfloat16
A and the unquantized input. So it is asked for by name (EngineArgs.lora_stacked_max_tokens with
quantization="fp8"); prompt steps past that many rows run the unstacked path. The tests check the engine
against transformers + PEFT whose base layers and lora_A layers compute these same FP8 products.

Where the rows come from: LoRAModelManager keeps every slot's A in the model's dtype in its arena (the
prompt steps' shrink kernel reads them there), and calls FP8ARows with a slot's index each time it writes
one (an install or a compaction move), on the stream that wrote it: FP8ARows quantizes the slot's A rows of
every linear module into the stacked weights' rows and scales, in one launch on CUDA (kernels.fp8.QuantizeTables).
Under tensor parallelism a row-parallel layer's ranks hold parts of each A row, and each quantizes its own part
(as each quantizes its part of the input).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from replicas.quantization import quantize_rows_into

if TYPE_CHECKING:
    from lora_core.model_manager import LoRAModelManager
    from replicas.lora_layers import StackedWeight


def stack_scales(base: nn.Module, stacked_rows: int) -> torch.Tensor:
    """A quantized layer's weight_scale padded with ones to its stacked weight's rows (the A rows' scales
    until a slot is written); the layer keeps a view of its own rows."""
    own = base.weight_scale
    scales = torch.ones(stacked_rows, dtype=torch.float32, device=own.device)
    scales[:own.shape[0]].copy_(own)
    view = scales[:own.shape[0]]
    if isinstance(own, nn.Parameter):  # an FP8 checkpoint's, loaded as a parameter (fp8_checkpoint.py)
        base.weight_scale = nn.Parameter(view, requires_grad=False)
    else:
        base.weight_scale = view
    return scales


class FP8ARows:
    """LoRAModelManager.on_slot_write for stacked FP8 weights: a slot's A rows (the manager's, in the model's
    dtype) quantized per rank row into each stacked weight's rows of that slot and their scales."""

    def __init__(self, manager: "LoRAModelManager", stacked: dict[str, "StackedWeight"]) -> None:
        # per linear module: (its A slots [L, S * R, in] (each slot's rows contiguous in its image), the stacked
        # FP8 rows [L, S * R, in], their scales [L, S * R])
        self.parts = [(manager.buffers(name).lora_a.transpose(0, 1).flatten(1, 2),
                       st.weight[st.out:].view(-1, st.per_slot, st.weight.shape[1]),
                       st.scale[st.out:].view(-1, st.per_slot)) for name, st in stacked.items()]
        self.tables = None
        if manager.device.type == "cuda":
            from replicas.kernels.fp8 import QuantizeTables  # triton: CUDA only here

            self.tables = QuantizeTables(self.parts)

    def __call__(self, slot: int) -> None:
        if self.tables is not None:
            self.tables(slot)
            return
        for a, rows, scales in self.parts:
            quantize_rows_into(a[slot], rows[slot], scales[slot])
