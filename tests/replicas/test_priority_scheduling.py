"""Scheduling policy "priority" (vLLM's): the waiting queue and preemption go by (priority, arrival); "fcfs"
ignores priorities; the engine refuses a priority it would ignore."""

from __future__ import annotations

import pytest

from replicas.block_manager import BlockManager
from replicas.errors import InvalidRequestError
from replicas.scheduler import Scheduler, SchedulerConfig
from tests.replicas.engine_cases import PROMPTS, greedy, make_llm, run_steps  # noqa: F401  (fixture)
from tests.replicas.test_scheduler import ids, req, step


def prio(rid, priority, t, **kw):
    seq = req(rid, t=t, **kw)
    seq.priority = priority
    return seq


def test_admission_goes_by_priority_then_arrival():
    s = Scheduler(SchedulerConfig(max_num_seqs=1, policy="priority"), BlockManager(64, 4))
    for rid, p, t in (("late-urgent", 0, 3.0), ("early-low", 5, 1.0), ("early-urgent", 0, 2.0), ("mid", 2, 2.5)):
        s.add(prio(rid, p, t, max_tokens=1))
    assert ids(s.waiting) == ["early-urgent", "late-urgent", "mid", "early-low"]
    order = []
    while s.has_unfinished():
        _, done = step(s)
        order += ids(done)
    assert order == ["early-urgent", "late-urgent", "mid", "early-low"]


def test_fcfs_ignores_priorities():
    s = Scheduler(SchedulerConfig(max_num_seqs=1), BlockManager(64, 4))
    for rid, p, t in (("a", 9, 1.0), ("b", 0, 2.0)):
        s.add(prio(rid, p, t, max_tokens=1))
    assert ids(s.waiting) == ["a", "b"]


def test_preemption_takes_the_least_urgent_and_it_waits_in_its_place():
    """Out of blocks, the victim is the running sequence of the highest priority value, not the latest arrival;
    it goes back to the waiting queue behind the more urgent waiting requests."""
    s = Scheduler(SchedulerConfig(policy="priority"), BlockManager(4, 4, enable_prefix_caching=False))
    s.add(prio("low-early", 3, 1.0, n_prompt=4, max_tokens=6))
    s.add(prio("high-late", 0, 2.0, n_prompt=4, max_tokens=6, first=50))
    step(s)
    for _ in range(4):
        out, _ = step(s)
    out, _ = step(s)  # 9 tokens each: no third block free
    assert ids(out.preempted) == ["low-early"] and ids(x.seq for x in out.scheduled) == ["high-late"]
    s.add(prio("waiting-urgent", 1, 3.0, max_tokens=1, first=90))
    assert ids(s.waiting) == ["waiting-urgent", "low-early"]
    s.add(prio("waiting-lax", 7, 4.0, max_tokens=1, first=95))
    assert ids(s.waiting) == ["waiting-urgent", "low-early", "waiting-lax"]


def test_policy_must_be_known():
    with pytest.raises(ValueError, match="policy"):
        SchedulerConfig(policy="lifo")


def test_engine_serves_by_priority_and_refuses_one_it_would_ignore(make_llm):  # noqa: F811
    llm = make_llm(scheduling_policy="priority", max_num_seqs=1)
    engine = llm.engine
    for rid, p in (("lax", 4), ("urgent", -1), ("normal", 0)):
        engine.add_request(rid, PROMPTS[0], greedy(2), priority=p)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["urgent", "normal", "lax"]
    outs = llm.generate(PROMPTS[:2], greedy(2), priority=[3, 1])
    assert all(o.error is None for o in outs)
    fcfs = make_llm()
    with pytest.raises(InvalidRequestError, match="scheduling_policy") as err:
        fcfs.engine.add_request("x", PROMPTS[0], greedy(2), priority=2)
    assert err.value.fields == ["priority"]
    with pytest.raises(InvalidRequestError, match="integer"):
        fcfs.engine.add_request("y", PROMPTS[0], greedy(2), priority="high")
    fcfs.engine.add_request("z", PROMPTS[0], greedy(2), priority=0)  # 0 is every request's under fcfs
    assert set(run_steps(fcfs.engine)) == {"z"}
