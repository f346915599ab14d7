"""Synthetic steps for warm-up: every launch layout a step of some row count can have, and metadata giving one.

A CUDA graph is captured per launch key (PunicaWrapper.launch_key), which depends on a step's row count, its
adapter count and its slot bound, never on which weights the slots hold. Warm-up (replicas/warm_up.py,
replicas/cuda_graphs.py) lists the keys a row count can reach and sets a synthetic step for each before
compiling kernels and capturing graphs.
"""

from __future__ import annotations

from typing import NamedTuple

from lora_core.punica.metadata import adapter_bound


class StepLayout(NamedTuple):
    """What set_decode_layout needs to give a synthetic step a launch key: its adapters and slot bound."""
    num_adapters: int
    slot_bound: int | None = None


class StepLayouts:
    """PunicaWrapper's warm-up half: needs token_meta, sampler_meta, max_loras, is_prefill and _stacked_key."""

    def token_layouts(self, num_rows: int) -> dict[tuple, StepLayout]:
        """Every token_launch_key of a step of num_rows token rows -> a layout giving it (apply_layout)."""
        return self._layouts(num_rows, with_sampler=False)

    def decode_layouts(self, num_rows: int) -> dict[tuple, StepLayout]:
        """Every launch key a decode step of num_rows sequences can have -> a layout giving it."""
        return self._layouts(num_rows, with_sampler=True)

    def _layouts(self, num_rows: int, with_sampler: bool) -> dict[tuple, StepLayout]:
        out: dict[tuple, StepLayout] = {}
        for adapters in range(min(num_rows, self.max_loras) + 1):
            bounds = [adapter_bound(adapters, self.max_loras)]  # and every power of four above it
            while bounds[-1] < self.max_loras:
                bounds.append(adapter_bound(bounds[-1] + 1, self.max_loras))
            for bound in bounds:
                key = self.token_meta.launch_key(num_rows, adapters) + self._stacked_key(num_rows, adapters, bound)
                if with_sampler:
                    key += self.sampler_meta.launch_key(num_rows, adapters)
                out.setdefault(key, StepLayout(adapters, bound))
        return out

    def apply_layout(self, num_rows: int, layout: StepLayout, num_sampled: int | None = None) -> None:
        """set_decode_layout for one of token_layouts' or decode_layouts' values."""
        self.set_decode_layout(num_rows, layout.num_adapters, num_sampled, slot_bound=layout.slot_bound)

    def set_decode_layout(self, num_rows: int, num_adapters: int, num_sampled: int | None = None,
                          slot_bound: int | None = None) -> None:
        """Metadata of a synthetic step: num_rows rows over num_adapters slots (0: no LoRA), the highest
        of them slot_bound - 1 (default: num_adapters - 1).

        For warming up before traffic (compiling kernels, capturing CUDA
        graphs): both depend on the launch parameters only, not on which
        weights the slots hold. num_sampled rows (default: all, as in decode)
        go through the LM head.
        """
        top = max(num_adapters, slot_bound or 0)

        def slots(n: int) -> list[int]:
            return [top - num_adapters + i % num_adapters if num_adapters else -1 for i in range(n)]

        sampled = num_rows if num_sampled is None else num_sampled
        bound = adapter_bound(top, self.max_loras)
        self.token_meta.update(slots(num_rows), num_adapters, bound)
        self.sampler_meta.update(slots(sampled), min(num_adapters, sampled), bound)
        self.is_prefill = num_sampled is not None
