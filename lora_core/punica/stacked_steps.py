"""PunicaWrapper's stacked-step half: what a step whose shrink ran in the base GEMM needs (stacked_a.py).

A stacked step's GEMMs cover the A rows of the slots below its slot bound, so each site's LoRA is left
with the expand: add_expand_stacked runs it (the column expand, column_expand.py, or the tile expand,
triton_ops), pending_expand hands it to the pointwise op after the layer (pending.py), and small steps of
few adapters run base GEMM, shrink and expand in one launch (add_lora_gemm, lora_gemm.py). Which of these
a step takes is a host decision, part of its CUDA-graph key (_stacked_key).
"""

from __future__ import annotations

import torch

from lora_core.punica import torch_ops
from lora_core.punica.metadata import adapter_bound
from lora_core.punica.pending import PendingExpand


class StackedSteps:
    """Needs PunicaWrapper's token_meta, max_loras, backend, device, use_pdl, stacked_max_tokens,
    stacked_max_idle_slots, fused_max_tokens, fused_max_adapters, pending_max_tokens, pending_min_adapters,
    _triton, _column, _lora_gemms, _arrivals, _retired, _rows, _offsets and _check_slices."""

    def _stacks(self, num_rows: int, num_adapters: int, slot_bound: int) -> bool:
        return (0 < num_adapters and num_rows <= self.stacked_max_tokens
                and slot_bound - num_adapters <= self.stacked_max_idle_slots)

    def _fused(self, num_rows: int, num_adapters: int, slot_bound: int) -> int:
        """Phase-A programs of a step whose sites run in one launch (lora_gemm.py): its adapter bound (a power of
        four, so few kernel variants and graphs cover every step); 0 when it runs the stacked path."""
        if num_rows > self.fused_max_tokens or not self._stacks(num_rows, num_adapters, slot_bound):
            return 0
        bound = adapter_bound(num_adapters, self.max_loras)
        return bound if bound <= self.fused_max_adapters else 0

    def _stacked_key(self, num_rows: int, num_adapters: int, slot_bound: int) -> tuple:
        if not self._stacks(num_rows, num_adapters, slot_bound):
            return ()
        fused = self._fused(num_rows, num_adapters, slot_bound)
        return (slot_bound, fused) if fused else (slot_bound,)

    def stacked_rows(self) -> int | None:
        """Slots whose stacked A rows this step's GEMMs cover (its slot bound), or None: the step is too
        large, has no adapter or too many idle slots below its bound, and stacked layers run the shrink
        kernel instead."""
        t = self.token_meta
        return t.slot_bound if self._stacks(t.num_rows, t.num_adapters, t.slot_bound) else None

    def add_lora_gemm(self, x: torch.Tensor, weight: torch.Tensor, a_rows: torch.Tensor, lora_b: torch.Tensor,
                      output_slices: tuple[int, ...]) -> torch.Tensor | None:
        """x @ weight^T plus each row's LoRA in one launch (lora_core/punica/lora_gemm.py), or None when this
        step or this site's shape is not for it (the caller then runs the stacked path).

        weight [N, K] (a stacked weight's base rows), a_rows [L, S, R, K] (its A rows), lora_b [L, N, R].
        """
        t = self.token_meta
        maxa = self._fused(t.num_rows, t.num_adapters, t.slot_bound)
        if not maxa:
            return None
        num_slots, num_slices, rank, k = a_rows.shape
        n = weight.shape[0]
        key = (n, k, tuple(output_slices), rank)
        if key not in self._lora_gemms:
            from lora_core.punica import lora_gemm  # triton is optional off Linux

            cfg = lora_gemm.tiling(n, k, tuple(output_slices), rank)
            self._lora_gemms[key] = cfg and lora_gemm.LoRAGemm(
                n, k, tuple(output_slices), rank, self.fused_max_tokens, self.fused_max_adapters, self.device, **cfg)
        gemm = self._lora_gemms[key]
        if gemm is None:
            return None
        x = self._rows(x, t)
        x = x if x.stride(-1) == 1 else x.contiguous()
        y = torch.empty(t.num_rows, n, dtype=x.dtype, device=x.device)
        gemm(y, x, weight, a_rows.view(num_slots, num_slices * rank, k), lora_b, t.slots, t.row_active, t.active,
             t.num_active, max_active=maxa)
        return y

    def add_expand_stacked(self, y: torch.Tensor, shrunk: torch.Tensor, lora_b_stacked: torch.Tensor,
                           output_slices: tuple[int, ...], ranks: torch.Tensor,
                           lora_bias_stacked: torch.Tensor | None = None) -> None:
        """y [T, sum(n_k)] += per slice k: shrunk[t, slot's slice k] @ B[slot, slice k]^T (+ bias).

        shrunk [T, >= slot_bound * S * R] is every slot's shrink as a stacked GEMM wrote it, slot-major
        (lora_core/stacked_a.py): the expand reads each row's own slot's columns of it.
        """
        meta = self.token_meta
        num_slices, rank = len(output_slices), lora_b_stacked.shape[2]
        self._check_slices(lora_b_stacked, output_slices, num_slices)
        if shrunk.shape[0] != meta.num_rows or shrunk.shape[1] < meta.slot_bound * num_slices * rank:
            raise ValueError(f"shrunk {tuple(shrunk.shape)} does not hold {meta.num_rows} rows of "
                             f"{meta.slot_bound} slots x {num_slices} slices x rank {rank}")
        if self.backend == "torch":
            buf = torch_ops.gather_shrunk(shrunk, meta.slots, num_slices, rank)
            torch_ops.expand(y, buf, lora_b_stacked, meta.slots, ranks, tuple(output_slices), 0, lora_bias_stacked)
            return
        if meta.num_rows == 0:
            return
        tile_bgmv = self._triton.use_bgmv_stacked(meta, lora_b_stacked.shape[1], rank)
        if (lora_bias_stacked is None and y.stride(1) == 1 and shrunk.stride(1) == 1
                and self._column.use_column_expand(meta.num_rows, meta.slot_bound, lora_b_stacked.shape[1], rank,
                                                    tile_bgmv)):
            self._column.column_expand(y, shrunk, lora_b_stacked, self._offsets(output_slices),
                                       max(output_slices), num_slices, meta.slots, meta.num_rows, meta.slot_bound,
                                       use_pdl=self.use_pdl)
            return
        col = shrunk.stride(1)
        buf = shrunk.as_strided((1, num_slices, meta.num_rows, rank), (0, rank * col, shrunk.stride(0), col))
        self._triton.expand(y, buf, lora_b_stacked, ranks, self._offsets(output_slices), max(output_slices),
                            meta, 0, lora_bias_stacked, add_inputs=True, use_pdl=self.use_pdl,
                            buf_slot_stride=num_slices * rank * col, one_tile=True, bgmv=True if tile_bgmv else None)

    def pending_expand(self, y: torch.Tensor, shrunk: torch.Tensor, lora_b_stacked: torch.Tensor,
                       output_slices: tuple[int, ...], ranks: torch.Tensor,
                       lora_bias_stacked: torch.Tensor | None = None) -> PendingExpand | None:
        """add_expand_stacked's arguments as a PendingExpand for the op after the layer to add (pending.py),
        or None where this step runs the expand itself: more rows than pending_max_tokens, an adapter bound
        (what the step's CUDA graph key holds of its adapter count) under pending_min_adapters, or a LoRA bias."""
        t = self.token_meta
        if (lora_bias_stacked is not None or not 0 < t.num_rows <= self.pending_max_tokens
                or adapter_bound(t.num_adapters, self.max_loras) < self.pending_min_adapters):
            return None
        return PendingExpand(self, y, shrunk, lora_b_stacked, tuple(output_slices), ranks)

    def arrival_workspace(self, rows: int, parts: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(int32 counters [rows], contiguous fp32 partials [rows, parts]) for a fused consumer of a PendingExpand
        whose programs of one row meet: each stores a partial and counts itself in, the last to arrive reads them
        all and sets the counter back to zero. One pair serves every layer (launches in stream order never
        overlap); it grows only during warm-up, zeroed, and outgrown pairs stay alive for graphs that hold them."""
        counters, partials = self._arrivals
        if counters.numel() < rows or partials.numel() < rows * parts:
            self._retired.extend(self._arrivals)
            self._arrivals = (torch.zeros(max(rows, counters.numel()), dtype=torch.int32, device=self.device),
                              torch.empty(max(rows * parts, partials.numel()), dtype=torch.float32,
                                          device=self.device))
            counters, partials = self._arrivals
        return counters[:rows], partials[:rows * parts].view(rows, parts)
