"""LoRAMerger: while every row of the steps uses one adapter, that adapter runs merged into the base weights.

A replica that the router keeps sending one hot adapter's traffic spends a
decode step's LoRA time on latency, not bytes: two small kernels per
projection, 128 pairs per step on an 8B model (~1.5 ms at batch 32 against a
5.8 ms base step, bench/RESULTS.md). Merged (W' = W + B A, as dLoRA does), such
steps run the base model's kernels and CUDA graphs and cost what a base step
costs. On by default on CUDA (EngineArgs.lora_merge_steps), within these limits:

- Memory: unmerging must restore the base weights bit for bit (W' - B A in bf16 does not give W back
  everywhere, and the error would grow with every switch). A merge keeps the adapter's factors and the base
  value of each element the subtraction would not restore (lora_core/merge.py: found by running that very
  subtraction at merge time), in at most MAX_UNDO_SHARE of a copy's bytes; an adapter that would need more
  is not merged. (A full copy of the weights, kept by an earlier version, cost the model's size again.)
- Numerics: a merged step rounds W + B A into the weights' dtype once, as
  PEFT's merge_and_unload does; the LoRA path adds x A B to x W. Greedy tokens
  can differ where two logits tie within that rounding.
- Switching: a merge reads every linear weight twice and writes it once, an unmerge reads and writes it
  (bench/lora_merge.py times both; a merge reads its fixup count back to the host), so an adapter merges
  only after ``wait`` consecutive steps that use it alone, and unmerges at the first step that does not.
  ``wait`` starts at merge_after and doubles after each merge undone before it paid for itself
  (PAYBACK_STEPS): traffic that keeps coming back to mixed steps soon stops paying for merges.

Only linear layers merge: an adapter with embedding or lm_head weights runs on
the LoRA path, and so does an engine with fully-sharded LoRA (a rank holds
r / tp rows of A) or LoRA bias slots (lora_core/merge.py says why).
Every TP rank takes the same decisions from the same StepInputs and merges its
own shards from its own slots; one all-reduce of a flag per merge makes the
ranks agree when one of them cannot keep its undo (all merge, or none).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from lora_core.config import LoRAConfig
from lora_core.errors import LoRAConfigError
from lora_core.merge import (MergeUndo, allocate_undo, apply_merge, check_mergeable, count_fixups, remove_merge,
                             slot_factors)
from lora_core.model_manager import LoRAModelManager
from lora_core.module_spec import LoRAKind
from replicas.lora_layers import ColumnParallelLinearWithLoRA, RowParallelLinearWithLoRA
from replicas.parallel import ParallelContext


# Most device bytes a merge's undo may take, as a share of the merged weights' bytes (a copy of them: 1.0). Each
# element whose base value is kept costs 4 + its own bytes, so in bf16 up to 1 in 6 elements. The share of
# elements an adapter needs is about its delta's size relative to the weights' (|B A| / |W| of 0.3% / 3%: 0.5% /
# 3.2% of the elements, random bf16 layers; bench/lora_merge.py prints it); an adapter that needs more runs
# unmerged.
MAX_UNDO_SHARE = 0.5
# A merge undone within this many steps cost more than it saved (8B on an H200: a merge and an unmerge take
# ~75 ms, ~120 times the ~0.6 ms a LoRA decode step costs over a merged one),
# so the streak the next merge waits for doubles (up to merge_after << MAX_WAIT_DOUBLINGS); one that lasted
# longer resets it.
PAYBACK_STEPS = 128
MAX_WAIT_DOUBLINGS = 6
# Steps of one adapter alone before the first merge: enough that a short burst of its requests does not pay for
# one, few against the hundreds of steps a replica the router keeps feeding one adapter runs.
DEFAULT_MERGE_AFTER = 8


def merge_after_steps(requested: int | None, lora_config: LoRAConfig, device: torch.device, tp_size: int,
                      quantized: bool = False) -> int:
    """EngineArgs.lora_merge_steps resolved: None is DEFAULT_MERGE_AFTER on CUDA where adapters can merge and 0
    (off) elsewhere: on CPU, and with fully-sharded LoRA under TP or LoRA bias slots (a merge there raises), or
    FP8 base weights (asking for merges there raises: W + B A would not stay the FP8 weight it is)."""
    if quantized:
        if requested:
            raise LoRAConfigError("lora_merge_steps: adapters cannot merge into FP8 weights (quantization='fp8')")
        return 0
    if requested is not None:
        return requested
    unmergeable = (lora_config.fully_sharded_loras and tp_size > 1) or lora_config.bias_enabled
    return DEFAULT_MERGE_AFTER if device.type == "cuda" and not unmergeable else 0


def merger_for(model: torch.nn.Module, manager: LoRAModelManager, requested: int | None, ctx: ParallelContext,
               device: torch.device, quantized: bool = False) -> LoRAMerger | None:
    """The engine's merger (TP ranks agree through ctx), or None where merge_after_steps turns merging off."""
    merge_after = merge_after_steps(requested, manager.config, device, ctx.tp_size, quantized)
    if not merge_after:
        return None
    return LoRAMerger.for_model(model, manager, merge_after, agree=lambda ok: ctx.all_true(ok, device))


