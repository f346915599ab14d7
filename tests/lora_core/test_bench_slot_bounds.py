"""bench/slot_bounds.py keeps running: its replay of Zipf traffic through the manager, for each eviction rule."""

from __future__ import annotations

import argparse

import pytest

from bench.slot_bounds import RULES, run


@pytest.mark.parametrize("rule", RULES)
def test_replay_reports_bounds_that_cover_the_steps_adapters(rule):
    args = argparse.Namespace(adapters=40, slots=16, concurrency=12, steps=300)
    per_step, bound, full, loads = run(rule, args, seed=0)
    assert 1 <= per_step <= 12 and per_step <= bound <= 16  # a bound is never below the step's adapter count
    assert 0 <= full <= 1 and 16 <= loads  # every slot gets filled, adapters come and go
