"""Structured outputs (SamplingParams.structured_outputs): the request's side, xgrammar's masks, and the engine
end to end on the demo checkpoint (CPU, float32; its weights are random, so only the grammar shapes the text).
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from replicas.errors import InvalidRequestError
from replicas.grammar import GrammarBackend, apply_token_masks
from replicas.sampler import Sampler
from replicas.sampling_params import SamplingParams
from replicas.structured_outputs import StructuredOutputsParams as SO
from replicas.tokenizer import Tokenizer
from tests.replicas.engine_cases import PROMPTS, greedy, make_llm, run_steps, seeded  # noqa: F401  (fixture)
from tests.replicas.test_sampler import ON_DEVICES, seqs_for

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "n", "tag"],
          "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tag": {"type": "string", "maxLength": 4}}}
CHOICES = ["yes", "no", 'say "hi"', "naïve\\"]
PATTERN = r"[a-c]{3}-\d\d"


def _check_schema(text: str) -> bool:
    value = json.loads(text, strict=False)  # xgrammar lets control characters into length-bounded strings
    assert set(value) == {"ok", "n", "tag"}
    assert isinstance(value["ok"], bool) and isinstance(value["n"], int) and 0 <= value["n"] <= 99
    assert isinstance(value["tag"], str) and len(value["tag"]) <= 4
    return True


# ---- the request's side ----------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, words", [
    ({}, "exactly one of"),
    ({"json": SCHEMA, "regex": "a"}, "(got json, regex)"),
    ({"json": "{not json"}, "not valid JSON text"),
    ({"json": [1, 2]}, "must be a JSON Schema"),
    ({"json_object": "yes"}, "json_object must be true"),
    ({"regex": ""}, "regex must be a non-empty string"),
    ({"grammar": 3}, "grammar must be a non-empty string"),
    ({"choice": []}, "choice must be a non-empty list"),
    ({"choice": ["a", ""]}, "choice must be a non-empty list"),
    ({"regex": "a", "disable_any_whitespace": "no"}, "disable_any_whitespace must be a bool"),
])
def test_params_refuse_what_cannot_be_a_constraint(kwargs, words):
    with pytest.raises(InvalidRequestError) as err:
        SO(**kwargs)
    assert err.value.fields == ["structured_outputs"] and words in str(err.value)


def test_sampling_params_take_a_dict_and_report_with_the_other_fields():
    params = SamplingParams(structured_outputs={"choice": ["a", "b"]})
    assert params.structured_outputs == SO(choice=("a", "b")) and params.structured_outputs.kind == "choice"
    assert SO(json=SCHEMA).key() == SO(json=json.dumps(SCHEMA)).key()  # a dict and its text compile alike
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(temperature=-1, structured_outputs={"regex": "a", "pattern": "b"})
    assert err.value.fields == ["temperature", "structured_outputs"] and "'pattern'" in str(err.value)
    with pytest.raises(InvalidRequestError, match="must be an object"):
        SamplingParams(structured_outputs="json")


# ---- masks --------------------------------------------------------------------------------------


def _pack(allowed: torch.Tensor) -> torch.Tensor:
    """The int32 bitmask of a bool [N, V] (bit j of word w: token 32 w + j), written independently of grammar.py."""
    n, vocab = allowed.shape
    words = -(-vocab // 32)
    padded = torch.zeros(n, words * 32, dtype=torch.int64)
    padded[:, :vocab] = allowed.long()
    value = (padded.view(n, words, 32) << torch.arange(32)).sum(-1)
    return torch.where(value >= 2**31, value - 2**32, value).to(torch.int32)


@ON_DEVICES
def test_masks_keep_exactly_the_allowed_tokens_out_of_place(device):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 70, generator=gen).to(device)
    allowed = torch.rand(3, 70, generator=gen) < 0.3
    allowed[:, 69] = True  # the last token of a partial word, bit 5 of word 2
    allowed[1, 31] = True  # bit 31: the int32's sign
    before = logits.clone()
    out = apply_token_masks(logits, _pack(allowed))
    assert torch.equal(logits, before)
    assert torch.equal(torch.isfinite(out).cpu(), allowed)
    assert torch.equal(out[allowed.to(device)], logits[allowed.to(device)])


@ON_DEVICES
def test_a_row_left_with_no_token_takes_the_grammar_over_the_fallback(device):
    logits = torch.randn(2, 40, generator=torch.Generator().manual_seed(1)).to(device)
    allowed = torch.zeros(2, 40, dtype=torch.bool)
    allowed[:, [2, 5]] = True
    restricted = logits.clone()
    restricted[0, [2, 5]] = float("-inf")  # e.g. min_tokens banned the grammar's only tokens (EOS)
    out = apply_token_masks(restricted, _pack(allowed), fallback=logits)
    assert torch.equal(out[0, [2, 5]], logits[0, [2, 5]]) and torch.isinf(out[0]).sum() == 38
    assert torch.equal(out[1], restricted[1].masked_fill(~allowed[1].to(device), float("-inf")))


@ON_DEVICES
def test_sampler_samples_only_allowed_tokens_and_reports_raw_logprobs(device):
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(2)).to(device)
    allowed = torch.ones(4, 64, dtype=torch.bool)
    allowed[:2] = False
    allowed[0, [7, 9]] = True
    allowed[1, 30:40] = True
    params = [SamplingParams(temperature=0, logprobs=1), SamplingParams(temperature=1.0, seed=4),
              SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[11]), SamplingParams(temperature=0)]
    out = Sampler().sample(logits, seqs_for(params), token_masks=_pack(allowed))
    ids = out.token_ids.tolist()
    assert ids[0] == [7, 9][int(logits[0, [7, 9]].argmax())] and 30 <= ids[1] < 40
    assert ids[3] == int(logits[3].argmax())  # all ones: untouched
    assert out.logprobs[0].logprob == pytest.approx(float(logits[0].log_softmax(-1)[ids[0]]), abs=1e-5)


# ---- the grammar backend on the demo tokenizer ----------------------------------------------------


@pytest.fixture(scope="module")
def backend(demo):
    tokenizer = Tokenizer.from_pretrained(demo.model_dir)
    return tokenizer, GrammarBackend(tokenizer, json.loads((demo.model_dir / "config.json").read_text())["vocab_size"])


def _walk(backend, spec, text):
    """Feed text's tokens to a fresh matcher: (tokens accepted before the first refusal, matcher)."""
    tokenizer, grammars = backend
    matcher = grammars.matcher(grammars.compile(spec), [tokenizer.eos_token_id])
    ids = tokenizer.encode(text, add_special_tokens=False)
    return next((i for i, t in enumerate(ids) if not matcher.accept(t)), len(ids)), len(ids), matcher


