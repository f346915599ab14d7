"""AsyncLLMEngine on the demo checkpoint: streaming, concurrency, abort, bad requests, adapters, shutdown."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

from lora_core.errors import InvalidAdapterError, UnknownLoRAError
from lora_core.request import LoRARequest
from replicas.async_engine import AsyncLLMEngine
from replicas.engine import EngineArgs
from replicas.errors import EngineDeadError, InvalidRequestError, RequestAbortedError
from replicas.sampling_params import SamplingParams
from tests.replicas.async_engine_cases import (ENGINE, PROMPTS, cases, collect, final as _final,  # noqa: F401
                                               greedy as _greedy, reference, run)
from tests.timeouts import HANG_TIMEOUT_S

LONG = SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True)  # runs for seconds unless stopped


def _no_engine_thread():
    return not any(t.name == "lorafleet-engine" for t in threading.enumerate())


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])  # async: outputs a step later
def test_streaming_matches_llm(demo, cases, reference, async_scheduling):
    outs = run(demo, lambda engine: collect(engine, cases[0][0], _greedy(), "r0"), async_scheduling=async_scheduling)
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    assert len(outs) > 1 and lengths == sorted(set(lengths))
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    assert all(len(o.outputs[0].logprobs) == len(o.outputs[0].token_ids) for o in outs)
    assert outs[-1].outputs[0].finish_reason == "length"
    assert _final(outs) == reference[0]
    assert _no_engine_thread()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])  # async: outputs a step later
def test_concurrent_adapters_interleave(demo, cases, reference, async_scheduling):
    events = []

    async def body(engine):
        return await asyncio.gather(*(collect(engine, p, _greedy(), f"r{i}", lora, events)
                                      for i, (p, lora) in enumerate(cases)))

    results = run(demo, body, async_scheduling=async_scheduling)
    assert [_final(outs) for outs in results] == reference
    assert [outs[-1].lora_name for outs in results] == [lora and lora.lora_name for _, lora in cases]
    # every request streamed something before the first one finished
    first_done = next(i for i, (_, finished) in enumerate(events) if finished)
    assert {rid for rid, _ in events[:first_done]} == {f"r{i}" for i in range(len(cases))}


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])  # async: outputs a step later
def test_abort_and_cancel_mid_stream(demo, cases, reference, async_scheduling):
    async def aborted(engine):
        outs = []
        async for out in engine.generate("Once upon a time", LONG, "long"):
            outs.append(out)
            if len(outs) == 3:
                assert await engine.abort("long")
        return outs

    async def cancelled(engine):
        async for _ in engine.generate("The quick", LONG, "cancelled", cases[1][1]):
            raise asyncio.CancelledError  # as a disconnecting client's task would

    async def body(engine):
        results = await asyncio.gather(aborted(engine), collect(engine, cases[2][0], _greedy(), "other", cases[2][1]),
                                       cancelled(engine), return_exceptions=True)
        assert isinstance(results[2], asyncio.CancelledError)
        for _ in range(200):  # the cancelled request leaves the engine long before its 1500 tokens
            if not engine.engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        assert not engine.engine.has_unfinished_requests()
        assert not await engine.abort("long") and not await engine.abort("never-seen")
        return results

    long, other, _ = run(demo, body, async_scheduling=async_scheduling)
    assert long[-1].finished and long[-1].outputs[0].finish_reason == "abort"
    assert 3 <= len(long[-1].outputs[0].token_ids) < LONG.max_tokens
    assert _final(other) == reference[2] and other[-1].outputs[0].finish_reason == "length"


def test_bad_requests_fail_alone(demo, cases, reference, tmp_path):
    missing = LoRARequest("missing", 99, str(tmp_path / "nope"))

    async def body(engine):
        first = asyncio.create_task(collect(engine, cases[1][0], _greedy(), "dup", cases[1][1]))
        await asyncio.sleep(0)  # "dup" is submitted first
        bad = [
            collect(engine, "hi", {"temperature": -1.0}, "b0"),
            collect(engine, "hi", _greedy(), "b1", missing),
            collect(engine, "", _greedy(), "b2"),
            collect(engine, "a " * 3000, _greedy(), "b3"),  # longer than the model's context
            collect(engine, "hi", _greedy(), "dup"),  # the request_id is taken
            collect(engine, "hi", cases[1][1], "b5"),  # not sampling parameters
        ]
        good = [collect(engine, p, _greedy(), f"g{i}", lora) for i, (p, lora) in enumerate(cases)]
        results = await asyncio.gather(*bad, *good, return_exceptions=True)
        return results, await first

    results, first = run(demo, body)
    for result, field in zip(results, ["temperature", "lora_request", "prompt", "prompt", "request_id",
                                           "sampling_params"]):
        assert isinstance(result, InvalidRequestError), result
        assert field in result.fields, result
    assert [_final(outs) for outs in results[6:]] == reference
    assert _final(first) == reference[1]


def test_lora_management(demo, loras, tmp_path):
    sql, chat = loras["demo-sql"], loras["demo-chat"]

    async def body(engine):
        assert await engine.list_loras() == []
        await engine.add_lora(sql)
        await engine.add_lora(sql)  # the same request again is a no-op
        assert await engine.list_loras() == [sql]
        assert await engine.pin_lora("demo-sql") is True
        with pytest.raises(UnknownLoRAError):
            await engine.pin_lora("nope")
        with pytest.raises(InvalidAdapterError):
            await engine.add_lora(LoRARequest("missing", 9, str(tmp_path / "nope")))
        with pytest.raises(InvalidRequestError, match="already registered"):
            await engine.add_lora(LoRARequest("demo-sql", 7, str(demo.adapters["demo-chat"])))
        stream = engine.generate("Hello", LONG, "busy", chat)
        await stream.__anext__()
        assert await engine.list_loras() == [sql, chat]  # added by the request
        with pytest.raises(InvalidRequestError, match="in use"):
            await engine.remove_lora("demo-chat")
        await stream.aclose()  # aborts "busy"
        assert await engine.remove_lora("demo-sql") is True
        assert await engine.remove_lora("demo-sql") is False
        assert await engine.list_loras() == [chat]

    run(demo, body)


def test_remove_lora_after_its_requests_end(demo, loras):
    async def body(engine):
        await collect(engine, "Hello", _greedy(3), "r", loras["demo-chat"])
        assert await engine.remove_lora("demo-chat") is True

    run(demo, body)


def test_shutdown_ends_streams_and_thread(demo):
    async def body():
        engine = AsyncLLMEngine(EngineArgs(model=str(demo.model_dir), **ENGINE))
        assert engine.is_running
        stream = engine.generate("Once upon a time", LONG, "r")
        await stream.__anext__()
        await engine.shutdown()
        with pytest.raises(RequestAbortedError):
            async for _ in stream:
                pass
        assert not engine.is_running and _no_engine_thread()
        with pytest.raises(EngineDeadError):
            await collect(engine, "hi", _greedy(), "after")
        with pytest.raises(EngineDeadError):
            await engine.list_loras()
        await engine.shutdown()  # twice is fine

    asyncio.run(body())


def test_idle_loop_sleeps(demo):
    """No busy-wait: an idle engine thread uses (almost) no CPU."""

    async def body(engine):
        await collect(engine, "Hello", _greedy(4), "warm")
        stat = f"/proc/self/task/{engine._thread.native_id}/stat"
        if not os.path.exists(stat):
            pytest.skip("needs Linux /proc")

        def cpu_ticks():
            fields = open(stat).read().rsplit(")", 1)[1].split()
            return int(fields[11]) + int(fields[12])  # utime + stime

        before = cpu_ticks()
        await asyncio.sleep(0.5)
        assert cpu_ticks() - before <= 3
        await asyncio.wait_for(collect(engine, "Hello", _greedy(4), "wake"), HANG_TIMEOUT_S)  # it wakes on new work

    run(demo, body)


def test_step_failure_kills_engine_cleanly(demo, tmp_path):
    async def body():
        engine = AsyncLLMEngine(EngineArgs(model=str(demo.model_dir), **ENGINE))
        stream = engine.generate("Once upon a time", LONG, "r")
        await stream.__anext__()

        def broken_step(**_):
            raise RuntimeError("boom")

        engine.engine.step = broken_step
        with pytest.raises(EngineDeadError, match="boom") as info:
            async for _ in stream:
                pass
        assert isinstance(info.value.__cause__, RuntimeError)
        with pytest.raises(EngineDeadError):
            await collect(engine, "hi", _greedy(), "after")
        with pytest.raises(EngineDeadError):
            await engine.abort("r")
        await engine.shutdown()
        assert not engine.is_running and _no_engine_thread()

    asyncio.run(body())
    with pytest.raises(Exception):
        AsyncLLMEngine(EngineArgs(model=str(tmp_path / "no-model"), dtype="float32", device="cpu"))
    assert _no_engine_thread()


def test_unknown_sampling_key_is_a_request_error(demo):
    async def main():
        engine = AsyncLLMEngine(EngineArgs(model=str(demo.model_dir), **ENGINE))
        try:
            with pytest.raises(InvalidRequestError, match="temprature"):
                async for _ in engine.generate("hi", {"temprature": 0.5}, "typo"):
                    pass
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_requests_stream_while_an_adapter_loads(demo, loras):
    """add_lora's disk load runs in the background: a base request arriving meanwhile finishes first."""

    async def body(engine):
        runner = engine.engine.executor.runner
        gate, load = threading.Event(), runner.loads.load

        def held(request):
            assert gate.wait(HANG_TIMEOUT_S)
            return load(request)

        runner.loads.load = held
        try:
            adding = asyncio.ensure_future(engine.add_lora(loras["demo-sql"]))
            await asyncio.sleep(0.05)
            base = await asyncio.wait_for(collect(engine, "Hello world", _greedy(4), "base"), HANG_TIMEOUT_S)
            assert not adding.done()
        finally:
            gate.set()
        await asyncio.wait_for(adding, HANG_TIMEOUT_S)
        sql = await collect(engine, "SELECT", _greedy(4), "sql", loras["demo-sql"])
        return base, sql

    base, sql = run(demo, body)
    assert base[-1].finished and len(base[-1].outputs[0].token_ids) == 4
    assert sql[-1].finished and sql[-1].lora_name == "demo-sql"


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])  # async: outputs a step later
def test_n_completions_stream_with_logprobs_of_their_own_and_abort_together(demo, async_scheduling):
    """Every yielded output keeps its completions' logprobs as they were (the engine appends in place), and
    an abort ends all n completions."""
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1, n=3)

    async def body(engine):
        outs = await collect(engine, PROMPTS[0], params, "three")
        long = []
        async for out in engine.generate(PROMPTS[1], SamplingParams(n=2, temperature=1.0, max_tokens=1500), "two"):
            long.append(out)
            if len(long) == 2:
                assert await engine.abort("two")
        return outs, long

    outs, long = run(demo, body, async_scheduling=async_scheduling)
    for out in outs:
        assert len(out.outputs) == 3
        assert all(len(c.logprobs) == len(c.token_ids) for c in out.outputs)  # not grown since it was yielded
    assert [c.finish_reason for c in outs[-1].outputs] == ["length"] * 3
    assert long[-1].finished and [c.finish_reason for c in long[-1].outputs] == ["abort", "abort"]
    assert all(len(c.token_ids) < 1500 for c in long[-1].outputs)


