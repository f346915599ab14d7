"""Engine features end to end on the demo checkpoint (CPU, float32): stopping, seeded sampling,
logprobs, penalties, prefix caching, preemption, continuous batching and abort.

The reference for every scheduling feature is the same requests on an unconstrained engine:
batching, caching and preemption may change when tokens are computed, never which.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest

from lora_core.request import LoRARequest
from replicas.llm import LLM
from replicas.sampling_params import SamplingParams

PROMPTS = ["The quick brown fox", "Once upon a time in a city far away,", "SELECT", "Hello world, this is",
           "When a request arrives, the router", "Every morning the baker"]
LONG_TEXT = ("The quick brown fox jumps over the lazy dog. A serving system answers many requests at once, and "
             "each request may ask for a different adapter. The base model stays in memory while small low-rank "
             "adapters come and go. When a request arrives, the router looks for a replica that already holds its "
             "adapter; if none does, it picks the least busy one, which then loads the adapter from its host cache.")


@pytest.fixture(scope="module")
def make_llm(demo):
    def make(model_dir=None, **kwargs) -> LLM:
        kwargs = dict(enable_lora=True, max_loras=4, max_lora_rank=32, dtype="float32", device="cpu") | kwargs
        return LLM(str(model_dir or demo.model_dir), **kwargs)

    return make


def register(engine, lora_list) -> None:
    """Load the adapters up front: a request naming an unregistered adapter waits for its background
    load outside the scheduler, and these tests check the scheduler's order from the first step."""
    for lora in {l.lora_name: l for l in lora_list if l is not None}.values():
        engine.add_lora(lora)


@pytest.fixture(scope="module")
def llm(make_llm):
    return make_llm()


def greedy(max_tokens: int = 16, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def seeded(seed: int, max_tokens: int = 24, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=seed, max_tokens=max_tokens, **kwargs)


def tokens(outputs) -> list[list[int]]:
    for out in outputs:
        assert out.error is None, out.error
    return [out.outputs[0].token_ids for out in outputs]


def run_steps(engine, on_step=None) -> dict[str, object]:
    """Step the engine until it is idle; request id -> its final RequestOutput (each reported once)."""
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert out.request_id not in final, f"{out.request_id} finished twice"
                final[out.request_id] = out
        if on_step is not None:
            on_step()
    return final


def assert_no_leaked_blocks(llm: LLM) -> None:
    bm = llm.engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


# ---- stopping ---------------------------------------------------------------------------------


def _spanning_stop(tokenizer, token_ids: list[int]) -> tuple[int, int, str]:
    """(j, b, s): a 4-character stop string s = last 2 characters of token j-1 + first 2 of token j,
    whose first occurrence in the text starts at b - 2, b being where token j's text begins."""
    text = tokenizer.decode(token_ids)
    ends = [len(tokenizer.decode(token_ids[: i + 1])) for i in range(len(token_ids))]
    for j in range(2, len(token_ids)):
        b = ends[j - 1]
        if tokenizer.decode(token_ids[:j]) != text[:b] or tokenizer.decode(token_ids[: j + 1]) != text[: ends[j]]:
            continue  # a character split over tokens: no clean boundary here
        prev, piece = text[ends[j - 2] : b], text[b : ends[j]]
        s = text[b - 2 : b + 2]
        if len(prev) >= 2 and len(piece) >= 2 and s.isascii() and s.isprintable() and text.find(s) == b - 2:
            return j, b, s
    raise AssertionError(f"no stop string spanning two tokens in {text!r}")


@pytest.fixture(scope="module")
def first_run(llm):
    """A greedy base-model run long enough to pick stop strings and stop tokens from."""
    out = llm.generate(PROMPTS[0], greedy(32))[0]
    completion = out.outputs[0]
    assert completion.finish_reason == "length" and len(completion.token_ids) == 32
    assert completion.text == llm.engine.tokenizer.decode(completion.token_ids)
    return completion


def test_stop_string_spanning_tokens(llm, first_run):
    j, b, stop = _spanning_stop(llm.engine.tokenizer, first_run.token_ids)
    never = "\x07never\x07"
    for include in (False, True):
        params = greedy(32, stop=[never, stop], include_stop_str_in_output=include)
        completion = llm.generate(PROMPTS[0], params)[0].outputs[0]
        assert completion.finish_reason == "stop"
        assert completion.stop_reason == stop
        # generation ends at the token that completes the stop string (token j)
        assert completion.token_ids == first_run.token_ids[: j + 1]
        assert completion.text == first_run.text[: b + 2 if include else b - 2]
        assert (stop in completion.text) is include


def test_stop_string_on_last_allowed_token_is_stop(llm, first_run):
    j, b, stop = _spanning_stop(llm.engine.tokenizer, first_run.token_ids)
    completion = llm.generate(PROMPTS[0], greedy(j + 1, stop=stop))[0].outputs[0]
    assert completion.text == first_run.text[: b - 2]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)