@pytest.mark.parametrize("choice", CHOICES)
def test_each_choice_is_spelled_exactly_and_then_ends(backend, choice):
    accepted, total, matcher = _walk(backend, SO(choice=CHOICES), choice)
    assert accepted == total and not matcher.is_terminated
    assert matcher.accept(backend[0].eos_token_id) and matcher.is_terminated
    accepted, total, _ = _walk(backend, SO(choice=CHOICES), choice + "!")
    assert accepted < total


def test_masks_follow_the_matcher(backend):
    tokenizer, grammars = backend
    matcher = grammars.matcher(grammars.compile(SO(regex="ab+")), [tokenizer.eos_token_id])
    masks = grammars.token_masks([None, matcher, None], pin=False)
    allowed = ((masks.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).bool().flatten(1)
    assert allowed[[0, 2], : grammars.vocab_size].all()  # the rows with no grammar: every token
    first = {tokenizer.decode([t]) for t in allowed[1].nonzero().flatten().tolist() if t < grammars.vocab_size}
    assert first and all(re.fullmatch("ab*", s) for s in first)  # only tokens that keep "ab+" reachable
    assert grammars.token_masks([None, None], pin=False) is None


@pytest.mark.parametrize("spec, words", [
    (SO(regex="(ab"), "parenthesis"),
    (SO(grammar="root ::= "), "EBNF"),
    (SO(json={"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}), "nowhere"),
])
def test_what_does_not_compile_is_the_requests_error(backend, spec, words):
    with pytest.raises(InvalidRequestError) as err:
        backend[1].compile(spec)
    assert err.value.fields == ["structured_outputs"] and words in str(err.value)
    assert "/project/" not in str(err.value) and str(err.value).startswith(f"structured_outputs.{spec.kind} ")


# ---- the engine ---------------------------------------------------------------------------------


def _constrained(tokenizer, n_choice=3):
    """(params, check) per request: a schema with an adapter, choices with n > 1, a regex, JSON mode (its
    key strings could run on for ever under random weights: quotes and a closing brace are pushed up, wherever
    the grammar lets them in)."""
    push = {t: 40 for text in ('"', "}") for t in tokenizer.encode(text, add_special_tokens=False)}
    return [
        (greedy(48, structured_outputs=SO(json=SCHEMA, disable_any_whitespace=True)), _check_schema),
        (seeded(3, 16, n=n_choice, structured_outputs=SO(choice=CHOICES)), lambda t: t in CHOICES),
        (seeded(5, 16, structured_outputs={"regex": PATTERN}), lambda t: re.fullmatch(PATTERN, t)),
        (greedy(64, logit_bias=push, structured_outputs=SO(json_object=True, disable_any_whitespace=True)),
         lambda t: isinstance(json.loads(t, strict=False), dict)),
    ]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_constrained_and_free_requests_share_a_batch(make_llm, loras, async_scheduling):  # noqa: F811
    llm = make_llm(async_scheduling=async_scheduling)
    sql = loras[sorted(loras)[0]]
    cases = _constrained(llm.engine.tokenizer)
    free = [greedy(12), seeded(8, 12)]
    prompts = PROMPTS[: len(cases) + len(free)]
    adapters = [sql, None, sql, None, None, sql]
    outs = llm.generate(prompts, [p for p, _ in cases] + free, lora_request=adapters)
    for out, (params, check) in zip(outs, cases):
        assert out.error is None and len(out.outputs) == params.n
        for completion in out.outputs:
            assert completion.finish_reason == "stop", completion
            assert check(completion.text), completion.text
    # the masks touched no other row: the free requests are what they are alone
    alone = llm.generate(prompts[len(cases):], free, lora_request=adapters[len(cases):])
    assert [o.outputs[0].token_ids for o in outs[len(cases):]] == [o.outputs[0].token_ids for o in alone]


def test_min_tokens_yield_to_a_complete_grammar_and_ignore_eos_stops_there(make_llm):  # noqa: F811
    llm = make_llm()
    outs = llm.generate(PROMPTS[:2], [greedy(16, min_tokens=12, structured_outputs=SO(choice=["no", "yes"])),
                                      greedy(16, ignore_eos=True, structured_outputs=SO(regex="ab?c"))])
    assert outs[0].outputs[0].text in ("no", "yes") and outs[0].outputs[0].finish_reason == "stop"
    assert outs[1].outputs[0].text in ("ac", "abc") and outs[1].outputs[0].finish_reason == "stop"


def test_max_tokens_cut_leaves_a_prefix_the_grammar_accepts(make_llm, backend):  # noqa: F811
    out = make_llm().generate(PROMPTS[0], greedy(5, structured_outputs=SO(json=SCHEMA)))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    tokenizer, grammars = backend
    matcher = grammars.matcher(grammars.compile(SO(json=SCHEMA)), [tokenizer.eos_token_id])
    assert all(matcher.accept(t) for t in out.token_ids) and out.text.startswith("{")


def test_a_bad_schema_fails_its_request_alone(make_llm):  # noqa: F811
    engine = make_llm().engine
    engine.add_request("ok", PROMPTS[0], greedy(6, structured_outputs=SO(choice=["yes", "no"])))
    with pytest.raises(InvalidRequestError, match="structured_outputs.regex cannot be compiled"):
        engine.add_request("bad", PROMPTS[1], greedy(6, structured_outputs=SO(regex="[a-")))
    final = run_steps(engine)
    assert set(final) == {"ok"} and final["ok"].outputs[0].text in ("yes", "no")


@pytest.mark.gpu
def test_constrained_requests_on_the_gpu(demo, loras):
    """CUDA graphs, async scheduling and the masks' pinned copy: every output keeps its shape."""
    import xgrammar  # noqa: F401 - a runtime dependency: a machine without it fails this test
    from replicas.llm import LLM

    llm = LLM(str(demo.model_dir), enable_lora=True, max_loras=4, max_lora_rank=32, dtype="bfloat16")
    assert llm.engine.async_scheduling
    cases = _constrained(llm.engine.tokenizer, n_choice=2)
    outs = llm.generate(PROMPTS[: len(cases)], [p for p, _ in cases],
                        lora_request=[loras[sorted(loras)[0]], None, loras[sorted(loras)[1]], None])
    for out, (_, check) in zip(outs, cases, strict=True):
        assert out.error is None
        for completion in out.outputs:
            assert completion.finish_reason == "stop" and check(completion.text), completion.text


def test_preemption_keeps_each_grammar_where_its_sequence_was(make_llm):  # noqa: F811
    """Constrained requests in a cache too small for all of them preempt each other (recompute): their matchers
    keep the tokens already accepted, so each output equals the same request run in a roomy cache."""
    from tests.replicas.engine_cases import submit

    ids_regex = r"[a-z]{30}"  # 30 tokens or more of lowercase: long enough to outgrow the blocks
    params = [greedy(36, structured_outputs=SO(regex=ids_regex))] * 4 + \
             [seeded(3, 36, structured_outputs=SO(regex=ids_regex))] * 2
    reference = [o.outputs[0].token_ids for o in make_llm().generate(PROMPTS, params)]
    small = make_llm(num_kv_blocks=5, block_size=16)
    seqs = submit(small.engine, PROMPTS, params, [None] * len(PROMPTS))
    final = run_steps(small.engine)
    assert sum(s.num_preemptions for s in seqs.values()) > 0
    for i, ref in enumerate(reference):
        completion = final[str(i)].outputs[0]
        assert completion.token_ids == ref and re.fullmatch(ids_regex, completion.text), completion
