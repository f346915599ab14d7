"""bench/slot_bounds.py keeps running: its replay of Zipf traffic through the manager, for each eviction rule."""

from __future__ import annotations

import argparse

import pytest

from bench.slot_bounds import RULES, run


@pytest.mark.parametrize("rule", RULES)
def test_replay_reports_bounds_that_cover_the_steps_adapters(rule):
    args = argparse.Namespace(adapters=40, slots=16, concurrency=12, steps=300)
    per_step, bound, full, loads, moves, stacks64 = run(rule, args, seed=0)
    assert 1 <= per_step <= 12 and per_step <= bound <= 16  # a bound is never below the step's adapter count
    assert 0 <= full <= 1 and 16 <= loads  # every slot gets filled, adapters come and go
    assert (moves > 0) == (rule == "compact")  # only the manager's compaction moves adapters between slots
    assert 0 <= stacks64 <= 1


def test_compaction_keeps_steps_under_their_adapter_bound_at_lrus_activations():
    """~12 adapters per step over 32 slots: LRU's steps reach the last slot most of the time, compacted ones stay
    under 16 (their adapter bound), with as many adapters brought to the GPU."""
    args = argparse.Namespace(adapters=100, slots=32, concurrency=32, steps=300)
    lru, compact = run("lru", args, seed=0), run("compact", args, seed=0)
    assert lru.full > 0.5 and compact.full < 0.1 and compact.bound < 17 < lru.bound
    assert compact.loads <= lru.loads + 2
    assert compact.stacks64 > 0.9 > 0.5 > lru.stacks64  # rank-64 steps stay on the stacked path
