"""cluster/output_stream.py: a request's outputs cross the Serve handle as deltas and come back as the
engine's cumulative RequestOutputs, field for field; coalesced sends at most one per interval."""

from __future__ import annotations

import asyncio
import pickle

import pytest

from cluster.output_stream import DeltaDecoder, DeltaEncoder, coalesced
from replicas.outputs import CompletionOutput, RequestOutput


@pytest.fixture(scope="module")
def engine(demo_checkpoint):
    from replicas.engine import LLMEngine
    from replicas.engine_args import EngineArgs

    engine = LLMEngine(EngineArgs(model=str(demo_checkpoint.model_dir), dtype="float32", device="cpu",
                                  enable_lora=True, max_loras=2, max_lora_rank=16, kv_cache_memory_bytes=1 << 24))
    yield engine
    engine.shutdown()


def _engine_outputs(engine, demo_checkpoint) -> dict[str, list[RequestOutput]]:
    """Every output the engine reports for three requests run together, by request id."""
    from lora_core.request import LoRARequest
    from replicas.sampling_params import SamplingParams

    sql = LoRARequest("demo-sql", 1, str(demo_checkpoint.adapters["demo-sql"]))
    greedy = SamplingParams(max_tokens=12, temperature=0)
    engine.add_request("probe", "SELECT name FROM", greedy, sql)
    while engine.has_unfinished_requests():
        text = engine.step()[-1].outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]  # a stop string the answer reaches halfway
    engine.add_request("plain", "The quick brown fox", SamplingParams(max_tokens=9, temperature=0, logprobs=2))
    engine.add_request("pair", "Once upon a time", SamplingParams(max_tokens=7, n=2, seed=3, temperature=1.0,
                                                                   prompt_logprobs=1), sql)
    engine.add_request("stop", "SELECT name FROM", SamplingParams(max_tokens=12, temperature=0, stop=[stop]), sql)
    outputs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def test_the_decoded_stream_is_the_engines_cumulative_one(engine, demo_checkpoint):
    """n = 1 with logprobs, n = 2 with prompt logprobs and an adapter, a stop string: each output decoded
    from the pickled wire dicts equals the engine's; after the first, no chunk repeats the prompt, and each
    generated token crosses once."""
    for request_id, outs in _engine_outputs(engine, demo_checkpoint).items():
        encoder, decoder = DeltaEncoder(), DeltaDecoder()
        wire = [pickle.loads(pickle.dumps(encoder.encode(out))) for out in outs]
        assert [decoder.decode(item) for item in wire] == outs, request_id
        assert len(outs) > 2 and outs[-1].finished
        assert request_id != "stop" or outs[-1].outputs[0].finish_reason == "stop"
        assert "prompt_token_ids" in wire[0] and not any("prompt_token_ids" in item for item in wire[1:])
        for final in outs[-1].outputs:
            sent = [t for item in wire for c in item["completions"] if c["index"] == final.index
                    for t in c["token_ids"]]
            assert sent == final.token_ids


def test_output_dict_is_asdict_without_the_copy(engine, demo_checkpoint):
    from dataclasses import asdict

    from cluster.output_stream import output_dict

    outs = [out for outs in _engine_outputs(engine, demo_checkpoint).values() for out in outs]
    assert all(output_dict(out) == asdict(out) for out in outs)
    assert output_dict(outs[-1])["outputs"][0]["token_ids"] is outs[-1].outputs[0].token_ids


def test_the_decoded_outputs_own_their_lists():
    """A consumer that keeps an output sees it unchanged as later ones arrive (the engine's are copies too)."""
    def out(ids: list[int], text: str) -> RequestOutput:
        return RequestOutput("r", "p", [1, 2], [CompletionOutput(0, text, ids)])

    encoder, decoder = DeltaEncoder(), DeltaDecoder()
    first = decoder.decode(encoder.encode(out([5], "a")))
    decoder.decode(encoder.encode(out([5, 6], "ab")))
    assert first.outputs[0].token_ids == [5] and first.outputs[0].text == "a" and first.prompt_token_ids == [1, 2]


