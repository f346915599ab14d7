"""Parallel sampling (SamplingParams.n > 1, replicas/parallel_sampling.py) on the demo checkpoint (CPU, float32):
n completions in one output, each what its own request would give; abort, clashes and a failed adapter."""

from __future__ import annotations

import dataclasses

import pytest

from lora_core.request import LoRARequest
from replicas.errors import InvalidRequestError
from replicas.outputs import CompletionOutput, RequestOutput
from replicas.parallel_sampling import FanOut, child_id
from replicas.sampling_params import SamplingParams
from tests.replicas.engine_cases import (  # noqa: F401  (make_llm, llm: fixtures)
    LONG_TEXT, PROMPTS, assert_no_leaked_blocks, greedy, llm, make_llm, run_steps, seeded, tokens)


def test_n_seeded_completions_equal_n_requests_seeded_one_apart(llm, loras):
    """Completion i of a seeded request with n = 3 samples as the n = 1 request with seed + i (adapter too),
    inside a batch with other requests."""
    sql = loras["demo-sql"]
    alone = [tokens(llm.generate(PROMPTS[1], seeded(1234 + i), sql))[0] for i in range(3)]
    assert len({tuple(t) for t in alone}) == 3  # the seeds give three different completions
    batch = llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2]],
                         [greedy(10), dataclasses.replace(seeded(1234), n=3), seeded(7)], [None, sql, sql])
    out = batch[1]
    assert out.error is None and out.finished and out.lora_name == "demo-sql"
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert [c.token_ids for c in out.outputs] == alone
    assert all(c.finish_reason == "length" for c in out.outputs)
    assert batch[0].outputs[0].token_ids == tokens(llm.generate(PROMPTS[0], greedy(10)))[0]
    assert len(batch[0].outputs) == 1 and len(batch[2].outputs) == 1
    assert_no_leaked_blocks(llm)


def test_greedy_completions_agree(llm):
    want = tokens(llm.generate(PROMPTS[3], greedy(12)))[0]
    out = llm.generate(PROMPTS[3], greedy(12, n=4, logprobs=2))[0]
    assert [c.token_ids for c in out.outputs] == [want] * 4
    assert all(len(c.logprobs) == 12 for c in out.outputs)



@pytest.mark.parametrize("prefix_caching", [True, False])
def test_completions_compute_a_shared_prompt_once(make_llm, loras, prefix_caching):
    """With prefix caching the first completion computes the prompt and the others, a step later, take its
    full blocks from the cache; without it each computes the prompt, in the same step. Either way each
    completion is what the n = 1 request gives."""
    sql = loras["demo-sql"]
    llm = make_llm(enable_prefix_caching=prefix_caching)
    engine, bm = llm.engine, llm.engine.scheduler.block_manager
    want = tokens(make_llm(enable_prefix_caching=False).generate(LONG_TEXT, greedy(6), sql))[0]
    full = (len(engine.tokenizer.encode(LONG_TEXT)) - 1) // bm.block_size * bm.block_size
    engine.add_lora(sql)
    engine.add_request("long", LONG_TEXT, greedy(6, n=3), sql)
    engine.step()
    started = sorted(rid for rid, seq in engine.scheduler.requests.items() if seq.num_computed_tokens)
    assert started == (["long#0"] if prefix_caching else ["long#0", "long#1", "long#2"])
    final = run_steps(engine)["long"]
    assert [c.token_ids for c in final.outputs] == [want] * 3
    assert bm.num_cache_hit_tokens == (2 * full if prefix_caching else 0) and full >= 4 * bm.block_size
    assert_no_leaked_blocks(llm)

def test_one_output_per_step_for_the_request_until_it_finishes(llm):
    """The engine reports the parent, never its children; each report holds all n completions so far."""
    engine = llm.engine
    engine.add_request("par", PROMPTS[4], SamplingParams(n=3, temperature=1.0, max_tokens=6, seed=5))
    seen = []
    while engine.has_unfinished_requests():
        outs = engine.step()
        assert [o.request_id for o in outs if o.request_id != "par"] == []
        seen += outs
    assert sum(o.request_id == "par" for o in seen) == len(seen) and seen[-1].finished
    assert [o.finished for o in seen].count(True) == 1
    for earlier, later in zip(seen, seen[1:]):
        for a, b in zip(earlier.outputs, later.outputs, strict=True):
            assert b.token_ids[:len(a.token_ids)] == a.token_ids  # cumulative, per completion
    assert [len(c.token_ids) for c in seen[-1].outputs] == [6, 6, 6]


