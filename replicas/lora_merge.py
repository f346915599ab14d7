"""LoRAMerger: while every row of the steps uses one adapter, that adapter runs merged into the base weights.

A replica that the router keeps sending one hot adapter's traffic spends a
decode step's LoRA time on latency, not bytes: two small kernels per
projection, 128 pairs per step on an 8B model (~1.5 ms at batch 32 against a
5.8 ms base step, bench/RESULTS.md). Merged (W' = W + B A, as dLoRA does), such
steps run the base model's kernels and CUDA graphs and cost what a base step
costs. Opt-in (EngineArgs.lora_merge_steps), because:

- Memory: a copy of every LoRA-able linear weight stays on the device, so that
  unmerging restores the base weights exactly (W' - B A in bf16 would not give
  W back, and the error would grow with every switch): about the model's size
  again (14 GB for an 8B model in bf16, per TP rank its shard).
- Numerics: a merged step rounds W + B A into the weights' dtype once, as
  PEFT's merge_and_unload does; the LoRA path adds x A B to x W. Greedy tokens
  can differ where two logits tie within that rounding.
- Switching: a merge or an unmerge rewrites every linear weight (8B on an H200:
  19 ms and 7 ms, bench/lora_merge.py), so an adapter merges only after
  ``merge_after`` consecutive steps that use it alone, and unmerges at the
  first step that does not.

Only linear layers merge: an adapter with embedding or lm_head weights runs on
the LoRA path, and so does an engine with fully-sharded LoRA (a rank holds
r / tp rows of A) or LoRA bias slots (lora_core/merge.py says why).
Every TP rank takes the same decisions from the same StepInputs and merges its
own shards from its own slots, so no collective is needed.
"""

from __future__ import annotations

from typing import Sequence

import torch

from lora_core.merge import add_slot_delta, check_mergeable
from lora_core.model_manager import LoRAModelManager
from lora_core.module_spec import LoRAKind


class LoRAMerger:
    def __init__(self, layers: Sequence[torch.nn.Module], manager: LoRAModelManager, merge_after: int) -> None:
        """layers: the model's linear LoRA wrappers (each has .base.weight and .spec)."""
        if merge_after < 1:
            raise ValueError(f"merge_after must be >= 1, got {merge_after}")
        self.manager = manager
        self.merge_after = merge_after
        self._layers = [(layer.base.weight, manager.buffers(layer.spec.name)) for layer in layers]
        for _, buffers in self._layers:
            check_mergeable(buffers)
        # The base weights, restored by one copy each on unmerge (exact: no subtraction).
        self._base = [weight.detach().clone() for weight, _ in self._layers]
        # Modules a mergeable adapter must leave alone: their LoRA is not a linear weight's delta.
        self._unmergeable_rows = [manager.layout.index(name) for name, spec in manager.specs.items()
                                  if spec.kind is not LoRAKind.LINEAR]
        self._mergeable: dict[int, bool] = {}
        self.merged: int | None = None  # the adapter now in the weights
        self._candidate, self._streak = 0, 0
        self.merges = 0  # merges done, for tests and benchmarks

    def backup_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._base)

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
            return lora_id
        self._streak = self._streak + 1 if lora_id == self._candidate else 1
        self._candidate = lora_id
        return lora_id if self._streak >= self.merge_after else None

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

    def merge(self, lora_id: int, slot: int) -> None:
        """W = W_base + delta of the adapter in ``slot`` (its image must be written, in stream order)."""
        for (weight, buffers), base in zip(self._layers, self._base):
            add_slot_delta(weight, buffers, slot, base=base)
        self.merged = lora_id
        self.merges += 1

    def unmerge(self) -> None:
        for (weight, _), base in zip(self._layers, self._base):
            weight.copy_(base)
        self.merged = None
