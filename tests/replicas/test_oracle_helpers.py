"""The helpers that compare the engine's outputs with an oracle's fail on fewer outputs, or fewer logprobs,
than the oracle's: zip stops at the shorter side, and an engine that returned nothing compared nothing."""

from __future__ import annotations

import pytest

from replicas.outputs import CompletionOutput, RequestOutput
from tests.replicas.conftest import generate_against_peft
from tests.replicas.test_engine import _check_against_hf
from tests.replicas.test_longrope import _assert_matches

REFERENCE = [([5, 7], [-0.5, -0.25]), ([3, 1], [-1.0, -2.0])]  # (greedy tokens, their logprobs) per request
SHORT = "shorter|longer"  # zip(strict=True)'s ValueError


def _output(tokens: list[int], logprobs: list[float]) -> RequestOutput:
    steps = [{t: lp} for t, lp in zip(tokens, logprobs, strict=True)]
    return RequestOutput("r", "", [1], [CompletionOutput(0, "", list(tokens), steps, "length")], finished=True)


def _engine_outputs() -> list[RequestOutput]:
    return [_output(*r) for r in REFERENCE]


def _against_peft(monkeypatch, tmp_path, outputs: list[RequestOutput]) -> None:
    """generate_against_peft over an engine that returns outputs and transformers + PEFT's REFERENCE."""
    class FakeLLM:
        def __init__(self, *args, **kwargs) -> None:
            pass

        def generate(self, *args, **kwargs) -> list[RequestOutput]:
            return outputs

        def shutdown(self) -> None:
            pass

    monkeypatch.setattr("replicas.llm.LLM", FakeLLM)
    monkeypatch.setitem(generate_against_peft.__globals__, "peft_greedy_reference", lambda *a, **k: REFERENCE)
    generate_against_peft(tmp_path, {}, ["a", "b"], [None, None], steps=2)


@pytest.fixture(params=["generate_against_peft", "_check_against_hf", "_assert_matches"])
def check(request, monkeypatch, tmp_path):
    """check(outputs): the helper comparing outputs with REFERENCE."""
    if request.param == "generate_against_peft":
        return lambda outputs: _against_peft(monkeypatch, tmp_path, outputs)
    helper = {"_check_against_hf": _check_against_hf, "_assert_matches": _assert_matches}[request.param]
    return lambda outputs: helper(outputs, REFERENCE)


def test_outputs_equal_to_the_oracles_pass(check):
    check(_engine_outputs())


@pytest.mark.parametrize("kept", [0, 1])
def test_fewer_outputs_than_the_oracles_fail(check, kept):
    with pytest.raises(ValueError, match=SHORT):
        check(_engine_outputs()[:kept])


def test_fewer_logprobs_than_tokens_fail(check):
    outputs = _engine_outputs()
    outputs[1].outputs[0].logprobs.pop()
    with pytest.raises(ValueError, match=SHORT):
        check(outputs)
