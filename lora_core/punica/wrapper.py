"""PunicaWrapper: the multi-LoRA ops every LoRA layer calls, with metadata shared per step.

    wrapper.update_metadata(mapping, manager.lora_index_to_id, max_loras)   # once per step
    wrapper.add_lora_linear(y, x, a, b, output_slices=(q, kv, kv))           # every layer

Slot -1 (a token whose lora id is 0) means "no adapter": such rows of y are
left untouched. Two backends with one signature: "triton" (GPU; on CPU only
under TRITON_INTERPRET=1, for tests) and "torch" (the reference, and the CPU
path). Stacked-weight layouts are those of lora_core.slot_buffers. Steps of
up to bgmv_max_tokens rows (decode) run one-token-per-program BGMV kernels;
larger ones, and steps where adapters are shared by more than two tokens on
average, run slot-sorted SGMV tiles (the choice is made on the host from the
LoRAMapping, so it never syncs; a CUDA graph is captured per choice).
Steps whose shrink ran in the base GEMM take the ops of stacked_steps.py;
warm-up's synthetic steps come from layouts.py.
"""

from __future__ import annotations

from typing import Sequence

import torch

from lora_core.errors import UnknownLoRAError
from lora_core.mapping import LoRAMapping
from lora_core.punica import torch_ops
from lora_core.punica.layouts import StepLayouts
from lora_core.punica.metadata import PunicaMetadata, adapter_bound
from lora_core.punica.stacked_steps import StackedSteps

BACKENDS = ("auto", "triton", "torch")


