"""Prompt logprobs (SamplingParams.prompt_logprobs) on the demo checkpoint against transformers + PEFT, over
chunked prefills, with the prefix cache on, for n completions; and the row bookkeeping alone."""

from __future__ import annotations

import pytest
import torch

from replicas import prompt_logprobs
from replicas.sampling_params import SamplingParams
from replicas.scheduler import ScheduledSequence
from replicas.sequence import Sequence
from tests.replicas.engine_cases import LONG_TEXT, make_llm  # noqa: F401  (make_llm: a fixture)

PROMPT = LONG_TEXT[:160]


@pytest.fixture(scope="module")
def hf_prompt_logprobs(demo):
    """Each prompt token's logprob and its position's top 3 under transformers + PEFT: base model and demo-sql."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo.model_dir)
    base = AutoModelForCausalLM.from_pretrained(demo.model_dir, dtype=torch.float32).eval()
    model = PeftModel.from_pretrained(base, demo.adapters["demo-sql"], adapter_name="demo-sql")
    ids = tok(PROMPT, return_tensors="pt").input_ids
    out = {}
    for name in (None, "demo-sql"):
        with torch.no_grad():
            if name is None:
                with model.disable_adapter():
                    logits = model(ids).logits[0]
            else:
                logits = model(ids).logits[0]
        lp = torch.log_softmax(logits.float(), -1)[:-1]  # position p predicts token p + 1
        chosen = lp.gather(1, ids[0, 1:, None])[:, 0]
        out[name] = (ids[0].tolist(), chosen.tolist(), lp.topk(3, -1).indices.tolist())
    return out


def _check(got, want_ids, want_chosen, want_top, k=3, tol=2e-3):
    assert got[0] is None and len(got) == len(want_ids)
    for entry, token, lp, top in zip(got[1:], want_ids[1:], want_chosen, want_top, strict=True):
        assert abs(entry[token] - lp) < tol
        if tol <= 2e-3:  # looser numerics may swap near ties in the top k
            assert set(entry) == set(top[:k]) | {token}


@pytest.mark.parametrize("chunk, tp", [(2048, 1), (16, 1), (16, 2)], ids=["whole", "chunked", "chunked-tp2"])
def test_prompt_logprobs_match_hf_peft(make_llm, loras, hf_prompt_logprobs, chunk, tp):
    """TP = 2: the vocabulary-parallel LM head gathers the prompt rows' logits as it does the sampled rows'."""
    llm = make_llm(max_num_batched_tokens=chunk, tensor_parallel_size=tp)
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3)
    outs = llm.generate([PROMPT, PROMPT], params, [None, loras["demo-sql"]])
    for out, name in zip(outs, (None, "demo-sql"), strict=True):
        ids, chosen, top = hf_prompt_logprobs[name]
        assert out.prompt_token_ids == ids
        _check(out.prompt_logprobs, ids, chosen, top)
    plain = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=2))[0]
    assert plain.prompt_logprobs is None and plain.outputs[0].token_ids == outs[0].outputs[0].token_ids


@pytest.mark.gpu
def test_prompt_logprobs_on_the_gpu(make_llm, loras, hf_prompt_logprobs):
    """CUDA: prompt steps through piecewise graphs and the Triton LoRA kernels (float32 dots in TF32)."""
    llm = make_llm(device="cuda", max_num_batched_tokens=16)
    outs = llm.generate([PROMPT, PROMPT], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3),
                        [None, loras["demo-sql"]])
    for out, name in zip(outs, (None, "demo-sql"), strict=True):
        _check(out.prompt_logprobs, *hf_prompt_logprobs[name], tol=2e-2)


def test_cached_prompt_is_computed_again_for_its_logprobs(make_llm, hf_prompt_logprobs):
    """The prefix cache holds the prompt after the first request; the second computes it anyway (cached positions
    would have no logits), and k = 0 gives each token's own logprob only. n = 3: one list on the request, computed
    by the first completion; the other two take the prompt's full blocks from the cache."""
    llm = make_llm()
    bm = llm.engine.scheduler.block_manager
    ids, chosen, top = hf_prompt_logprobs[None]
    full = (len(ids) - 1) // bm.block_size * bm.block_size
    llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=1))
    hits = bm.num_cache_hit_tokens
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, n=3))[0]
    assert bm.num_cache_hit_tokens - hits == 2 * full and full >= 2 * bm.block_size
    _check(out.prompt_logprobs, ids, chosen, top, k=0)
    assert len(out.outputs) == 3


def test_rows_and_spans_over_a_chunked_step_and_a_recompute():
    """Rows of a step that holds a decode row, a prompt's middle chunk and its last chunk; recording the same
    span twice (a preempted sequence computing its prompt again) appends nothing the second time."""
    want = Sequence("a", list(range(10, 20)), SamplingParams(prompt_logprobs=1))
    other = Sequence("b", [1, 2, 3], SamplingParams())
    other.output_token_ids = [4]
    other.num_computed_tokens = 3
    want.num_computed_tokens = 4
    step = [ScheduledSequence.of(other, 1), ScheduledSequence.of(want, 6)]  # want: positions 4..9
    rows, spans = prompt_logprobs.plan(step)
    assert rows == [1, 2, 3, 4, 5] and [(s.first, s.row, s.count) for s in spans] == [(4, 0, 5)]  # not position 9
    entries = [None] + [{}] * 4  # tokens 1..4 recorded by an earlier chunk
    logits = torch.randn(len(rows), 32, generator=torch.Generator().manual_seed(0))
    logits[0, 3] = 10.0  # the top 1 of the first row, not its prompt token (15)
    prompt_logprobs.record(logits, spans, lambda seq: entries)
    prompt_logprobs.record(logits, spans, lambda seq: entries)
    assert len(entries) == 10
    lp = torch.log_softmax(logits, -1)
    assert entries[5][15] == pytest.approx(float(lp[0, 15])) and entries[9][19] == pytest.approx(float(lp[4, 19]))
    assert entries[5].keys() == {3, 15}  # the top 1 and the prompt token
