"""The engine's GPU slots: adapters of waiting requests prefetched into them (over idle adapters, never over
running ones, a few per step), and pinned adapters keeping theirs."""

from __future__ import annotations

import pytest

from lora_core.request import LoRARequest
from replicas.errors import InvalidRequestError
from replicas.llm import LLM
from tests.replicas.engine_cases import PROMPTS, greedy


@pytest.fixture(scope="module")
def lora_requests(loras):
    return list(loras.values())


def _greedy(n):
    return greedy(n, logprobs=1, ignore_eos=True)


def test_waiting_request_adapter_is_prefetched(demo, lora_requests):
    """max_num_seqs=1: while the first request decodes, the next one's adapter is loaded into a free slot."""
    first, second = lora_requests[0], lora_requests[1]
    small = dict(kv_cache_memory_bytes=16 << 20)  # two engines live at once: neither may take a GPU's memory
    llm = LLM(str(demo.model_dir), enable_lora=True, max_loras=2, max_lora_rank=32, dtype="float32", max_num_seqs=1,
              **small)
    engine, manager = llm.engine, llm.engine.executor.runner.lora_manager
    engine.add_lora(first)  # registered (host memory), so the second request waits for a slot, not a disk load
    engine.add_lora(second)
    engine.add_request("a", PROMPTS[0], _greedy(6), first)
    engine.add_request("b", PROMPTS[1], _greedy(6), second)
    engine.step()
    assert engine.scheduler.requests["b"].status.name == "WAITING"
    assert manager.slot_of(second.lora_int_id) is not None, "the waiting request's adapter holds a slot"
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
    free = LLM(str(demo.model_dir), enable_lora=True, max_loras=2, max_lora_rank=32, dtype="float32", **small)
    want = free.generate([PROMPTS[0], PROMPTS[1]], _greedy(6), [first, second])
    assert [outputs["a"].outputs[0].token_ids, outputs["b"].outputs[0].token_ids] == \
        [w.outputs[0].token_ids for w in want]


def _two_slots(demo, loras, max_num_seqs):
    """An engine with two GPU slots and these adapters registered (host memory): requests wait for a slot,
    not a disk load."""
    llm = LLM(str(demo.model_dir), enable_lora=True, max_loras=2, max_lora_rank=32, dtype="float32",
              max_num_seqs=max_num_seqs, kv_cache_memory_bytes=16 << 20)
    for lora in loras:
        llm.engine.add_lora(lora)
    return llm, llm.engine, llm.engine.executor.runner.lora_manager


def test_waiting_request_adapter_is_prefetched_over_an_idle_one(demo, lora_requests):
    """No free slot: the prefetch evicts the adapter no request uses (not the running one), so the waiting
    request's adapter is in a slot before the step that runs it (on a GPU, copied under the running step)."""
    idle, running, waiting = lora_requests[0], lora_requests[1], lora_requests[2]
    llm, engine, manager = _two_slots(demo, (idle, running, waiting), max_num_seqs=1)
    first = llm.generate([PROMPTS[2]], _greedy(2), idle)[0].outputs[0].token_ids
    engine.add_request("r", PROMPTS[0], _greedy(6), running)
    engine.add_request("w", PROMPTS[1], _greedy(6), waiting)
    engine.step()
    assert engine.scheduler.requests["w"].status.name == "WAITING"
    assert manager.slot_of(waiting.lora_int_id) is not None, "the waiting request's adapter holds a slot"
    assert manager.slot_of(running.lora_int_id) is not None and manager.slot_of(idle.lora_int_id) is None
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
    want = LLM(str(demo.model_dir), enable_lora=True, max_loras=3, max_lora_rank=32, dtype="float32",
               kv_cache_memory_bytes=16 << 20).generate([PROMPTS[2], PROMPTS[0], PROMPTS[1]], _greedy(6),
                                                        [idle, running, waiting])
    assert first == want[0].outputs[0].token_ids[:2]
    assert [outputs["r"].outputs[0].token_ids, outputs["w"].outputs[0].token_ids] == \
        [w.outputs[0].token_ids for w in want[1:]]


def test_a_prefetch_evicts_for_at_most_a_few_adapters(demo, lora_requests):
    """A burst of waiting adapters: one prefetch call evicts for PREFETCH_EVICTIONS of them (the copies a
    step can hide); the rest wait for later calls or their step."""
    from replicas.model_runner import PREFETCH_EVICTIONS

    idle = lora_requests[:3]
    more = [LoRARequest(f"{r.lora_name}-again", 100 + r.lora_int_id, r.lora_path) for r in idle]
    llm = LLM(str(demo.model_dir), enable_lora=True, max_loras=3, max_cpu_loras=6, max_lora_rank=32,
              dtype="float32", kv_cache_memory_bytes=16 << 20)
    runner = llm.engine.executor.runner
    for r in (*idle, *more):
        llm.engine.add_lora(r)
    for r in idle:
        runner.lora_manager.activate_adapter(r.lora_int_id)
    ids = [r.lora_int_id for r in more]
    assert PREFETCH_EVICTIONS < len(ids)
    assert runner.prefetch_loras(ids) == ids[:PREFETCH_EVICTIONS]
    assert sorted(runner.lora_manager.lora_index_to_id) == sorted(ids[:PREFETCH_EVICTIONS] + [idle[-1].lora_int_id])


def test_prefetch_never_evicts_adapters_of_running_requests(demo, lora_requests):
    """Both slots belong to running requests: a waiting request's adapter gets none until one finishes."""
    a, b, waiting = lora_requests[0], lora_requests[1], lora_requests[2]
    _, engine, manager = _two_slots(demo, (a, b, waiting), max_num_seqs=2)
    engine.add_request("a", PROMPTS[0], _greedy(4), a)
    engine.add_request("b", PROMPTS[1], _greedy(8), b)
    engine.add_request("w", PROMPTS[2], _greedy(4), waiting)
    engine.step()
    assert engine.scheduler.requests["w"].status.name == "WAITING"
    assert manager.slot_of(waiting.lora_int_id) is None
    assert {manager.slot_of(a.lora_int_id), manager.slot_of(b.lora_int_id)} == {0, 1}
    done = set()
    while engine.has_unfinished_requests():
        done |= {out.request_id for out in engine.step() if out.finished}
    assert done == {"a", "b", "w"}


def test_pinned_adapters_keep_their_slots_and_others_still_run(demo, lora_requests):
    sql, chat, summarize = lora_requests[1], lora_requests[0], lora_requests[2]
    llm = LLM(str(demo.model_dir), enable_lora=True, max_loras=2, max_lora_rank=32, dtype="float32")
    engine = llm.engine
    engine.add_lora(sql)
    engine.add_lora(chat)
    assert engine.pin_lora(sql.lora_name)
    with pytest.raises(InvalidRequestError, match="no GPU slot for unpinned"):
        engine.pin_lora(chat.lora_name)  # the last free slot stays for everyone else
    outs = llm.generate(PROMPTS[:3], _greedy(4), [chat, summarize, sql])
    assert all(o.error is None and len(o.outputs[0].token_ids) == 4 for o in outs)
    manager = engine.executor.runner.lora_manager
    assert manager.slot_of(sql.lora_int_id) is not None and manager.is_pinned(sql.lora_int_id)