def _first_new_token(token_ids: list[int], start: int) -> int:
    """The first index >= start whose token did not occur before it."""
    return next(i for i in range(start, len(token_ids)) if token_ids[i] not in token_ids[:i])


def test_stop_token_ids(llm, first_run):
    k = _first_new_token(first_run.token_ids, 4)
    stop_id = first_run.token_ids[k]
    completion = llm.generate(PROMPTS[0], greedy(32, stop_token_ids=[stop_id]))[0].outputs[0]
    assert completion.token_ids == first_run.token_ids[: k + 1]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop_id)


def test_stop_token_text_is_excluded(llm, first_run):
    tok = llm.engine.tokenizer
    k = _first_new_token(first_run.token_ids, 4)
    stop_id = first_run.token_ids[k]
    for include in (False, True):
        params = greedy(32, stop_token_ids=[stop_id], include_stop_str_in_output=include)
        completion = llm.generate(PROMPTS[0], params)[0].outputs[0]
        assert completion.text == tok.decode(first_run.token_ids[: k + 1 if include else k])


def test_held_back_stop_prefix_is_released_at_length(llm, first_run):
    """Text that might have begun a stop string is held back while streaming, and released when the output ends."""
    stop = first_run.text[-2:] + "\x07"
    completion = llm.generate(PROMPTS[0], greedy(32, stop=stop))[0].outputs[0]
    assert (completion.finish_reason, completion.stop_reason) == ("length", None)
    assert completion.text == first_run.text


def test_max_tokens_is_length(llm, first_run):
    completion = llm.generate(PROMPTS[0], greedy(7))[0].outputs[0]
    assert completion.token_ids == first_run.token_ids[:7]
    assert (completion.finish_reason, completion.stop_reason) == ("length", None)
    assert completion.text == llm.engine.tokenizer.decode(first_run.token_ids[:7])


def test_eos_and_ignore_eos(demo, make_llm, first_run, tmp_path):
    """The demo never picks its real EOS greedily, so a copy of the model declares a token it does pick as EOS."""
    k = _first_new_token(first_run.token_ids, 3)
    eos = first_run.token_ids[k]
    model = tmp_path / "model"
    model.mkdir()
    for f in demo.model_dir.iterdir():
        (model / f.name).symlink_to(f)
    (model / "generation_config.json").unlink()
    gen = json.loads((demo.model_dir / "generation_config.json").read_text()) | {"eos_token_id": [2, eos]}
    (model / "generation_config.json").write_text(json.dumps(gen))

    llm = make_llm(model, enable_lora=False)
    stopped, ignored = llm.generate([PROMPTS[0]] * 2, [greedy(32), greedy(32, ignore_eos=True)])
    assert stopped.outputs[0].token_ids == first_run.token_ids[: k + 1]
    assert (stopped.outputs[0].finish_reason, stopped.outputs[0].stop_reason) == ("stop", None)
    assert ignored.outputs[0].token_ids == first_run.token_ids
    assert ignored.outputs[0].finish_reason == "length"


# ---- seeded sampling --------------------------------------------------------------------------


