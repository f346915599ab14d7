"""SamplingParams validation: every bad value is refused, naming its field."""

from __future__ import annotations

import pytest

from lora_core.errors import UnknownLoRAError
from replicas.errors import EngineError, InvalidRequestError, UnknownAdapterError
from replicas.sampling_params import SamplingParams


def test_defaults_are_valid():
    p = SamplingParams()
    assert p.n == 1 and p.stop == [] and p.stop_token_ids == [] and not p.greedy
    assert SamplingParams(temperature=0).greedy


@pytest.mark.parametrize(
    "field, value",
    [
        ("n", 129),
        ("n", 0),
        ("n", 1.0),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("top_k", 1.5),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("seed", 1.5),
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("max_tokens", True),
        ("stop", ""),
        ("stop", [1, 2]),
        ("stop_token_ids", [-1]),
        ("logprobs", 21),
        ("logprobs", -1),
        ("prompt_logprobs", 21),
        ("allowed_token_ids", []),
        ("allowed_token_ids", [-1]),
        ("truncate_prompt_tokens", 0),
        ("prompt_logprobs", 1.5),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.5),
        ("repetition_penalty", 0.0),
        ("ignore_eos", "yes"),
        ("min_tokens", -1),
        ("min_tokens", 17),  # past max_tokens (16)
        ("logit_bias", {5: 100.5}),
        ("logit_bias", {-1: 1}),
        ("logit_bias", {"a": 1}),
        ("logit_bias", [5]),
        ("temperature", float("inf")),  # through the Python handle or the engine API, no JSON parser to refuse it
        ("temperature", float("nan")),
        ("repetition_penalty", float("inf")),
        ("top_p", float("nan")),
    ],
)
def test_bad_value_names_field(field, value):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**{field: value})
    assert err.value.fields == [field]
    assert field in str(err.value) and repr(value) in str(err.value)
    assert isinstance(err.value, ValueError) and isinstance(err.value, EngineError)


def test_n_up_to_openais_limit_is_taken():
    assert SamplingParams(n=4).n == 4 and SamplingParams(n=128).n == 128


def test_every_problem_is_listed():
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(temperature=-1, top_p=0, max_tokens=0)
    assert err.value.fields == ["temperature", "top_p", "max_tokens"]
    for name in ("temperature", "top_p", "max_tokens"):
        assert name in str(err.value)


@pytest.mark.parametrize("top_k", [-1, 0, 1, 50])
def test_top_k_off_or_positive(top_k):
    assert SamplingParams(top_k=top_k).top_k_or_off == max(top_k, 0)


def test_stop_normalised_to_list():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b"), stop_token_ids=(3,)).stop_token_ids == [3]


def test_edges_accepted():
    SamplingParams(temperature=0, top_p=1, min_p=1, logprobs=20, presence_penalty=-2, frequency_penalty=2, seed=0)
    SamplingParams(logprobs=0, top_p=1e-9, repetition_penalty=0.5)


def test_unknown_adapter_is_a_lora_error():
    e = UnknownAdapterError("adapter 'x' is not registered")
    assert isinstance(e, UnknownLoRAError) and isinstance(e, EngineError)
    assert str(e) == "adapter 'x' is not registered"


def test_logit_bias_takes_openais_string_ids():
    """JSON object keys are strings: OpenAI's {"50256": -100} names token 50256."""
    assert SamplingParams(logit_bias={"50256": -100, 7: 2}).logit_bias == {50256: -100.0, 7: 2.0}
    assert SamplingParams(min_tokens=16).min_tokens == 16 and SamplingParams(logit_bias={}).logit_bias == {}
