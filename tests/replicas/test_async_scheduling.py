"""Async scheduling (EngineArgs.async_scheduling): step N+1 launches before step N's tokens are read back.

It must change when the host learns a token, never which tokens come out: every
test compares against the same engine with async_scheduling=False (CPU,
float32, the demo checkpoint and adapters).
"""

from __future__ import annotations

import pytest

from replicas.sequence import PENDING_TOKEN
from tests.replicas.engine_cases import (PROMPTS, assert_no_leaked_blocks, greedy, make_llm,  # noqa: F401  (fixture)
                                         run_steps, seeded, submit)


def _adapters(loras):
    names = sorted(loras)
    return [loras[names[0]], None, loras[names[1]], loras[names[2]], None, loras[names[3]]]


def _summary(outputs):
    rows = []
    for out in outputs:
        assert out.error is None, out.error
        c = out.outputs[0]
        rows.append((c.token_ids, c.text, c.finish_reason, c.stop_reason))
    return rows


def _stopping_params(reference):
    """Per prompt, settings that end it early at different points, read off a free-running reference."""
    params = []
    for i, out in enumerate(reference):
        ids, text = out.outputs[0].token_ids, out.outputs[0].text
        kind = i % 3
        if kind == 0:  # a stop token id, sampled at the 4th step
            params.append(greedy(16, stop_token_ids=[ids[3]], logprobs=2))
        elif kind == 1 and len(text.strip()) > 8:  # a stop string from the middle of the text
            params.append(greedy(16, stop=[text[len(text) // 2 : len(text) // 2 + 3]]))
        else:
            params.append(greedy(5 + i, presence_penalty=0.5, frequency_penalty=0.3))
    return params


def test_async_is_off_by_default_on_cpu_and_can_be_forced(make_llm):  # noqa: F811
    assert not make_llm().engine.async_scheduling  # a CPU step runs synchronously: nothing to overlap
    assert make_llm(async_scheduling=True).engine.async_scheduling


# Three sequences at a time and small prefill chunks: prompts keep joining while others decode.
MIXED = dict(max_num_seqs=3, max_num_batched_tokens=24)


@pytest.fixture(params=[True, False], ids=["read-back-before-prompts", "prompts-overlap"])
def make_async(request, make_llm):  # noqa: F811
    """An async engine in both modes of steps with prompt tokens: the previous tokens read back before
    them (eager prompt steps), or launched under them as decode steps are (GPU, piecewise graphs).
    engine.prompt_fills counts prompt steps launched with pending tokens to copy in."""
    def make(**kwargs):
        llm = make_llm(async_scheduling=True, **kwargs)
        engine = llm.engine
        engine.read_back_before_prompt_steps = request.param
        engine.prompt_fills = 0
        step_input = engine._step_input

        def counting(out, previous):
            step, tokens = step_input(out, previous)
            engine.prompt_fills += bool(step.is_prefill and step.fill_rows)
            return step, tokens

        engine._step_input = counting
        return llm

    return make


def test_prompt_steps_overlap_only_where_they_replay_graphs(make_llm):  # noqa: F811
    assert make_llm(async_scheduling=True).engine.read_back_before_prompt_steps  # CPU: eager prompt steps


def test_stops_penalties_and_logprobs_equal_sync(make_llm, make_async, loras):  # noqa: F811
    lora_list = _adapters(loras)
    sync, fast = make_llm(async_scheduling=False, **MIXED), make_async(**MIXED)
    params = _stopping_params(sync.generate(PROMPTS, [greedy(16) for _ in PROMPTS], lora_list))
    want = sync.generate(PROMPTS, params, lora_list)
    got = fast.generate(PROMPTS, params, lora_list)
    assert _summary(got) == _summary(want)
    # Overlapped, prompt steps really took pending tokens; read back first, never.
    assert (fast.engine.prompt_fills > 0) != fast.engine.read_back_before_prompt_steps
    assert {w.outputs[0].finish_reason for w in want} >= {"stop", "length"}  # both kinds of ending ran
    for g, w in zip(got, want, strict=True):
        if w.outputs[0].logprobs is not None:
            assert [d.keys() for d in g.outputs[0].logprobs] == [d.keys() for d in w.outputs[0].logprobs]
            for gd, wd in zip(g.outputs[0].logprobs, w.outputs[0].logprobs, strict=True):
                assert all(abs(gd[k] - wd[k]) < 1e-4 for k in gd)
    assert_no_leaked_blocks(fast)  # the token computed after a stop was dropped with its blocks


def test_seeded_sampling_equals_sync(make_llm, loras):  # noqa: F811
    lora_list = _adapters(loras)
    params = [seeded(10 + i, max_tokens=12) for i in range(len(PROMPTS))]
    want = make_llm(async_scheduling=False).generate(PROMPTS, params, lora_list)
    assert _summary(make_llm(async_scheduling=True).generate(PROMPTS, params, lora_list)) == _summary(want)


def test_streamed_outputs_never_hold_a_placeholder_and_only_grow(make_llm):  # noqa: F811
    llm = make_llm(async_scheduling=True)
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, greedy(6 + i))
    seen: dict[str, list[int]] = {}
    steps = []
    while engine.has_unfinished_requests():
        outs = engine.step()
        steps.append(len(outs))
        for out in outs:
            ids = list(out.outputs[0].token_ids)
            assert PENDING_TOKEN not in ids
            before = seen.get(out.request_id, [])
            assert ids[: len(before)] == before and len(ids) >= len(before)
            seen[out.request_id] = ids
    assert {k: len(v) for k, v in seen.items()} == {str(i): 6 + i for i in range(len(PROMPTS))}
    assert steps[0] == 0  # the first step's tokens are read back by the second step
    assert_no_leaked_blocks(llm)


def test_abort_while_a_step_is_in_flight(make_llm, make_async):  # noqa: F811
    want = make_llm(async_scheduling=False).generate(PROMPTS, [greedy(10) for _ in PROMPTS])
    llm = make_async()
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, greedy(10))
    engine.step()
    engine.step()
    assert engine._in_flight is not None
    assert engine.abort("2")
    final = run_steps(engine)
    assert final["2"].outputs[0].finish_reason == "abort"
    assert PENDING_TOKEN not in final["2"].outputs[0].token_ids
    for i, w in enumerate(want):
        if i != 2:
            assert final[str(i)].outputs[0].token_ids == w.outputs[0].token_ids
    assert_no_leaked_blocks(llm)


def test_preemption_with_async_equals_sync(make_llm, make_async, loras):  # noqa: F811
    """Sequences preempted while their newest token is still pending resume with the real token."""
    lora_list = _adapters(loras)
    params = [greedy(36, ignore_eos=True) for _ in PROMPTS]
    want = make_llm(async_scheduling=False).generate(PROMPTS, params, lora_list)
    small = make_async(num_kv_blocks=5, block_size=16, enable_prefix_caching=False)
    seqs = submit(small.engine, PROMPTS, params, lora_list)
    final = run_steps(small.engine)
    assert sum(s.num_preemptions for s in seqs.values()) > 0
    assert _summary(final[str(i)] for i in range(len(PROMPTS))) == _summary(want)
    assert_no_leaked_blocks(small)


@pytest.mark.gpu
def test_on_gpu_with_graphs_equals_sync(demo, loras):
    """The real thing: pinned read-back behind an event, pending tokens copied into the graphs' inputs."""
    from replicas.llm import LLM

    def make(**kwargs):
        return LLM(str(demo.model_dir), enable_lora=True, max_loras=4, max_lora_rank=32, dtype="float32",
                   kv_cache_memory_bytes=1 << 28, **kwargs)

    lora_list = _adapters(loras)
    sync = make(async_scheduling=False)
    params = _stopping_params(sync.generate(PROMPTS, [greedy(16) for _ in PROMPTS], lora_list))
    want = sync.generate(PROMPTS, params, lora_list)
    fast = make()
    assert fast.engine.async_scheduling and fast.engine.num_cuda_graphs > 0
    assert _summary(fast.generate(PROMPTS, params, lora_list)) == _summary(want)
    assert_no_leaked_blocks(fast)


def test_a_stop_pending_at_a_prompt_step(make_llm, make_async):  # noqa: F811
    """A request's stop token is still pending when a newcomer's prompt step comes. Read back first, the
    stop takes the request out of that step's batch (its blocks are already free); overlapped, the
    request computes one more token there, dropped. Either way the newcomer's tokens are unaffected."""
    want = make_llm(async_scheduling=False).generate(PROMPTS[:2], [greedy(8), greedy(8)])
    first = want[0].outputs[0].token_ids
    llm = make_async()
    engine = llm.engine
    engine.add_request("a", PROMPTS[0], greedy(8, stop_token_ids=[first[2]]))
    final = {}
    for _ in range(3):  # prompt, then two decode steps: the stop token is sampled, not yet read back
        final.update({o.request_id: o for o in engine.step() if o.finished})
    assert engine._in_flight is not None and "a" not in final
    engine.add_request("b", PROMPTS[1], greedy(8))
    final.update(run_steps(engine))
    assert final["a"].outputs[0].token_ids == first[:3] and final["a"].outputs[0].finish_reason == "stop"
    assert final["b"].outputs[0].token_ids == want[1].outputs[0].token_ids
    assert_no_leaked_blocks(llm)


def test_tensor_parallel_async_equals_sync(make_llm, make_async, loras):  # noqa: F811
    """With TP=2 (gloo) rank 0 broadcasts the pending tokens; the worker rank must use the same ones
    (with prompt steps overlapped too, it broadcasts them into those steps as well)."""
    lora_list = _adapters(loras)
    sync = make_llm(async_scheduling=False, **MIXED)
    params = _stopping_params(sync.generate(PROMPTS, [greedy(16) for _ in PROMPTS], lora_list))
    want = sync.generate(PROMPTS, params, lora_list)
    tp = make_async(tensor_parallel_size=2, **MIXED)
    try:
        assert tp.engine.async_scheduling
        assert _summary(tp.generate(PROMPTS, params, lora_list)) == _summary(want)
        assert (tp.engine.prompt_fills > 0) != tp.engine.read_back_before_prompt_steps
    finally:
        tp.shutdown()
