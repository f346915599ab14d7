"""How many rows a stacked GEMM reads: its exact count, or some rows more where cuBLAS runs faster.

A stacked step's GEMM reads `out + bound x per_slot` rows of `[W ; A slots]` (lora_core/stacked_a.py), and
cuBLAS picks its kernel from that shape. Some row counts get slow picks: on an H200 the four GEMMs of 32
Llama-3-8B layers at 32 token rows ran 228 us longer with one rank-16 adapter's 16-48 extra rows each (their
bytes: ~10 us), and reading 112-256 rows more on o_proj and down_proj won 100 us of it back
(bench/stacked_gemm.py --in-situ, bench/RESULTS.md ninth session). The picks depend on the GPU and the cuBLAS
build, so they are measured, not tabled: before traffic (replicas/warm_up.py) each distinct stacked weight
shape is timed at every step size the engine's graphs cover and every slot bound, with its exact row count
and up to PAD_ROWS more, and the fastest count is kept (RowPlan).

Rows past the exact count are other slots' A rows (their shrinks, which no expand reads: each row reads its
own slot's columns) or, past the last slot, PAD_ROWS zero rows the stacked weight keeps for this.
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from typing import Callable, Iterable

import torch
import torch.nn.functional as F

PAD_ROWS = 256  # rows past the exact count tried, and zero rows kept past the last slot (stack_lora_weights)
PAD_STEP = 32  # candidate row counts: exact, exact + PAD_STEP, ... exact + PAD_ROWS
MARGIN = 0.01  # a count past the exact one must be this much faster to be kept


class RowPlan:
    """Rows a stacked GEMM of one weight shape reads per (token rows, slot bound): exact until tuned."""

    def __init__(self, out: int, per_slot: int, capacity: int) -> None:
        self.out, self.per_slot, self.capacity = out, per_slot, capacity
        self._sizes: list[int] = []  # tuned token counts, ascending
        self._rows: dict[tuple[int, int], int] = {}

    def exact(self, bound: int) -> int:
        return self.out + bound * self.per_slot

    def candidates(self, bound: int) -> list[int]:
        """Row counts worth timing for a slot bound: the exact one and up to PAD_ROWS more that fit."""
        exact = self.exact(bound)
        return list(range(exact, min(exact + PAD_ROWS, self.capacity) + 1, PAD_STEP))

    def rows(self, tokens: int, bound: int) -> int:
        """Rows to read for a step of `tokens` rows: the choice tuned at the smallest tuned size that holds
        it (the size a CUDA graph pads the step to), else the exact count."""
        i = bisect.bisect_left(self._sizes, tokens)
        if i == len(self._sizes):
            return self.exact(bound)
        return self._rows.get((self._sizes[i], bound), self.exact(bound))

    def choose(self, tokens: int, bound: int, rows: int) -> None:
        if not self.exact(bound) <= rows <= self.capacity:
            raise ValueError(f"{rows} rows for slot bound {bound}: outside [{self.exact(bound)}, {self.capacity}]")
        if tokens not in self._sizes:
            bisect.insort(self._sizes, tokens)
        self._rows[tokens, bound] = rows


def cuda_seconds(fn: Callable[[], None], rounds: int = 2) -> float:
    """Fastest of `rounds` timed calls of fn on the current CUDA stream, after one untimed call."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = math.inf
    for _ in range(rounds):
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


def tune(weights: Iterable[tuple[RowPlan, torch.Tensor]], sizes: list[int], bounds: list[int],
         seconds: Callable[[Callable[[], None]], float] = cuda_seconds,
         all_reduce: Callable[[torch.Tensor], torch.Tensor] = lambda t: t, per_timing: int = 8) -> int:
    """Fill each plan with the fastest candidate row count per (size, bound); returns the timings taken.

    weights: (plan, stacked weight) of every stacked layer; a timing runs the GEMM over up to per_timing
    layers of one plan in turn, so their weights come from memory as in a step, not from L2. all_reduce sums
    the timings over TP ranks, so that every rank picks the same counts (row-parallel layers all-reduce the
    GEMM's whole output: its width must agree)."""
    layers: dict[RowPlan, list[torch.Tensor]] = defaultdict(list)
    for plan, weight in weights:
        layers[plan].append(weight)
    jobs = [(plan, size, bound, rows) for plan in layers for size in sizes for bound in bounds
            for rows in plan.candidates(bound)]
    if not jobs:
        return 0
    inputs = {}
    times = []
    for plan, size, _, rows in jobs:
        group = layers[plan][:per_timing]
        key = (size, group[0].shape[1], group[0].dtype)
        if key not in inputs:
            inputs[key] = torch.randn(size, key[1], dtype=key[2], device=group[0].device)
        x = inputs[key]
        times.append(seconds(lambda: [F.linear(x, w[:rows]) for w in group]))
    summed = all_reduce(torch.tensor(times, dtype=torch.float64, device=next(iter(inputs.values())).device))
    exact: dict[tuple[RowPlan, int, int], float] = {}
    best: dict[tuple[RowPlan, int, int], tuple[float, int]] = {}
    for (plan, size, bound, rows), t in zip(jobs, summed.tolist()):
        exact.setdefault((plan, size, bound), t)  # the first candidate is the exact count
        if t < best.get((plan, size, bound), (math.inf, 0))[0]:
            best[plan, size, bound] = (t, rows)
    for key, (t, rows) in best.items():
        # More rows only for a clear gain: within MARGIN the exact count stays (timing noise).
        plan, size, bound = key
        plan.choose(size, bound, rows if t < exact[key] * (1 - MARGIN) else plan.exact(bound))
    return len(jobs)
