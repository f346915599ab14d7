"""How AsyncLLMEngine's outputs reach their consumers: output kinds (DELTA, FINAL_ONLY) through the stream, a
slow consumer of deltas, the end of an aborted delta stream, and a step's outputs handed to several loops."""

from __future__ import annotations

import asyncio
import threading

from replicas.sampling_params import SamplingParams
from tests.replicas.async_engine_cases import (cases, collect, final as _final, greedy as _greedy,  # noqa: F401
                                               reference, run)
from tests.timeouts import HANG_TIMEOUT_S


def test_streams_of_deltas_and_of_the_final_output_only(demo, cases, reference):
    """SamplingParams.output_kind through the async engine: DELTA's parts add up to the reference, each new;
    FINAL_ONLY yields one output, the whole of it."""
    from replicas.sampling_params import RequestOutputKind

    async def body(engine):
        delta = await collect(engine, cases[0][0], _greedy(output_kind=RequestOutputKind.DELTA), "d")
        final = await collect(engine, cases[0][0], _greedy(output_kind=RequestOutputKind.FINAL_ONLY), "f")
        return delta, final

    delta, final = run(demo, body)
    assert len(delta) > 1 and all(o.outputs[0].token_ids for o in delta)
    assert ("".join(o.outputs[0].text for o in delta),
            [t for o in delta for t in o.outputs[0].token_ids]) == reference[0]
    assert len(final) == 1 and final[0].finished and _final(final) == reference[0]


def test_a_slow_consumer_of_deltas_loses_none_and_an_abort_adds_nothing(demo, cases, reference):
    """Cumulative outputs that pile up may be skipped to the newest; deltas may not (CI once lost a step's
    delta so). A consumer that reads only after the engine has run ahead gets every delta, and the output that
    ends an aborted delta stream carries no text or tokens again."""
    from replicas.sampling_params import RequestOutputKind

    async def body(engine):
        outs = []
        async for out in engine.generate(cases[0][0], _greedy(output_kind=RequestOutputKind.DELTA), "slow"):
            outs.append(out)
            await asyncio.sleep(0.3)  # the engine runs several steps meanwhile
        aborted = []
        async for out in engine.generate(cases[0][0], SamplingParams(temperature=0.0, max_tokens=1500,
                                         ignore_eos=True, output_kind=RequestOutputKind.DELTA), "long"):
            aborted.append(out)
            if len(aborted) == 2:
                assert await engine.abort("long")
        return outs, aborted

    outs, aborted = run(demo, body)
    assert ("".join(o.outputs[0].text for o in outs), [t for o in outs for t in o.outputs[0].token_ids]) == reference[0]
    assert aborted[-1].finished and aborted[-1].outputs[0].finish_reason == "abort"
    text, ids = "".join(o.outputs[0].text for o in aborted), [t for o in aborted for t in o.outputs[0].token_ids]
    assert 2 <= len(ids) < len(reference[0][1])  # the same greedy start: nothing said twice
    assert (text, ids) == (reference[0][0][:len(text)], reference[0][1][:len(ids)])


def test_an_abort_the_engine_did_not_report_ends_a_delta_stream_with_nothing_new():
    """Where the engine never reported the abort, the stream's last output is made from the last one it did
    report: a cumulative stream repeats it (as vLLM's does), a delta stream must not (it would add it twice)."""
    from replicas.async_engine import _aborted
    from replicas.outputs import CompletionOutput, RequestOutput

    last = RequestOutput("r", "p", [1], [CompletionOutput(0, " sat", [97], [{97: -0.5}]),
                                         CompletionOutput(1, "", [], [], "length")])
    cumulative, delta = _aborted("r", last), _aborted("r", last, delta=True)
    assert [(c.text, c.token_ids, c.finish_reason) for c in cumulative.outputs] == [(" sat", [97], "abort"),
                                                                                     ("", [], "length")]
    assert [(c.text, c.token_ids, c.logprobs, c.finish_reason) for c in delta.outputs] == [
        ("", [], [], "abort"), ("", [], [], "length")]
    assert cumulative.finished and delta.finished


def test_a_steps_outputs_reach_streams_on_several_loops_in_order():
    """_put_all: one call into each consumer loop per step, every item in its stream's order; a closed loop
    (its consumer gone) costs the others nothing."""
    from replicas.async_engine import _put_all, _Stream

    loops = [asyncio.new_event_loop() for _ in range(2)]
    threads = [threading.Thread(target=loop.run_forever, daemon=True) for loop in loops]
    for t in threads:
        t.start()
    gone = asyncio.new_event_loop()
    gone.close()
    try:
        streams = [_Stream(f"r{i}", loops[i % 2]) for i in range(5)] + [_Stream("gone", gone)]
        for step in range(3):
            _put_all([(s, (s.request_id, step)) for s in streams])

        async def drain(s):
            return [await s.queue.get() for _ in range(3)]

        for s in streams[:-1]:
            got = asyncio.run_coroutine_threadsafe(drain(s), s.loop).result(timeout=HANG_TIMEOUT_S)
            assert got == [(s.request_id, step) for step in range(3)]
    finally:
        for loop in loops:
            loop.call_soon_threadsafe(loop.stop)
        for t in threads:
            t.join(timeout=HANG_TIMEOUT_S)
        for loop in loops:
            loop.close()
