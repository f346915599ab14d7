"""SamplingParams.output_kind (vLLM's RequestOutputKind): cumulative, delta and final-only outputs of the same
requests, through engine steps (stop strings, logprobs, n > 1, an abort), and LLM.generate's final-only."""

from __future__ import annotations

import pytest

from replicas.errors import InvalidRequestError
from replicas.sampling_params import RequestOutputKind, SamplingParams
from tests.replicas.engine_cases import PROMPTS, llm, make_llm, run_steps  # noqa: F401  (fixtures)


def _params(kind, **kw):
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 14, "logprobs": 1, "output_kind": kind, **kw})


def _stream(engine, params_of) -> dict[str, list]:
    """Every output of each request, step by step."""
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, params_of(i))
    outs: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    return outs


def test_deltas_add_up_to_the_cumulative_outputs(llm):  # noqa: F811
    """A stop string on some requests (its text held back, then cut) and logprobs: the deltas' tokens, text
    and logprobs concatenated equal the last cumulative output, and each delta is new (none repeats)."""
    stop = lambda i: {"stop": ["e"]} if i % 2 else {}  # noqa: E731
    cumulative = _stream(llm.engine, lambda i: _params(RequestOutputKind.CUMULATIVE, **stop(i)))
    delta = _stream(llm.engine, lambda i: _params(RequestOutputKind.DELTA, **stop(i)))
    assert cumulative.keys() == delta.keys() and len(cumulative) == len(PROMPTS)
    for rid, outs in delta.items():
        whole = cumulative[rid][-1].outputs[0]
        parts = [o.outputs[0] for o in outs]
        assert [t for p in parts for t in p.token_ids] == whole.token_ids
        assert "".join(p.text for p in parts) == whole.text
        assert [lp for p in parts for lp in p.logprobs] == whole.logprobs
        assert outs[-1].finished and parts[-1].finish_reason == whole.finish_reason
        assert len(outs) == len(cumulative[rid]) and all(p.token_ids for p in parts[:-1])
    assert any(o[-1].outputs[0].finish_reason == "stop" for o in cumulative.values())


def test_final_only_reports_each_request_once_with_its_whole_output(llm):  # noqa: F811
    """n = 1 and n = 3 requests (the three seeded, stopping at a stop string at different steps): one output
    each, finished, equal to the cumulative run's last."""
    n = lambda i: 3 if i == 2 else 1  # noqa: E731
    fan = dict(temperature=1.0, seed=5, stop=["e"])

    def params(kind, i):
        return _params(kind, n=3, **fan) if i == 2 else _params(kind)

    cumulative = _stream(llm.engine, lambda i: params(RequestOutputKind.CUMULATIVE, i))
    final = _stream(llm.engine, lambda i: params(RequestOutputKind.FINAL_ONLY, i))
    assert len({len(c.token_ids) for c in cumulative["2"][-1].outputs}) > 1  # the children end apart
    assert {rid: len(outs) for rid, outs in final.items()} == {str(i): 1 for i in range(len(PROMPTS))}
    for rid, (out,) in final.items():
        want = cumulative[rid][-1]
        assert out.finished and len(out.outputs) == n(int(rid))
        assert [(c.token_ids, c.text, c.logprobs) for c in out.outputs] == \
            [(c.token_ids, c.text, c.logprobs) for c in want.outputs]


def test_an_aborted_final_only_request_still_reports_once(llm):  # noqa: F811
    engine = llm.engine
    engine.add_request("a", PROMPTS[0], _params(RequestOutputKind.FINAL_ONLY, ignore_eos=True))
    for _ in range(3):
        assert engine.step() == []  # nothing until it ends
    engine.abort("a")
    final = run_steps(engine)
    assert final["a"].finished and final["a"].outputs[0].finish_reason == "abort"


def test_generate_asks_for_final_only_and_keeps_the_callers_params(llm):  # noqa: F811
    params = SamplingParams(temperature=0.0, max_tokens=6)
    seen = []
    add = llm.engine.add_request
    llm.engine.add_request = lambda rid, prompt, p, *a: (seen.append(p.output_kind), add(rid, prompt, p, *a))[1]
    outs = llm.generate(PROMPTS[:2], params)
    assert seen == [RequestOutputKind.FINAL_ONLY] * 2 and params.output_kind is RequestOutputKind.CUMULATIVE
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)


@pytest.mark.parametrize("kw,match", [(dict(output_kind=3), "output_kind"), (dict(output_kind="delta"), "output_kind"),
                                       (dict(output_kind=RequestOutputKind.DELTA, n=2), "n > 1")])
def test_bad_output_kinds_are_refused(kw, match):
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(**kw)
    assert SamplingParams(output_kind=1).output_kind is RequestOutputKind.DELTA