def test_abort_stops_every_completion(llm):
    engine = llm.engine
    engine.add_request("ab", PROMPTS[5], SamplingParams(n=3, temperature=1.0, max_tokens=50))
    engine.add_request("other", PROMPTS[0], greedy(8))
    engine.step()
    assert engine.abort("ab") and not engine.abort("ab#7")
    final = run_steps(engine)
    assert set(final) == {"ab", "other"}
    assert [c.finish_reason for c in final["ab"].outputs] == ["abort"] * 3
    assert final["other"].outputs[0].finish_reason == "length"
    assert not engine.abort("ab")  # gone once reported
    assert_no_leaked_blocks(llm)


def test_ids_clash_with_a_request_or_a_completion(llm):
    engine = llm.engine
    engine.add_request("dup", PROMPTS[0], greedy(2, n=2))
    for rid, params in (("dup", greedy(2)), ("dup#1", greedy(2)), ("dup", greedy(2, n=3))):
        with pytest.raises(InvalidRequestError, match="already in use"):
            engine.add_request(rid, PROMPTS[1], params)
    engine.add_request("x#1", PROMPTS[0], greedy(2))
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("x", PROMPTS[1], greedy(2, n=2))  # its second completion would be "x#1"
    final = run_steps(engine)
    assert set(final) == {"dup", "x#1"} and len(final["dup"].outputs) == 2  # nothing of "x" was added


def test_a_broken_adapter_fails_the_request_once_and_the_engine_serves_on(llm, tmp_path):
    out = llm.generate(["Hello"], greedy(2, n=3), [LoRARequest("broken-n", 19, str(tmp_path))])[0]
    assert isinstance(out.error, InvalidRequestError) and "adapter_config.json" in str(out.error)
    assert out.finished and len(out.outputs) == 3
    assert tokens(llm.generate("Hello", greedy(3, n=2)))[0] == tokens(llm.generate("Hello", greedy(3)))[0]
    assert not llm.engine.has_unfinished_requests()
    assert_no_leaked_blocks(llm)


def _out(rid: str, tokens: list[int], finished: bool = False, error: Exception | None = None) -> RequestOutput:
    reason = "error" if error else ("length" if finished else None)
    return RequestOutput(rid, "p", [1, 2], [CompletionOutput(0, "t" * len(tokens), tokens, None, reason)],
                         finished or error is not None, None, error)


def test_fan_out_drops_the_siblings_of_a_failed_child_until_their_last_output():
    fan, aborted = FanOut(), []
    fan.add("r", 3)
    got = fan.merge([_out(child_id("r", 0), [5]), _out("other", [1])], aborted.append)
    assert [o.request_id for o in got] == ["other", "r"]
    assert [c.token_ids for c in got[1].outputs] == [[5], [], []] and not got[1].finished
    boom = ValueError("bad adapter")
    got = fan.merge([_out(child_id("r", 1), [], error=boom), _out(child_id("r", 2), [7])], aborted.append)
    assert [(o.request_id, o.error, o.finished) for o in got] == [("r", boom, True)]
    assert sorted(aborted) == [child_id("r", 0), child_id("r", 2)] and "r" not in fan
    # the aborted siblings' later outputs (their abort reports) are not news
    assert fan.merge([_out(child_id("r", 0), [5], finished=True), _out(child_id("r", 2), [7, 8]),
                      _out(child_id("r", 2), [7, 8], finished=True)], aborted.append) == []
    # a new request may reuse the ids afterwards
    passthrough = _out(child_id("r", 2), [9])
    assert fan.merge([passthrough], aborted.append) == [passthrough]


@pytest.mark.gpu
def test_n_completions_on_the_gpu_equal_n_requests(make_llm, loras):
    """On CUDA (decode steps through CUDA graphs, sampling on the device): completion i of a seeded n = 3 request
    is the n = 1 request seeded seed + i, with an adapter, and greedy completions agree."""
    gpu = make_llm(device="cuda")
    assert gpu.engine.num_cuda_graphs > 0
    sql = loras["demo-sql"]
    alone = [tokens(gpu.generate(PROMPTS[1], seeded(99 + i), sql))[0] for i in range(3)]
    assert len({tuple(t) for t in alone}) == 3
    out = gpu.generate([PROMPTS[1], PROMPTS[3]], [dataclasses.replace(seeded(99), n=3), greedy(12, n=4)],
                       [sql, None])
    assert [c.token_ids for c in out[0].outputs] == alone
    assert [c.token_ids for c in out[1].outputs] == [tokens(gpu.generate(PROMPTS[3], greedy(12)))[0]] * 4
    assert_no_leaked_blocks(gpu)
