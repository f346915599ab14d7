"""Scheduling end to end on the demo checkpoint (CPU, float32): prefix caching, preemption,
continuous batching, adapter slots and abort.

The reference for every scheduling feature is the same requests on an unconstrained engine:
batching, caching and preemption may change when tokens are computed, never which.
"""

from __future__ import annotations

import pytest

from lora_core.request import LoRARequest
from tests.replicas.engine_cases import (  # noqa: F401  (make_llm, llm: fixtures)
    LONG_TEXT, PROMPTS, assert_no_leaked_blocks, greedy, llm, make_llm, register, run_steps, seeded, submit, tokens)


# ---- prefix caching ---------------------------------------------------------------------------


def test_prefix_caching_reuses_blocks_per_adapter(llm, make_llm, loras):
    tok = llm.engine.tokenizer
    prefix = tok.encode(LONG_TEXT)
    assert len(prefix) >= 5 * 16
    prefix = prefix[:80]  # five full blocks
    suffixes = [tok.encode(" and then", add_special_tokens=False), tok.encode(" but not", add_special_tokens=False)]
    first, second = ({"prompt_token_ids": prefix + s} for s in suffixes)
    sql, chat = loras["demo-sql"], loras["demo-chat"]
    cases = [(first, sql), (second, sql), (first, sql), (second, chat), (second, None)]
    # reused tokens: whole blocks of the shared prefix (never the last prompt token)
    shared = 80 + len(_common_prefix(*suffixes))
    expected_hits = [0, shared // 16 * 16, (len(first["prompt_token_ids"]) - 1) // 16 * 16, 0, 0]

    cached = make_llm()
    bm = cached.engine.scheduler.block_manager
    got, hits = [], []
    for prompt, lora in cases:  # one at a time: blocks are offered once their KV is written
        before = bm.num_cache_hit_tokens
        got += tokens(cached.generate(prompt, greedy(12), lora))
        hits.append(bm.num_cache_hit_tokens - before)
    assert hits == expected_hits
    assert_no_leaked_blocks(cached)

    plain = make_llm(enable_prefix_caching=False)
    fresh = [tokens(plain.generate(prompt, greedy(12), lora))[0] for prompt, lora in cases]
    assert plain.engine.scheduler.block_manager.num_cache_hit_tokens == 0
    assert got == fresh
    assert fresh[1] != fresh[3] != fresh[4]  # the adapters really differ on this prompt


def _common_prefix(a: list[int], b: list[int]) -> list[int]:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def test_remove_lora_after_use(make_llm, loras):
    llm = make_llm()
    tokens(llm.generate(PROMPTS[0], greedy(4), loras["demo-sql"]))
    assert llm.engine.remove_lora("demo-sql")
    assert llm.engine.list_loras() == []


def test_readded_lora_id_does_not_reuse_stale_prefix(make_llm, loras):
    llm = make_llm()
    prompt = {"prompt_token_ids": llm.engine.tokenizer.encode(LONG_TEXT)[:40]}
    chat_as_1 = LoRARequest("demo-chat", 1, loras["demo-chat"].lora_path)
    tokens(llm.generate(prompt, greedy(8), LoRARequest("demo-sql", 1, loras["demo-sql"].lora_path)))
    tokens(llm.generate(PROMPTS[0], greedy(1)))  # a base-only step, so remove_lora is not refused (see above)
    assert llm.engine.remove_lora("demo-sql")
    got = tokens(llm.generate(prompt, greedy(8), chat_as_1))[0]
    assert got == tokens(make_llm().generate(prompt, greedy(8), chat_as_1))[0]


# ---- preemption -------------------------------------------------------------------------------


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix_cache", "no_prefix_cache"])
def test_preemption_by_recompute_is_lossless(make_llm, loras, prefix_caching):
    """6 requests of up to 44 tokens (3 blocks) each in a 5-block cache: they are admitted together
    and must preempt each other as they grow, yet produce exactly the unconstrained results."""
    lora_list = [None, loras["demo-sql"], loras["demo-chat"], None, loras["demo-summarize"],
                 loras["demo-translate"]]
    params = [greedy(36)] * 5 + [seeded(5, max_tokens=36)]  # a seeded draw resumes its own stream
    reference = tokens(make_llm().generate(PROMPTS, params, lora_list))

    small = make_llm(num_kv_blocks=5, block_size=16, enable_prefix_caching=prefix_caching)
    seqs = submit(small.engine, PROMPTS, params, lora_list)
    final = run_steps(small.engine)

    assert sorted(final) == sorted(seqs)  # none lost
    assert sum(s.num_preemptions for s in seqs.values()) > 0
    for i, ref in enumerate(reference):
        completion = final[str(i)].outputs[0]
        assert completion.finish_reason == "length"
        assert completion.token_ids == ref, f"request {i} (preempted {seqs[str(i)].num_preemptions}x)"
    assert_no_leaked_blocks(small)


# ---- continuous batching ----------------------------------------------------------------------


def test_max_num_seqs_continuous_batching(make_llm):
    lengths = [4, 9, 6, 12, 5]
    params = [greedy(n) for n in lengths]
    reference = tokens(make_llm().generate(PROMPTS[:5], params))

    llm = make_llm(max_num_seqs=2)
    engine = llm.engine
    for i, (prompt, p) in enumerate(zip(PROMPTS, params)):
        engine.add_request(str(i), prompt, p)
    progress: list[dict[str, int]] = []

    def check():
        assert engine.scheduler.num_running <= 2
        progress.append({s.request_id: s.num_output_tokens for s in engine.scheduler.running})

    final = run_steps(engine, check)
    assert [final[str(i)].outputs[0].token_ids for i in range(5)] == reference
    assert all(final[str(i)].outputs[0].finish_reason == "length" for i in range(5))
    # requests join while others are mid-generation, not in waves
    joined_mid = any(cur.keys() - prev.keys() and cur.keys() & prev.keys() for prev, cur in zip(progress, progress[1:]))
    assert joined_mid, progress
    assert len(progress) < sum(lengths)  # it batched
    assert_no_leaked_blocks(llm)


def test_chunked_prefill_small_token_budget(make_llm):
    prompts = [LONG_TEXT, PROMPTS[0], LONG_TEXT[:90]]
    reference = tokens(make_llm().generate(prompts, greedy(8)))
    llm = make_llm(max_num_batched_tokens=16)
    assert tokens(llm.generate(prompts, greedy(8))) == reference


def test_max_loras_one_slot(make_llm, loras):
    lora_list = [loras["demo-sql"], loras["demo-chat"], None, loras["demo-summarize"], None, loras["demo-sql"]]
    params = [greedy(6), greedy(6), greedy(14), greedy(6), greedy(10), greedy(6)]
    reference = tokens(make_llm().generate(PROMPTS, params, lora_list))

    llm = make_llm(max_loras=1, max_cpu_loras=3)  # all three stay in host memory: no reload to wait for
    engine = llm.engine
    register(engine, lora_list)
    for i, (prompt, p, lora) in enumerate(zip(PROMPTS, params, lora_list)):
        engine.add_request(str(i), prompt, p, lora)
    batches: list[set[str]] = []

    def check():
        assert len(engine.scheduler.running_lora_ids()) <= 1
        batches.append({s.request_id for s in engine.scheduler.running})

    final = run_steps(engine, check)
    assert [final[str(i)].outputs[0].token_ids for i in range(6)] == reference
    # no head-of-line blocking: base requests behind waiting adapters run with the first adapter,
    # and both sql requests share its slot
    assert {"0", "2", "4", "5"} <= batches[0]
    assert "1" not in batches[0] and "3" not in batches[0]
    assert_no_leaked_blocks(llm)


# ---- abort ------------------------------------------------------------------------------------


def test_abort_between_steps(make_llm, loras):
    lora_list = [None, loras["demo-sql"], None, loras["demo-chat"]]
    reference = tokens(make_llm().generate(PROMPTS[:4], greedy(10), lora_list))

    llm = make_llm(max_num_seqs=3)
    engine = llm.engine
    register(engine, lora_list)
    for i, lora in enumerate(lora_list):
        engine.add_request(str(i), PROMPTS[i], greedy(10), lora)
    final = {}
    for _ in range(2):
        final |= {o.request_id: o for o in engine.step() if o.finished}
    assert not final
    assert engine.scheduler.num_waiting == 1  # request 3 waits for a seat
    assert engine.abort("1")  # running, 2 tokens in
    assert engine.abort("3")  # still waiting
    assert not engine.abort("no-such-request")
    assert not engine.abort("1")  # already gone
    final |= run_steps(engine)

    assert sorted(final) == ["0", "1", "2", "3"]
    for rid, n in (("1", 2), ("3", 0)):
        completion = final[rid].outputs[0]
        assert completion.finish_reason == "abort"
        assert completion.token_ids == reference[int(rid)][:n]
        assert completion.text == llm.engine.tokenizer.decode(completion.token_ids)
    for rid in ("0", "2"):
        assert final[rid].outputs[0].finish_reason == "length"
        assert final[rid].outputs[0].token_ids == reference[int(rid)]
    assert_no_leaked_blocks(llm)



def test_an_abort_is_reported_when_nothing_else_runs(llm):
    engine = llm.engine
    engine.add_request("alone", PROMPTS[0], greedy(50))
    engine.step()
    assert engine.abort("alone") and engine.has_unfinished_requests()
    out = run_steps(engine)["alone"].outputs[0]
    assert out.finish_reason == "abort" and len(out.token_ids) == 1
    assert not engine.has_unfinished_requests()


def test_request_ids_reused_as_soon_as_they_were_reported(llm):
    """The scheduler reports a finished sequence again at the next step. That report once removed the new
    request that had taken the id meanwhile when the new one was not in the step (here: a completion held
    back for its sibling's prompt), which then failed with KeyError."""
    engine = llm.engine
    want = tokens(llm.generate(LONG_TEXT, greedy(3)))[0]
    for _ in range(2):  # completion 1 finishes a step after completion 0, and is reported again after that
        engine.add_request("again", LONG_TEXT, greedy(3, n=2))
        final = run_steps(engine)
        assert [c.token_ids for c in final["again"].outputs] == [want, want]
    assert_no_leaked_blocks(llm)