class LoRAMerger:
    def __init__(self, layers: Sequence[torch.nn.Module], manager: LoRAModelManager, merge_after: int,
                 agree: Callable[[bool], bool] = lambda ok: ok) -> None:
        """layers: the model's linear LoRA wrappers (each has .base.weight and .spec). agree(ok): whether every
        TP rank's merge went through (each checks only its own shards), so that all merge or none does."""
        if merge_after < 1:
            raise ValueError(f"merge_after must be >= 1, got {merge_after}")
        self.manager = manager
        self.merge_after = merge_after
        self._layers = [(layer.base.weight, manager.buffers(layer.spec.name)) for layer in layers]
        for _, buffers in self._layers:
            check_mergeable(buffers)
        # Per layer, what takes the merged adapter's delta back out exactly (None: nothing merged).
        self._undo: list[MergeUndo] | None = None
        self.max_fixups = int(MAX_UNDO_SHARE * sum(weight.numel() * weight.element_size() for weight, _ in self._layers)
                              / (4 + self._layers[0][0].element_size()))
        self._agree = agree
        # Modules a mergeable adapter must leave alone: their LoRA is not a linear weight's delta.
        self._unmergeable_rows = [manager.layout.index(name) for name, spec in manager.specs.items()
                                  if spec.kind is not LoRAKind.LINEAR]
        self._mergeable: dict[int, bool] = {}
        self.merged: int | None = None  # the adapter now in the weights
        self._candidate, self._streak = 0, 0
        self.wait = merge_after  # the streak the next merge needs: merge_after, more after merges that did not pay
        self.payback_steps = PAYBACK_STEPS
        self._merged_steps = 0
        self.merges = 0  # merges done, for tests and benchmarks

    @classmethod
    def for_model(cls, model: torch.nn.Module, manager: LoRAModelManager, merge_after: int,
                  agree: Callable[[bool], bool] = lambda ok: ok) -> "LoRAMerger":
        """A merger over every linear LoRA layer of the model, its kernels compiled (warm_up)."""
        linear = [m for m in model.modules()
                  if isinstance(m, (ColumnParallelLinearWithLoRA, RowParallelLinearWithLoRA))]
        merger = cls(linear, manager, merge_after, agree)
        merger.warm_up()
        return merger

    def backup_bytes(self) -> int:
        """Device bytes the merged adapter's undo holds (0 while nothing is merged)."""
        return sum(u.nbytes for u in self._undo or [])

    def fixups(self) -> int:
        """Elements whose base value the merged adapter's undo keeps."""
        return sum(u.fixups for u in self._undo or [])

    def plan(self, token_ids: Sequence[int], sample_ids: Sequence[int]) -> int | None:
        """The adapter this step's rows should run merged with (None: the LoRA path). Call once per step.

        A step with no rows changes nothing; any other step that is not one mergeable adapter alone ends
        the streak (and, in the runner, the merge).
        """
        ids = set(token_ids) | set(sample_ids)
        if not ids:
            return self.merged
        lora_id = ids.pop() if len(ids) == 1 else 0
        if not lora_id or not self.mergeable(lora_id):
            self._candidate, self._streak = 0, 0
            return None
        if lora_id == self.merged:
            self._merged_steps += 1
            return lora_id
        self._streak = self._streak + 1 if lora_id == self._candidate else 1
        self._candidate = lora_id
        return lora_id if self._streak >= self.wait else None

    def mergeable(self, lora_id: int) -> bool:
        """Whether a registered adapter has weights for linear layers only (cached per id; forget() drops it).
        An adapter not registered now counts as not mergeable for this step."""
        if lora_id not in self._mergeable:
            if lora_id not in self.manager.list_adapters():
                return False
            ranks = self.manager.host_ranks(lora_id)
            self._mergeable[lora_id] = not bool(ranks[self._unmergeable_rows].any())  # no rows: False
        return self._mergeable[lora_id]

    def forget(self, lora_id: int) -> None:
        """The adapter was removed (its id may come back with other weights): unmerge it, drop its cache."""
        self._mergeable.pop(lora_id, None)
        if self.merged == lora_id:
            self.unmerge()
        if self._candidate == lora_id:
            self._candidate, self._streak = 0, 0

    def merge(self, lora_id: int, slot: int) -> bool:
        """W = W_base + delta of the adapter in ``slot`` (its image must be written, in stream order). False,
        with the weights untouched and the adapter no longer mergeable, where its undo would need more than
        max_fixups base values (or more memory than is free) on this rank or another. Syncs once: the count."""
        ok, undos = True, []
        try:
            factors = [slot_factors(weight, buffers, slot) for weight, buffers in self._layers]
            counts = [count_fixups(weight, f) for (weight, _), f in zip(self._layers, factors)]
            totals = torch.stack([c.total for c in counts]).tolist()
            ok = sum(totals) <= self.max_fixups
            if ok:  # allocated before any weight changes: no rank writes one unless every rank can finish
                undos = [allocate_undo(w, f, n) for (w, _), f, n in zip(self._layers, factors, totals)]
        except torch.cuda.OutOfMemoryError:  # the undo did not fit beside the KV cache: serve it unmerged
            ok, undos = False, []
        if not self._agree(ok):
            self._mergeable[lora_id] = False
            return False
        for (weight, _), count, undo in zip(self._layers, counts, undos):
            apply_merge(weight, count, undo)
        self._undo, self.merged = undos, lora_id
        self.merges += 1
        return True

    def unmerge(self) -> None:
        for (weight, _), undo in zip(self._layers, self._undo or []):
            remove_merge(weight, undo)
        if self.merged is not None:
            paid = self._merged_steps >= self.payback_steps
            self.wait = self.merge_after if paid else min(2 * self.wait, self.merge_after << MAX_WAIT_DOUBLINGS)
        self._undo, self.merged, self._merged_steps = None, None, 0

    def warm_up(self) -> None:
        """On GPU, compile the merge's kernels for every weight now, not at the first merge: count slot 0's
        fixups (reads the weights only)."""
        for weight, buffers in self._layers:
            if weight.is_cuda:  # the CPU reference compiles nothing
                count_fixups(weight, slot_factors(weight, buffers, 0))  # launching compiles
