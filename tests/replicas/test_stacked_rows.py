"""Row plans of stacked GEMMs (replicas/stacked_rows.py): lookups, candidates and the tuner's choices.

The tuner's timings come from a fake clock keyed by the rows each GEMM reads, so the choice it must make is
known; one run with the real clock on CPU checks that whatever it picks is a candidate.
"""

from __future__ import annotations

import time
from unittest import mock

import pytest
import torch

from replicas import stacked_rows
from replicas.stacked_rows import PAD_ROWS, PAD_STEP, RowPlan, tune

OUT, PER_SLOT, SLOTS, WIDTH = 48, 8, 4, 16


def _plan(pad: int = PAD_ROWS) -> RowPlan:
    return RowPlan(OUT, PER_SLOT, OUT + SLOTS * PER_SLOT + pad)


def test_a_plan_reads_the_exact_rows_until_tuned():
    plan = _plan()
    assert [plan.rows(t, b) for t, b in ((1, 1), (32, 4), (300, 4))] == [56, 80, 80]


def test_candidates_start_at_the_exact_count_and_stay_within_the_weight():
    assert PAD_STEP == 32
    plan = _plan(pad=40)  # 120 rows: 48 + 4 slots x 8 + 40
    assert plan.candidates(1) == [56, 88, 120] and plan.candidates(4) == [80, 112]
    assert _plan(pad=0).candidates(SLOTS) == [OUT + SLOTS * PER_SLOT]  # nothing past the last slot
    assert len(_plan().candidates(1)) == PAD_ROWS // PAD_STEP + 1


def test_lookup_takes_the_smallest_tuned_size_that_holds_the_step():
    plan = _plan()
    plan.choose(8, 1, 120)
    plan.choose(32, 1, 88)
    assert plan.rows(1, 1) == 120 and plan.rows(8, 1) == 120 and plan.rows(9, 1) == 88 and plan.rows(32, 1) == 88
    assert plan.rows(33, 1) == 56  # past every tuned size: exact
    assert plan.rows(8, 4) == 80  # a bound never tuned: exact


@pytest.mark.parametrize("rows", [55, 56 + 32 + PAD_ROWS + 1])
def test_a_choice_outside_the_weight_or_below_the_exact_count_is_refused(rows):
    with pytest.raises(ValueError, match="outside"):
        _plan().choose(8, 1, rows)


def _clock(cost):
    """A fake `seconds`: runs fn with F.linear recorded, and charges cost(rows of the first weight)."""
    def seconds(fn):
        seen = []
        real = torch.nn.functional.linear

        def linear(x, w, *args):
            seen.append(w.shape[0])
            return real(x, w, *args)
        with mock.patch.object(torch.nn.functional, "linear", linear):
            fn()
        assert len(set(seen)) == 1  # one row count per timing, over every layer of the plan
        return cost(seen[0])
    return seconds


def _layers(plan: RowPlan, count: int = 3) -> list[tuple[RowPlan, torch.Tensor]]:
    return [(plan, torch.zeros(plan.capacity, WIDTH)) for _ in range(count)]


def test_tune_keeps_the_fastest_count_per_size_and_bound():
    plan = _plan()
    # Exact counts are slow; 56 + 64 is fastest for bound 1, and for bound 4 the exact 80 rows already are.
    cost = {56 + 64: 1.0, 80: 1.0}
    taken = tune(_layers(plan), [1, 16], [1, 4], seconds=_clock(lambda rows: cost.get(rows, 2.0 + rows / 1e4)))
    assert taken == 2 * (len(plan.candidates(1)) + len(plan.candidates(4)))
    assert [plan.rows(t, 1) for t in (1, 16)] == [120, 120] and [plan.rows(t, 4) for t in (1, 16)] == [80, 80]


def test_tune_keeps_the_exact_count_unless_more_rows_are_clearly_faster():
    plan = _plan()
    near = 1.0 - stacked_rows.MARGIN / 2
    tune(_layers(plan), [8], [1, 4], seconds=_clock(lambda rows: {56 + 32: near, 80 + 32: 0.5}.get(rows, 1.0)))
    assert plan.rows(8, 1) == 56 and plan.rows(8, 4) == 112


def test_every_tp_rank_picks_the_same_counts_from_the_summed_timings():
    """Row-parallel layers all-reduce the GEMM's whole output, so its width must agree across ranks: each
    rank picks from the timings summed over the ranks (all_reduce), not from its own."""
    local = [{56 + 32: 1.0, 56 + 64: 3.0}, {56 + 32: 5.0, 56 + 64: 1.5}]  # alone: rank 0 takes 88, rank 1 120

    def clock(rank):
        return _clock(lambda rows: local[rank].get(rows, 10.0))

    def timings(rank) -> torch.Tensor:
        seen = []
        tune(_layers(_plan()), [4], [1], seconds=clock(rank), all_reduce=lambda t: seen.append(t.clone()) or t)
        return seen[0]

    others = [timings(1), timings(0)]
    picks = []
    for rank in (0, 1):
        plan = _plan()
        tune(_layers(plan), [4], [1], seconds=clock(rank), all_reduce=lambda t, o=others[rank]: t.add_(o))
        picks.append(plan.rows(4, 1))
    assert picks == [56 + 64, 56 + 64]  # the summed best: 4.5 against 6.0


def test_tune_on_cpu_with_the_real_clock_picks_candidates_only():
    plan = _plan()

    def seconds(fn):
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    tune(_layers(plan), [2, 8], [1, 4], seconds=seconds)
    for size in (2, 8):
        for bound in (1, 4):
            assert plan.rows(size, bound) in plan.candidates(bound)


def test_nothing_to_tune_takes_no_timing():
    assert tune([], [1, 8], [1]) == 0