def test_a_field_that_shrinks_is_sent_whole():
    """Text held back and then taken away (a stop string's prefix) is replaced, not appended to."""
    outs = [RequestOutput("r", None, [1], [CompletionOutput(0, text, ids, None, reason)])
            for text, ids, reason in [("abc", [4, 5], None), ("ab", [4, 5, 6], "stop"), ("ab", [4, 5, 6], "stop")]]
    encoder, decoder = DeltaEncoder(), DeltaDecoder()
    wire = [encoder.encode(o) for o in outs]
    assert wire[1]["completions"][0].get("text_whole") and not wire[1]["completions"][0].get("token_ids_whole")
    assert [decoder.decode(item) for item in wire] == outs


def test_completions_keep_the_order_and_number_the_engine_listed():
    def out(*completions: tuple[int, list[int]]) -> RequestOutput:
        return RequestOutput("r", None, [1], [CompletionOutput(i, "", ids) for i, ids in completions])

    outs = [out((1, [7]), (0, [3])), out((1, [7, 8])), out((0, [3, 4]), (1, [7, 8, 9]))]
    encoder, decoder = DeltaEncoder(), DeltaDecoder()
    assert [decoder.decode(encoder.encode(o)) for o in outs] == outs


# ---- coalesced: at most one output per interval --------------------------------------------------------------


def _outputs(count: int) -> list[RequestOutput]:
    return [RequestOutput("r", None, [1], [CompletionOutput(0, "x" * i, list(range(i)))], finished=i == count)
            for i in range(1, count + 1)]


def _run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, timeout=20))  # a wait that is never cut short fails here


def test_no_interval_passes_every_output_on():
    async def go():
        async def source():
            for out in _outputs(5):
                yield out
        return [out async for out in coalesced(source(), 0)]

    assert _run(go()) == _outputs(5)


def test_outputs_within_an_interval_go_as_their_latest_and_the_last_goes_at_once():
    """o1 at once; o2, o3 arrive together and go as o3 when the interval is up; the finished o4 cuts a long
    interval short."""
    outs = _outputs(4)

    async def go(interval: float):
        taken = {out.outputs[0].text: asyncio.Event() for out in outs}

        async def source():  # o1; once it is taken o2 and o3; once o3 is (or o1, the interval long) o4
            yield outs[0]
            await taken["x"].wait()
            yield outs[1]
            yield outs[2]
            await taken["xxx"].wait()
            await asyncio.sleep(0.01)  # the reader waits for the interval by then
            yield outs[3]

        got = []
        async for out in coalesced(source(), interval):
            got.append(out)
            taken[out.outputs[0].text].set()
            if interval > 1:
                taken["xxx"].set()
        return got

    assert _run(go(0.05)) == [outs[0], outs[2], outs[3]]
    assert _run(go(3600.0)) == [outs[0], outs[3]]


def test_an_error_reaches_the_reader_after_what_came_before_it():
    async def go():
        async def source():
            yield _outputs(2)[0]
            raise ValueError("bad request")

        got = []
        with pytest.raises(ValueError, match="bad request"):
            async for out in coalesced(source(), 0.01):
                got.append(out)
        return got

    assert _run(go()) == _outputs(2)[:1]


def test_closing_the_stream_closes_the_engines():
    """A client gone: closing coalesced's generator ends the source's (where the server aborts the request)."""
    async def go():
        closed = asyncio.Event()

        async def source():
            try:
                yield _outputs(2)[0]
                await asyncio.Event().wait()  # the engine still working
            finally:
                closed.set()

        stream = coalesced(source(), 0.01)
        first = await stream.__anext__()
        await stream.aclose()
        await closed.wait()
        return first

    assert _run(go()) == _outputs(2)[0]


@pytest.mark.parametrize("bad", [-1, "50", 1e9])
def test_a_bad_stream_interval_fails_the_config(bad):
    from cluster.server_config import ServerConfig

    with pytest.raises(ValueError, match="stream_interval_ms"):
        ServerConfig(stream_interval_ms=bad)