def test_structured_requests_compile_off_the_engine_thread(demo, cases, reference):
    """A grammar is compiled on a worker thread before the engine's thread sees the request (there it is a cache
    hit), so a slow compile holds up no running request; a bad one fails alone, as a dict of fields too."""
    threads = []

    async def body(engine):
        compile_ = engine.engine.grammars.compile

        def recording(spec):
            threads.append((spec.kind, threading.current_thread().name == "lorafleet-engine"))
            return compile_(spec)

        engine.engine.grammars.compile = recording
        choice = {"choice": ["left", "right"]}
        results = await asyncio.gather(
            collect(engine, "hi", {"temperature": 1.0, "seed": 5, "structured_outputs": choice}, "c0"),
            collect(engine, "hi", {"structured_outputs": {"regex": "(ab"}}, "bad"),
            *(collect(engine, p, _greedy(), f"g{i}", lora) for i, (p, lora) in enumerate(cases)),
            return_exceptions=True)
        return results

    results = run(demo, body)
    assert results[0][-1].outputs[0].text in ("left", "right") and results[0][-1].finished
    assert isinstance(results[1], InvalidRequestError) and results[1].fields == ["structured_outputs"]
    assert [_final(outs) for outs in results[2:]] == reference
    # (kind, on the engine's thread): the choice first on a worker, then (a cache hit) by add_request
    assert [on for kind, on in threads if kind == "choice"] == [False, True]
    assert [on for kind, on in threads if kind == "regex"] == [False]  # refused before reaching the engine
