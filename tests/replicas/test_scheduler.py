"""Scheduler: slot limits, waiting adapters, chunked prefill, preemption, abort, stress."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from lora_core.request import LoRARequest
from replicas.block_manager import BlockManager
from replicas.errors import InvalidRequestError
from replicas.sampling_params import SamplingParams
from replicas.scheduler import Scheduler, SchedulerConfig
from replicas.sequence import Sequence, SequenceStatus

EOS = 2


def make(num_blocks=64, block_size=4, **cfg):
    return Scheduler(SchedulerConfig(**cfg), BlockManager(num_blocks, block_size))


def req(rid, n_prompt=4, lora_id=0, max_tokens=4, t=None, first=10, **params):
    lora = LoRARequest(f"adapter{lora_id}", lora_id, "/x") if lora_id else None
    prompt = list(range(first, first + n_prompt))
    params = SamplingParams(max_tokens=max_tokens, **params)
    return Sequence(rid, prompt, params, lora, arrival_time=t, eos_token_ids=EOS)


def step(s, token=7):
    """One engine step: every sampling sequence gets `token` (or token(seq))."""
    out = s.schedule()
    sampled = {x.seq.request_id: token(x.seq) if callable(token) else token for x in out.scheduled if x.samples}
    return out, s.update_from_output(out, sampled)


def ids(seqs):
    return [x.request_id for x in seqs]


def test_prefill_then_decode_until_length():
    s = make()
    s.add(req("a", n_prompt=5, max_tokens=3))
    out, done = step(s)
    assert [(x.num_new_tokens, x.samples, x.is_prefill) for x in out.scheduled] == [(5, True, True)]
    out, done = step(s)
    assert [(x.num_new_tokens, x.is_prefill, x.token_ids) for x in out.scheduled] == [(1, False, [7])]
    out, done = step(s)
    assert ids(done) == ["a"] and done[0].finish_reason == "length" and done[0].output_token_ids == [7, 7, 7]
    assert not s.has_unfinished() and s.block_manager.num_free_blocks == 64
    assert ids(s.schedule().finished) == ["a"]


def test_stop_token_eos_and_ignore_eos():
    s = make()
    s.add(req("eos"))
    s.add(req("stop_id", stop_token_ids=[9]))
    s.add(req("ignore", ignore_eos=True, max_tokens=2))
    step(s, token=lambda q: 9 if q.request_id == "stop_id" else EOS)
    done = {q.request_id: q for q in s.schedule().finished}
    assert (done["eos"].finish_reason, done["eos"].stop_reason) == ("stop", None)
    assert (done["stop_id"].finish_reason, done["stop_id"].stop_reason) == ("stop", 9)
    assert "ignore" not in done
    _, done = step(s, token=EOS)
    assert done[0].finish_reason == "length" and done[0].output_token_ids == [EOS, EOS]


def test_max_model_len_finishes_with_length():
    s = make(max_model_len=6)
    s.add(req("a", n_prompt=4, max_tokens=100))
    step(s)
    _, done = step(s)
    assert done[0].finish_reason == "length" and done[0].num_tokens == 6


def test_max_num_seqs():
    s = make(max_num_seqs=2)
    for i in range(3):
        s.add(req(str(i)))
    out = s.schedule()
    assert ids(x.seq for x in out.scheduled) == ["0", "1"] and s.num_waiting == 1


def test_third_adapter_waits_while_base_and_running_adapters_go_ahead():
    s = make(max_loras=2)
    for rid, lid in [("a1", 1), ("b2", 2), ("c3", 3), ("d0", 0), ("e1", 1), ("f4", 4), ("g3", 3)]:
        s.add(req(rid, lora_id=lid, max_tokens=2))
    out = s.schedule()
    assert ids(x.seq for x in out.scheduled) == ["a1", "b2", "d0", "e1"]
    assert out.lora_ids == {1, 2}
    assert ids(s.waiting) == ["c3", "f4", "g3"]  # skipped requests keep their place
    assert s.adapters_to_prefetch() == [3, 4] and s.adapters_to_prefetch(limit=1) == [3]
    s.update_from_output(out, {x.seq.request_id: 7 for x in out.scheduled})
    _, done = step(s)
    assert sorted(ids(done)) == ["a1", "b2", "d0", "e1"]
    out = s.schedule()
    assert ids(x.seq for x in out.scheduled) == ["c3", "f4", "g3"] and out.lora_ids == {3, 4}


def test_adapter_being_loaded_waits():
    loaded = {1}
    s = Scheduler(SchedulerConfig(max_loras=4), BlockManager(64, 4), adapter_ready=lambda lid: lid in loaded)
    s.add(req("x", lora_id=2))
    s.add(req("y", lora_id=1))
    assert ids(x.seq for x in s.schedule().scheduled) == ["y"]
    assert s.adapters_to_prefetch() == [2]
    loaded.add(2)
    assert ids(x.seq for x in s.schedule().scheduled) == ["y", "x"]


def test_chunked_prefill_within_token_budget():
    s = make(max_num_batched_tokens=8)
    s.add(req("long", n_prompt=20, max_tokens=2))
    chunks = []
    for _ in range(3):
        out, _ = step(s)
        chunks.append([(x.start, x.num_new_tokens, x.samples) for x in out.scheduled])
    assert chunks == [[(0, 8, False)], [(8, 8, False)], [(16, 4, True)]]
    s.add(req("short", n_prompt=10, max_tokens=2, first=100))
    out = s.schedule()  # the running decode goes first, the newcomer gets the rest of the budget
    assert [(x.seq.request_id, x.num_new_tokens) for x in out.scheduled] == [("long", 1), ("short", 7)]
    assert out.num_batched_tokens == 8


def test_preemption_by_recompute_and_resume():
    s = Scheduler(SchedulerConfig(), BlockManager(4, 4, enable_prefix_caching=False))
    s.add(req("old", n_prompt=4, max_tokens=6, t=1.0))
    s.add(req("new", n_prompt=4, max_tokens=6, first=50, t=2.0))
    step(s)  # 2 blocks used, each sequence now has 5 tokens
    out, _ = step(s)  # each takes a second block
    assert not out.preempted and s.block_manager.num_free_blocks == 0
    for _ in range(3):
        out, _ = step(s)
    out, _ = step(s)  # 9 tokens each: no third block free -> the later arrival is preempted
    assert ids(out.preempted) == ["new"] and ids(x.seq for x in out.scheduled) == ["old"]
    new = s.requests["new"]
    assert new.status is SequenceStatus.PREEMPTED and new.block_table == [] and new.num_computed_tokens == 0
    assert ids(s.waiting) == ["new"] and new.output_token_ids == [7] * 5
    while s.requests.get("old"):
        step(s)
    out, done = step(s)  # resumes: prompt and outputs recomputed in one prefill
    assert [(x.seq.request_id, x.num_new_tokens, x.is_prefill) for x in out.scheduled] == [("new", 9, True)]
    assert ids(done) == ["new"] and new.output_token_ids == [7] * 6 and new.finish_reason == "length"
    assert s.block_manager.num_free_blocks == 4


def test_sequence_alone_larger_than_cache_finishes_with_length():
    s = make(num_blocks=2, block_size=4)
    s.add(req("a", n_prompt=4, max_tokens=100))
    for _ in range(5):
        step(s)
    out, _ = step(s)
    assert out.scheduled == [] and ids(out.finished) == ["a"]
    assert out.finished[0].finish_reason == "length" and out.finished[0].num_tokens == 9


@pytest.mark.parametrize("where", ["waiting", "running", "preempted", "after_schedule"])
def test_abort_from_each_state(where):
    s = make(num_blocks=4, block_size=4)
    s.add(req("keep", n_prompt=4, max_tokens=8, t=1.0))
    s.add(req("x", n_prompt=4, max_tokens=8, first=50, t=2.0))
    if where == "running":
        step(s)
    elif where == "preempted":
        while s.requests["x"].status is not SequenceStatus.PREEMPTED:
            step(s)
    if where == "after_schedule":
        out = s.schedule()
        s.abort("x")
        s.update_from_output(out, {"keep": 7, "x": 7})
    else:
        assert s.abort("x").finish_reason == "abort"
    x = s.schedule().finished
    assert ids(x) == ["x"] and x[0].status is SequenceStatus.FINISHED_ABORTED and set(x[0].output_token_ids) <= {7}
    assert "x" not in s.requests and all(q.request_id != "x" for q in (*s.waiting, *s.running))
    assert s.abort("x") is None and s.abort("never") is None
    while s.has_unfinished():
        step(s)
    assert s.block_manager.num_free_blocks == 4


def test_bad_requests_are_refused_by_field():
    s = make(num_blocks=4, block_size=4, max_model_len=10)
    s.add(req("a"))
    cases = [(req("a"), "request_id"), (Sequence("e", []), "prompt"), (req("long", n_prompt=10), "prompt")]
    for seq, field in cases:
        with pytest.raises(InvalidRequestError) as err:
            s.add(seq)
        assert err.value.fields == [field]
    s2 = make(num_blocks=2, block_size=4)
    with pytest.raises(InvalidRequestError, match="KV cache"):
        s2.add(req("big", n_prompt=8))
    s3 = make(max_loras=0)
    with pytest.raises(InvalidRequestError, match="LoRA is not enabled"):
        s3.add(req("l", lora_id=1))
    assert list(s.requests) == ["a"]


def test_prefix_reuse_through_the_scheduler():
    s = make(num_blocks=16, block_size=4)
    s.add(req("a", n_prompt=9, lora_id=1))
    step(s)
    s.add(req("b", n_prompt=9, lora_id=1))
    s.add(req("c", n_prompt=9, lora_id=2))
    out = s.schedule()
    new = {x.seq.request_id: x.num_new_tokens for x in out.scheduled}
    assert new == {"a": 1, "b": 1, "c": 9}



def siblings(n_prompt: int, n: int = 3, **kw) -> list[Sequence]:
    """n sequences of one prompt, the later ones waiting on the first (parallel sampling)."""
    seqs = [req(f"p#{i}", n_prompt=n_prompt, **kw) for i in range(n)]
    for follower in seqs[1:]:
        follower.prefix_leader = seqs[0]
    return seqs


def test_siblings_wait_for_the_leaders_prompt_then_share_its_blocks():
    s = make(num_blocks=32, block_size=4, max_num_batched_tokens=6)
    for seq in siblings(n_prompt=10):
        s.add(seq)
    s.add(req("other", n_prompt=3))
    out, _ = step(s)  # the leader's first chunk; its siblings wait, the request behind them goes ahead
    assert {x.seq.request_id: x.num_new_tokens for x in out.scheduled} == {"p#0": 6}
    out, _ = step(s)  # the leader's last chunk (chunked prefill), and "other" in the budget left
    assert {x.seq.request_id: x.num_new_tokens for x in out.scheduled} == {"p#0": 4, "other": 2}
    out, _ = step(s)  # prompt computed: each sibling computes only the tokens past the leader's 2 full blocks
    assert {x.seq.request_id: x.num_new_tokens for x in out.scheduled} == {"p#0": 1, "other": 1, "p#1": 2, "p#2": 2}
    assert [s.requests[f"p#{i}"].num_cached_tokens for i in (1, 2)] == [8, 8]
    first, second = s.requests["p#0"], s.requests["p#1"]
    assert second.prefix_leader is None and second.block_table[:2] == first.block_table[:2]


@pytest.mark.parametrize("leader_ends", ["abort", "stop"])
def test_siblings_go_once_their_leader_has_finished(leader_ends):
    s = make(num_blocks=32, block_size=4)
    leader, *followers = siblings(n_prompt=9, max_tokens=1 if leader_ends == "stop" else 4)
    for seq in (leader, *followers):
        s.add(seq)
    if leader_ends == "abort":  # still waiting: nothing of the prompt is cached
        s.abort(leader.request_id)
        out, _ = step(s)
        assert {x.seq.request_id: x.num_new_tokens for x in out.scheduled} == {"p#1": 9, "p#2": 9}
    else:  # finished with its prompt step: its blocks stay cached for the followers
        out, done = step(s)
        assert ids(done) == ["p#0"]
        out, _ = step(s)
        assert {x.seq.request_id: x.num_new_tokens for x in out.scheduled} == {"p#1": 1, "p#2": 1}


def test_a_preempted_leader_holds_its_waiting_siblings_back_again():
    s = make(num_blocks=32, block_size=4)
    leader, *followers = siblings(n_prompt=9)
    for seq in (leader, *followers):
        s.add(seq)
    step(s)
    s._preempt(leader)  # recompute: its computed tokens are gone, the cache still holds its blocks
    assert s._waits_for_leader(followers[0]) and leader.num_computed_tokens == 0
    out, _ = step(s)  # the leader comes back first and reuses its own cached blocks
    assert {x.seq.request_id: x.num_new_tokens for x in out.scheduled} == {"p#0": 2}
    out, _ = step(s)
    assert {x.seq.request_id for x in out.scheduled} == {"p#0", "p#1", "p#2"}

def check_invariants(s: Scheduler, out, cfg: SchedulerConfig):
    bm = s.block_manager
    assert len(out.scheduled) <= cfg.max_num_seqs and out.num_batched_tokens <= cfg.max_num_batched_tokens
    assert len(out.lora_ids) <= cfg.max_loras and len(s.running_lora_ids()) <= cfg.max_loras
    assert set(ids(s.waiting)).isdisjoint(ids(s.running))
    assert set(ids(s.waiting)) | set(ids(s.running)) == set(s.requests)
    refs = Counter(b for q in s.running for b in q.block_table)
    assert all(bm.blocks[b.block_id].ref_count == refs.get(b.block_id, 0) for b in bm.blocks)
    assert bm.num_free_blocks == sum(1 for b in bm.blocks if b.ref_count == 0)
    assert all(not q.block_table for q in s.waiting)


def test_randomized_stress_loses_nothing():
    rng = random.Random(0)
    cfg = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=24, max_loras=2)
    s = Scheduler(cfg, BlockManager(12, 4))
    added, finished, aborted = set(), Counter(), set()
    n = 0
    for it in range(1500):
        if rng.random() < 0.35 and it < 1200:
            rid = f"r{n}"
            n += 1
            s.add(req(rid, n_prompt=rng.randint(1, 20), lora_id=rng.choice([0, 1, 2, 3, 4]),
                      max_tokens=rng.randint(1, 12), first=rng.choice([10, 10, 40])))
            added.add(rid)
        if rng.random() < 0.05 and s.requests:
            rid = rng.choice(sorted(s.requests))
            aborted.add(rid)
            s.abort(rid)
        out = s.schedule()
        check_invariants(s, out, cfg)
        finished.update(ids(out.finished))
        sampled = {x.seq.request_id: rng.choice([EOS, 5, 6, 7, 8]) for x in out.scheduled if x.samples}
        s.update_from_output(out, sampled)
    while s.has_unfinished():
        out, _ = step(s)
        check_invariants(s, out, cfg)
        finished.update(ids(out.finished))
    finished.update(ids(s.schedule().finished))
    assert set(finished) == added and max(finished.values()) == 1
    assert s.block_manager.num_free_blocks == 12