def test_seeded_sampling_reproducible_and_batch_independent(llm, make_llm, loras):
    sql = loras["demo-sql"]
    alone_base = tokens(llm.generate(PROMPTS[1], seeded(1234)))[0]
    alone_sql = tokens(llm.generate(PROMPTS[1], seeded(1234), sql))[0]
    # across runs and across engines
    assert tokens(llm.generate(PROMPTS[1], seeded(1234)))[0] == alone_base
    assert tokens(make_llm().generate(PROMPTS[1], seeded(1234)))[0] == alone_base
    # it really samples: not the greedy path, and the seed matters
    assert alone_base != tokens(llm.generate(PROMPTS[1], greedy(24)))[0]
    assert tokens(llm.generate(PROMPTS[1], seeded(4321)))[0] != alone_base
    assert alone_sql != alone_base

    # the same requests inside a batch of 6: other adapters, prompts, unseeded and greedy neighbours
    prompts = [PROMPTS[2], PROMPTS[1], PROMPTS[3], PROMPTS[1], PROMPTS[4], PROMPTS[5]]
    params = [SamplingParams(temperature=1.0, max_tokens=30), seeded(1234), greedy(10), seeded(1234),
              seeded(99, max_tokens=5), SamplingParams(temperature=0.5, top_k=5, max_tokens=20)]
    lora_list = [loras["demo-chat"], None, loras["demo-translate"], sql, loras["demo-summarize"], sql]
    batch = tokens(llm.generate(prompts, params, lora_list))
    assert batch[1] == alone_base
    assert batch[3] == alone_sql


# ---- logprobs ---------------------------------------------------------------------------------


def test_logprobs_greedy(llm):
    five, zero = llm.generate([PROMPTS[2]] * 2, [greedy(12, logprobs=5), greedy(12, logprobs=0)])
    five, zero = five.outputs[0], zero.outputs[0]
    assert five.token_ids == zero.token_ids
    assert len(five.logprobs) == len(zero.logprobs) == 12
    for token, top, only in zip(five.token_ids, five.logprobs, zero.logprobs):
        assert len(top) == 5  # greedy: the sampled token is the top-1, counted once
        assert max(top, key=top.get) == token
        assert all(v <= 0 for v in top.values())
        assert list(only) == [token]
        assert only[token] == pytest.approx(top[token], abs=1e-5)


def test_logprobs_sampled_are_raw_model_logprobs(llm):
    """Sampled run (temperature 0.8): k or k+1 entries; the values are the raw model's, as a greedy
    run over the same context (prompt + the sampled tokens so far) reports them."""
    k = 3
    sampled = llm.generate(PROMPTS[3], seeded(7, max_tokens=12, logprobs=k))[0].outputs[0]
    assert len(sampled.logprobs) == 12
    for token, entry in zip(sampled.token_ids, sampled.logprobs):
        assert len(entry) in (k, k + 1) and token in entry
        if len(entry) == k + 1:  # the sampled token is outside the top k
            assert entry[token] <= min(v for t, v in entry.items() if t != token)
    prompt_ids = llm.engine.tokenizer.encode(PROMPTS[3])
    steps = [0, 1, 5, 11]
    forced = llm.generate([{"prompt_token_ids": prompt_ids + sampled.token_ids[:t]} for t in steps],
                          greedy(1, logprobs=20))
    for t, out in zip(steps, forced):
        reference = out.outputs[0].logprobs[0]
        top_k = sorted(reference, key=reference.get, reverse=True)[:k]
        assert set(top_k) <= set(sampled.logprobs[t])
        for token_id, value in sampled.logprobs[t].items():
            if token_id in reference:
                assert value == pytest.approx(reference[token_id], abs=1e-4)


# ---- penalties --------------------------------------------------------------------------------


def _repeats(token_ids: list[int]) -> int:
    return len(token_ids) - len(set(token_ids))


@pytest.mark.parametrize("penalty", [dict(presence_penalty=1.5), dict(frequency_penalty=1.5)],
                         ids=["presence", "frequency"])
def test_penalties_reduce_repetition(llm, penalty):
    prompts = PROMPTS[:4]
    plain = tokens(llm.generate(prompts, greedy(128)))
    penalized = tokens(llm.generate(prompts, greedy(128, **penalty)))
    for a, b in zip(plain, penalized):
        assert a[0] == b[0]  # nothing generated yet: nothing to penalise
        assert a != b
        assert _repeats(b) <= _repeats(a)
    assert sum(map(_repeats, penalized)) < sum(map(_repeats, plain))
    # a negative penalty rewards repetition
    negative = {name: -2.0 for name in penalty}
    rewarded = tokens(llm.generate(prompts, greedy(128, **negative)))
    assert sum(map(_repeats, rewarded)) > sum(map(_repeats, plain))


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
    engine = small.engine
    register(engine, lora_list)
    for i, (prompt, p, lora) in enumerate(zip(PROMPTS, params, lora_list)):
        engine.add_request(str(i), prompt, p, lora)
    seqs = dict(engine.scheduler.requests)
    final = run_steps(engine)

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

    llm = make_llm(max_loras=1)
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