class PunicaWrapper(StepLayouts, StackedSteps):
    def __init__(self, max_num_tokens: int, max_loras: int, device: torch.device | str,
                 max_num_prompts: int | None = None, backend: str = "auto", bgmv_max_tokens: int = 32,
                 use_pdl: bool | None = None, stacked_max_tokens: int = 0,
                 stacked_max_idle_slots: int | None = None, fused_max_adapters: int = 0,
                 fused_max_tokens: int = 32, pending_max_tokens: int = 0, pending_min_adapters: int = 5) -> None:
        """stacked_max_tokens: steps of up to this many token rows compute the shrink of layers with stacked
        A rows in their base GEMM (stacked_rows, add_expand_stacked); larger ones run the shrink kernel, as
        do steps with more than stacked_max_idle_slots unused slots below their slot bound (None: no limit;
        stacked_a.max_idle_slots gives it for a rank). fused_max_adapters: stacked steps of up to
        fused_max_tokens rows whose adapter bound is at most this run each site in one launch instead
        (add_lora_gemm; 0: never). pending_max_tokens, pending_min_adapters: stacked steps of up to that many rows
        whose adapter bound is at least this leave the expands of layers that ask to the op after them
        (pending_expand; 0 rows: never)."""
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.device = torch.device(device)
        if backend == "auto":
            backend = "triton" if self.device.type == "cuda" else "torch"
        self.backend = backend
        if backend == "triton":
            from lora_core.punica import column_expand, triton_ops  # triton is optional off Linux

            self._triton, self._column = triton_ops, column_expand
        # Programmatic dependent launch lets the expand start under the shrink (Hopper+).
        self.use_pdl = (backend == "triton" and self.device.type == "cuda"
                        and triton_ops.pdl_supported(self.device.index or 0)) if use_pdl is None else use_pdl
        self.max_loras = max_loras
        self.stacked_max_tokens = stacked_max_tokens
        self.stacked_max_idle_slots = max_loras if stacked_max_idle_slots is None else stacked_max_idle_slots
        self.fused_max_adapters = fused_max_adapters if backend == "triton" else 0
        self.fused_max_tokens = fused_max_tokens
        self.pending_max_tokens = pending_max_tokens
        self.pending_min_adapters = pending_min_adapters
        self._lora_gemms: dict[tuple, object] = {}  # shape -> lora_gemm.LoRAGemm, or None: no tiling
        self.token_meta = PunicaMetadata(max_num_tokens, max_loras, self.device, bgmv_max_tokens)
        self.sampler_meta = PunicaMetadata(max_num_prompts or max_num_tokens, max_loras, self.device, bgmv_max_tokens)
        self.is_prefill = False
        self._workspace = torch.empty(0, dtype=torch.float32, device=self.device)
        # Outgrown workspaces stay alive: a captured CUDA graph may still write into one.
        self._retired: list[torch.Tensor] = []
        self._arrivals = (torch.empty(0, dtype=torch.int32, device=self.device),
                          torch.empty(0, dtype=torch.float32, device=self.device))
        self._slice_offsets: dict[tuple[int, ...], torch.Tensor] = {}
        self._full_ranks: dict[tuple[int, int, int], torch.Tensor] = {}

    # ---- metadata -------------------------------------------------------------------------

    def update_metadata(self, mapping: LoRAMapping, lora_index_to_id: Sequence[int | None],
                        max_loras: int | None = None, **_: object) -> None:
        """Map this step's lora ids to slots and build the tiles (host work and one copy each, no sync)."""
        if max_loras is not None and max_loras != self.max_loras:
            raise ValueError(f"PunicaWrapper was built for {self.max_loras} slots, not {max_loras}")
        slot_of = {lora_id: slot for slot, lora_id in enumerate(lora_index_to_id) if lora_id is not None}

        def to_slots(ids: tuple[int, ...], what: str) -> tuple[list[int], int, int]:
            try:
                slots = [slot_of[i] if i else -1 for i in ids]
            except KeyError as exc:
                raise UnknownLoRAError(f"LoRAMapping.{what} uses lora id {exc.args[0]}, "
                                       "which holds no GPU slot; activate it first") from None
            bound = adapter_bound(max(slots, default=-1) + 1, self.max_loras)
            return slots, len(set(slots) - {-1}), bound

        self.token_meta.update(*to_slots(mapping.index_mapping, "index_mapping"))
        self.sampler_meta.update(*to_slots(mapping.prompt_mapping, "prompt_mapping"))
        self.is_prefill = mapping.is_prefill

    def launch_key(self) -> tuple:
        """This step's host-side launch parameters (token and sampled-row metadata): a CUDA graph's key."""
        p = self.sampler_meta
        return self.token_launch_key() + p.launch_key(p.num_rows, p.num_adapters)

    def token_launch_key(self) -> tuple:
        """The token rows' part of launch_key: all that a graph of the layers (no LM head) freezes."""
        t = self.token_meta
        return t.launch_key(t.num_rows, t.num_adapters) + self._stacked_key(t.num_rows, t.num_adapters, t.slot_bound)

    # ---- the ops --------------------------------------------------------------------------

    def add_shrink(self, y: torch.Tensor, x: torch.Tensor, lora_a_stacked: torch.Tensor, scale: float,
                   ranks: torch.Tensor | None = None, *, meta: PunicaMetadata | None = None) -> None:
        """y [S, T, R] (fp32) += scale * x [T, H] @ lora_a_stacked [S, L, R, H]^T for each token's slot."""
        meta = meta or self.token_meta
        x = self._rows(x, meta)
        _check_same_dtype(x, lora_a_stacked, "add_shrink")
        ranks = self._ranks(ranks, lora_a_stacked.shape[0], lora_a_stacked.shape[1], lora_a_stacked.shape[2])
        if self.backend == "torch":
            torch_ops.shrink(y, x, lora_a_stacked, meta.slots, ranks, scale)
            return
        block_k, _, _ = self._triton.shrink_config(meta, x.shape[1], lora_a_stacked.shape[0], lora_a_stacked.shape[2])
        self._triton.shrink(y.unsqueeze(0), x, lora_a_stacked, ranks, meta, scale,
                            accumulate=True, split_k=1, block_k=block_k)

    def add_expand(self, y: torch.Tensor, x: torch.Tensor, lora_b_stacked: torch.Tensor,
                   output_slices: tuple[int, ...], offset_start: int = 0, add_inputs: bool = True,
                   ranks: torch.Tensor | None = None, lora_bias_stacked: torch.Tensor | None = None,
                   *, meta: PunicaMetadata | None = None) -> None:
        """y[:, offset_start + slice k] += x[k] @ lora_b_stacked[slot, slice k, :]^T (+ bias).

        x is the shrink buffer [S, T, R]; lora_b_stacked [L, sum(output_slices), R].
        """
        meta = meta or self.token_meta
        self._check_slices(lora_b_stacked, output_slices, x.shape[0])
        ranks = self._ranks(ranks, x.shape[0], lora_b_stacked.shape[0], lora_b_stacked.shape[2])
        if self.backend == "torch":
            torch_ops.expand(y, x, lora_b_stacked, meta.slots, ranks, tuple(output_slices),
                             offset_start, lora_bias_stacked, add_inputs)
            return
        self._triton.expand(y, x.unsqueeze(0) if x.dim() == 3 else x, lora_b_stacked, ranks,
                            self._offsets(output_slices), max(output_slices), meta, offset_start,
                            lora_bias_stacked, add_inputs)

    def add_lora_linear(self, y: torch.Tensor, x: torch.Tensor, lora_a_stacked: torch.Tensor,
                        lora_b_stacked: torch.Tensor, lora_bias_stacked: torch.Tensor | None = None,
                        scale: float = 1.0, output_slices: tuple[int, ...] | None = None,
                        ranks: torch.Tensor | None = None, *, meta: PunicaMetadata | None = None) -> None:
        """y [T, sum(n_k)] += per slice k: (x @ A[k, slot]^T) @ B[slot, slice k]^T * scale (+ bias).

        One shrink launch and one expand launch for all slices (qkv, gate_up).
        """
        meta = meta or self.token_meta
        num_slices, _, rank, _ = lora_a_stacked.shape
        output_slices = tuple(output_slices or (lora_b_stacked.shape[1],))
        x = self._rows(x, meta)
        _check_same_dtype(x, lora_a_stacked, "add_lora_linear")
        self._check_slices(lora_b_stacked, output_slices, num_slices)
        ranks = self._ranks(ranks, num_slices, lora_a_stacked.shape[1], rank)
        if self.backend == "torch":
            buf = torch.zeros(num_slices, meta.num_rows, rank, dtype=torch.float32, device=x.device)
            torch_ops.shrink(buf, x, lora_a_stacked, meta.slots, ranks, scale)
            torch_ops.expand(y, buf, lora_b_stacked, meta.slots, ranks, output_slices, 0, lora_bias_stacked)
            return
        if meta.num_rows == 0:
            return
        bgmv = self._triton.use_bgmv_site(meta, x.shape[1], sum(output_slices), rank)
        buf, splits = self._shrink_partials(x, lora_a_stacked, ranks, scale, meta, bgmv)
        self._triton.expand(y, buf, lora_b_stacked, ranks, self._offsets(output_slices), max(output_slices),
                            meta, 0, lora_bias_stacked, add_inputs=True, use_pdl=self.use_pdl,
                            shrink_splits=splits, bgmv=bgmv)

    def _shrink_partials(self, x: torch.Tensor, lora_a_stacked: torch.Tensor, ranks: torch.Tensor, scale: float,
                         meta: PunicaMetadata, bgmv: bool) -> tuple[torch.Tensor, int]:
        """The Triton shrink into the workspace: ([cap, S, T, R] partials, the grid's K splits, which the
        expand must be told to know how many partials each tile holds)."""
        num_slices, _, rank, hidden = lora_a_stacked.shape
        block_k, split_k, split_cap = self._triton.shrink_config(meta, hidden, num_slices, rank, bgmv)
        buf = self._buffer((split_cap, num_slices, meta.num_rows, rank))
        self._triton.shrink(buf, x, lora_a_stacked, ranks, meta, scale,
                            accumulate=False, split_k=split_k, block_k=block_k, use_pdl=self.use_pdl, bgmv=bgmv)
        return buf, split_k

    def lora_linear(self, x: torch.Tensor, weight: torch.Tensor, lora_a_stacked: torch.Tensor,
                    lora_b_stacked: torch.Tensor, lora_bias_stacked: torch.Tensor | None = None,
                    output_slices: tuple[int, ...] | None = None, ranks: torch.Tensor | None = None) -> torch.Tensor:
        """x @ weight^T plus add_lora_linear's LoRA (scale 1), as a new [T, N] tensor; weight [N, H].

        Where the step's site runs SGMV, the expand goes first and writes the delta into the new tensor
        (zeros on rows with no adapter), and the base GEMM adds into it as cuBLAS's C operand: the expand
        then never reads y back, which at prompt sizes cost it half its time (bench/delta_first.py)."""
        meta = self.token_meta
        x = self._rows(x, meta)
        num_slices, _, rank, hidden = lora_a_stacked.shape
        output_slices = tuple(output_slices or (lora_b_stacked.shape[1],))
        if (self.backend != "triton" or meta.num_rows == 0
                or self._triton.use_bgmv_site(meta, hidden, sum(output_slices), rank)):
            y = torch.nn.functional.linear(x, weight)
            self.add_lora_linear(y, x, lora_a_stacked, lora_b_stacked, lora_bias_stacked, 1.0, output_slices, ranks)
            return y
        _check_same_dtype(x, lora_a_stacked, "lora_linear")
        self._check_slices(lora_b_stacked, output_slices, num_slices)
        ranks = self._ranks(ranks, num_slices, lora_a_stacked.shape[1], rank)
        y = torch.empty(meta.num_rows, weight.shape[0], dtype=x.dtype, device=x.device)
        buf, splits = self._shrink_partials(x, lora_a_stacked, ranks, 1.0, meta, bgmv=False)
        self._triton.expand(y, buf, lora_b_stacked, ranks, self._offsets(output_slices), max(output_slices),
                            meta, 0, lora_bias_stacked, add_inputs=False, use_pdl=self.use_pdl,
                            shrink_splits=splits, bgmv=False, zero_base=True)
        return y.addmm_(x, weight.t())

    def add_lora_embedding(self, y: torch.Tensor, token_ids: torch.Tensor, lora_a_stacked: torch.Tensor,
                           lora_b_stacked: torch.Tensor, ranks: torch.Tensor | None = None,
                           add_inputs: bool = True) -> None:
        """y [T, D] += A_emb[slot, token] @ B[slot]^T, A_emb [1, L, V, R] a lookup table, B [L, D, R].

        token_ids are local to this rank's vocabulary shard; ids outside [0, V)
        add nothing here (another rank owns them).
        """
        meta = self.token_meta
        token_ids = token_ids.reshape(-1)
        rank = lora_a_stacked.shape[3]
        buf = self._buffer((1, 1, meta.num_rows, rank)) if self.backend == "triton" else \
            torch.empty(1, 1, meta.num_rows, rank, dtype=torch.float32, device=y.device)
        torch_ops.embedding_shrink(buf[0], token_ids, lora_a_stacked, meta.slots)
        self.add_expand(y, buf[0], lora_b_stacked, (lora_b_stacked.shape[1],), 0, add_inputs, ranks)

    def add_lora_logits(self, y: torch.Tensor, x: torch.Tensor, lora_a_stacked: torch.Tensor,
                        lora_b_stacked: torch.Tensor, scale: float = 1.0,
                        ranks: torch.Tensor | None = None) -> None:
        """logits y [P, V] += (x [P, H] @ A[slot]^T) @ B[slot]^T for the sampled rows (prompt_mapping)."""
        self.add_lora_linear(y, x, lora_a_stacked, lora_b_stacked, None, scale,
                             (lora_b_stacked.shape[1],), ranks, meta=self.sampler_meta)

    # ---- helpers --------------------------------------------------------------------------

    @staticmethod
    def _rows(x: torch.Tensor, meta: PunicaMetadata) -> torch.Tensor:
        x = x.reshape(-1, x.shape[-1])
        if x.shape[0] != meta.num_rows:
            raise ValueError(f"x has {x.shape[0]} rows but update_metadata mapped {meta.num_rows}")
        return x

    def _ranks(self, ranks: torch.Tensor | None, num_slices: int, num_slots: int, rank: int) -> torch.Tensor:
        """Without a ranks table every slot counts as full rank (padding must then be zero)."""
        if ranks is not None:
            return ranks
        key = (num_slices, num_slots, rank)
        if key not in self._full_ranks:
            self._full_ranks[key] = torch.full((num_slices, num_slots), rank, dtype=torch.int32, device=self.device)
        return self._full_ranks[key]

    def _offsets(self, output_slices: tuple[int, ...]) -> torch.Tensor:
        key = tuple(output_slices)
        if key not in self._slice_offsets:
            offsets = [0]
            for width in key:
                offsets.append(offsets[-1] + width)
            self._slice_offsets[key] = torch.tensor(offsets, dtype=torch.int32, device=self.device)
        return self._slice_offsets[key]

    def _buffer(self, shape: tuple[int, ...]) -> torch.Tensor:
        """A view of one fp32 workspace reused by every layer (grows only during warm-up)."""
        numel = 1
        for d in shape:
            numel *= d
        if self._workspace.numel() < numel:
            if self._workspace.numel():
                self._retired.append(self._workspace)
            self._workspace = torch.empty(numel, dtype=torch.float32, device=self.device)
        return self._workspace[:numel].view(shape)

    @staticmethod
    def _check_slices(lora_b: torch.Tensor, output_slices: Sequence[int], num_slices: int) -> None:
        if len(output_slices) != num_slices or sum(output_slices) != lora_b.shape[1]:
            raise ValueError(f"output_slices {tuple(output_slices)} do not match {num_slices} slices "
                             f"of lora_b with {lora_b.shape[1]} outputs")


def _check_same_dtype(x: torch.Tensor, w: torch.Tensor, op: str) -> None:
    if x.dtype != w.dtype:
        raise TypeError(f"{op}: activations are {x.dtype} but LoRA weights are {w.dtype}; "
                        "allocate slots with the model dtype (LoRAConfig.lora_dtype='auto')")
