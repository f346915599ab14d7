"""LoRAOverlap: a layer's LoRA runs on a side stream while its base GEMM runs (experimental, off by default).

In a decode step the LoRA shrink + expand of a layer take 10-20 us each on an
H200 although they read little: they are latency-bound, and each sits on the
critical path after the base GEMM (bench/RESULTS.md, third session). Here the
LoRA output goes into a float32 workspace on a side stream, forked before the
base GEMM and joined after it, so it overlaps the GEMM; the critical path keeps
one add:

    side:  zero(delta); delta += LoRA(x)       (shrink, expand)
    main:  y = x @ W^T                          (base GEMM, concurrently)
    main:  wait(side); y += delta               (bf16(y + delta), as the expand rounded)

delta is exactly the expand's float32 sum (it starts at zero), so y is the
same bits as with the LoRA added in place. Steps of more than max_tokens rows
(prefill) take the in-place path: their GEMMs are compute-bound and long, and
the workspace would have to grow with them. On CPU there is no stream and the
same sequence runs in order (what the CPU tests check).

Captured in a CUDA graph, the fork and join become graph edges. The workspace
is shared by all layers: each layer's side-stream work starts after the
previous layer's join on the main stream, so they never overlap each other.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch


class LoRAOverlap:
    def __init__(self, device: torch.device | str, max_tokens: int, max_width: int) -> None:
        self.device = torch.device(device)
        self.max_tokens = max_tokens
        self.max_width = max_width
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._delta = torch.empty(max_tokens * max_width, dtype=torch.float32, device=self.device)

    def applies(self, num_tokens: int, width: int) -> bool:
        return 0 < num_tokens <= self.max_tokens and width <= self.max_width

    def run(self, x: torch.Tensor, width: int, base: Callable[[torch.Tensor], torch.Tensor],
            lora_into: Callable[[torch.Tensor], None]) -> torch.Tensor:
        """y = base(x) + LoRA, where lora_into(delta [T, width] fp32) adds the LoRA output to delta."""
        delta = self._delta[: x.shape[0] * width].view(x.shape[0], width)
        main = torch.cuda.current_stream(self.device) if self.stream is not None else None
        if main is not None:
            self.stream.wait_stream(main)  # x (and the previous layer's use of delta) are done
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            delta.zero_()
            lora_into(delta)
        y = base(x)
        if main is not None:
            main.wait_stream(self.stream)
        return y.add_(delta)
