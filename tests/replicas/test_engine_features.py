"""Engine features end to end on the demo checkpoint (CPU, float32): stopping, seeded sampling,
logprobs and penalties. Scheduling (prefix caching, preemption, continuous batching, abort) is in
test_engine_scheduling.py.
"""

from __future__ import annotations

import json

import pytest

from replicas.errors import InvalidRequestError
from replicas.sampling_params import SamplingParams
from tests.replicas.engine_cases import (  # noqa: F401  (make_llm, llm: fixtures)
    PROMPTS, greedy, llm, make_llm, seeded, tokens)


# ---- stopping ---------------------------------------------------------------------------------


def _spanning_stop(tokenizer, token_ids: list[int]) -> tuple[int, int, str]:
    """(j, b, s): a 4-character stop string s = last 2 characters of token j-1 + first 2 of token j,
    whose first occurrence in the text starts at b - 2, b being where token j's text begins."""
    text = tokenizer.decode(token_ids)
    ends = [len(tokenizer.decode(token_ids[: i + 1])) for i in range(len(token_ids))]
    for j in range(2, len(token_ids)):
        b = ends[j - 1]
        if tokenizer.decode(token_ids[:j]) != text[:b] or tokenizer.decode(token_ids[: j + 1]) != text[: ends[j]]:
            continue  # a character split over tokens: no clean boundary here
        prev, piece = text[ends[j - 2] : b], text[b : ends[j]]
        s = text[b - 2 : b + 2]
        if len(prev) >= 2 and len(piece) >= 2 and s.isascii() and s.isprintable() and text.find(s) == b - 2:
            return j, b, s
    raise AssertionError(f"no stop string spanning two tokens in {text!r}")


@pytest.fixture(scope="module")
def first_run(llm):
    """A greedy base-model run long enough to pick stop strings and stop tokens from."""
    out = llm.generate(PROMPTS[0], greedy(32))[0]
    completion = out.outputs[0]
    assert completion.finish_reason == "length" and len(completion.token_ids) == 32
    assert completion.text == llm.engine.tokenizer.decode(completion.token_ids)
    return completion


def test_stop_string_spanning_tokens(llm, first_run):
    j, b, stop = _spanning_stop(llm.engine.tokenizer, first_run.token_ids)
    never = "\x07never\x07"
    for include in (False, True):
        params = greedy(32, stop=[never, stop], include_stop_str_in_output=include)
        completion = llm.generate(PROMPTS[0], params)[0].outputs[0]
        assert completion.finish_reason == "stop"
        assert completion.stop_reason == stop
        # generation ends at the token that completes the stop string (token j)
        assert completion.token_ids == first_run.token_ids[: j + 1]
        assert completion.text == first_run.text[: b + 2 if include else b - 2]
        assert (stop in completion.text) is include


def test_stop_string_on_last_allowed_token_is_stop(llm, first_run):
    j, b, stop = _spanning_stop(llm.engine.tokenizer, first_run.token_ids)
    completion = llm.generate(PROMPTS[0], greedy(j + 1, stop=stop))[0].outputs[0]
    assert completion.text == first_run.text[: b - 2]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)


def _first_new_token(token_ids: list[int], start: int) -> int:
    """The first index >= start whose token did not occur before it."""
    return next(i for i in range(start, len(token_ids)) if token_ids[i] not in token_ids[:i])


def test_stop_token_ids(llm, first_run):
    k = _first_new_token(first_run.token_ids, 4)
    stop_id = first_run.token_ids[k]
    completion = llm.generate(PROMPTS[0], greedy(32, stop_token_ids=[stop_id]))[0].outputs[0]
    assert completion.token_ids == first_run.token_ids[: k + 1]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop_id)


def test_stop_token_text_is_excluded(llm, first_run):
    tok = llm.engine.tokenizer
    k = _first_new_token(first_run.token_ids, 4)
    stop_id = first_run.token_ids[k]
    for include in (False, True):
        params = greedy(32, stop_token_ids=[stop_id], include_stop_str_in_output=include)
        completion = llm.generate(PROMPTS[0], params)[0].outputs[0]
        assert completion.text == tok.decode(first_run.token_ids[: k + 1 if include else k])


def test_held_back_stop_prefix_is_released_at_length(llm, first_run):
    """Text that might have begun a stop string is held back while streaming, and released when the output ends."""
    stop = first_run.text[-2:] + "\x07"
    completion = llm.generate(PROMPTS[0], greedy(32, stop=stop))[0].outputs[0]
    assert (completion.finish_reason, completion.stop_reason) == ("length", None)
    assert completion.text == first_run.text


def test_max_tokens_is_length(llm, first_run):
    completion = llm.generate(PROMPTS[0], greedy(7))[0].outputs[0]
    assert completion.token_ids == first_run.token_ids[:7]
    assert (completion.finish_reason, completion.stop_reason) == ("length", None)
    assert completion.text == llm.engine.tokenizer.decode(first_run.token_ids[:7])


def test_eos_and_ignore_eos(demo, make_llm, first_run, tmp_path):
    """The demo never picks its real EOS greedily, so a copy of the model declares a token it does pick as EOS."""
    k = _first_new_token(first_run.token_ids, 3)
    eos = first_run.token_ids[k]
    model = tmp_path / "model"
    model.mkdir()
    for f in demo.model_dir.iterdir():
        (model / f.name).symlink_to(f)
    (model / "generation_config.json").unlink()
    gen = json.loads((demo.model_dir / "generation_config.json").read_text()) | {"eos_token_id": [2, eos]}
    (model / "generation_config.json").write_text(json.dumps(gen))

    llm = make_llm(model, enable_lora=False)
    stopped, ignored = llm.generate([PROMPTS[0]] * 2, [greedy(32), greedy(32, ignore_eos=True)])
    assert stopped.outputs[0].token_ids == first_run.token_ids[: k + 1]
    assert (stopped.outputs[0].finish_reason, stopped.outputs[0].stop_reason) == ("stop", None)
    assert ignored.outputs[0].token_ids == first_run.token_ids
    assert ignored.outputs[0].finish_reason == "length"



def test_min_tokens_holds_back_stop_ids_and_strings(llm, first_run):
    """A stop id that greedy decoding reaches at token k cannot end the output before min_tokens; a stop string
    the first min_tokens - 1 tokens complete is output."""
    k = _first_new_token(first_run.token_ids, 4)
    stop_id = first_run.token_ids[k]
    out = llm.generate(PROMPTS[0], greedy(32, stop_token_ids=[stop_id], min_tokens=k + 3))[0].outputs[0]
    assert out.token_ids[:k] == first_run.token_ids[:k] and stop_id not in out.token_ids[:k + 3]
    assert len(out.token_ids) >= k + 3
    stop = llm.engine.tokenizer.decode(first_run.token_ids[:2])  # completed by the second token
    out = llm.generate(PROMPTS[0], greedy(8, stop=stop, min_tokens=3))[0].outputs[0]
    assert out.token_ids == first_run.token_ids[:8] and out.finish_reason == "length"


def test_logit_bias_bans_and_forces_tokens(llm, first_run):
    first = first_run.token_ids[0]
    banned = llm.generate(PROMPTS[0], greedy(4, logit_bias={first: -100}))[0].outputs[0]
    assert banned.token_ids[0] != first
    forced = llm.generate(PROMPTS[0], SamplingParams(temperature=0.7, seed=1, max_tokens=5,
                                                     logit_bias={"17": 100}))[0].outputs[0]
    assert forced.token_ids == [17] * 5
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(InvalidRequestError, match="logit_bias") as err:
        llm.engine.add_request("big-id", PROMPTS[0], greedy(2, logit_bias={vocab: 1}))
    assert err.value.fields == ["logit_bias"] and not llm.engine.has_unfinished_requests()


def test_allowed_token_ids_and_truncate_prompt_tokens(llm, first_run):
    """allowed_token_ids: every token one of them; truncate_prompt_tokens: the prompt's last k tokens, as if sent
    alone; ids outside the vocabulary are the field's error."""
    allowed = sorted(set(first_run.token_ids[:3]))
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=1.0, seed=2, max_tokens=8, allowed_token_ids=allowed))
    assert set(out[0].outputs[0].token_ids) <= set(allowed)
    ids = llm.engine.tokenizer.encode(PROMPTS[1])
    cut = llm.generate(PROMPTS[1], greedy(6, truncate_prompt_tokens=4))[0]
    assert cut.prompt_token_ids == ids[-4:]
    assert cut.outputs[0].token_ids == tokens(llm.generate({"prompt_token_ids": ids[-4:]}, greedy(6)))[0]
    with pytest.raises(InvalidRequestError) as err:
        llm.engine.add_request("x", PROMPTS[0], greedy(2, allowed_token_ids=[llm.engine.model_config.vocab_size]))
    assert err.value.fields == ["allowed_token_ids"]

# ---- seeded sampling --------------------------------------------------------------------------


def test_seeded_sampling_reproducible_and_batch_independent(llm, make_llm, loras):
    sql = loras["demo-sql"]
    alone_base = tokens(llm.generate(PROMPTS[1], seeded(1234)))[0]
    alone_sql = tokens(llm.generate(PROMPTS[1], seeded(1234), sql))[0]
    # across runs and across engines
    assert tokens(llm.generate(PROMPTS[1], seeded(1234)))[0] == alone_base
    assert tokens(make_llm().generate(PROMPTS[1], seeded(1234)))[0] == alone_base
    # it really samples: not the greedy path, and the seed matters
    assert alone_base != tokens(llm.generate(PROMPTS[1], greedy(24)))[0]
    assert tokens(llm.generate(PROMPTS[1], seeded(4321)))[0] != alone_base
    assert alone_sql != alone_base

    # the same requests inside a batch of 6: other adapters, prompts, unseeded and greedy neighbours
    prompts = [PROMPTS[2], PROMPTS[1], PROMPTS[3], PROMPTS[1], PROMPTS[4], PROMPTS[5]]
    params = [SamplingParams(temperature=1.0, max_tokens=30), seeded(1234), greedy(10), seeded(1234),
              seeded(99, max_tokens=5), SamplingParams(temperature=0.5, top_k=5, max_tokens=20)]
    lora_list = [loras["demo-chat"], None, loras["demo-translate"], sql, loras["demo-summarize"], sql]
    batch = tokens(llm.generate(prompts, params, lora_list))
    assert batch[1] == alone_base
    assert batch[3] == alone_sql


# ---- logprobs ---------------------------------------------------------------------------------


def test_logprobs_greedy(llm):
    five, zero = llm.generate([PROMPTS[2]] * 2, [greedy(12, logprobs=5), greedy(12, logprobs=0)])
    five, zero = five.outputs[0], zero.outputs[0]
    assert five.token_ids == zero.token_ids
    assert len(five.logprobs) == len(zero.logprobs) == 12
    for token, top, only in zip(five.token_ids, five.logprobs, zero.logprobs):
        assert len(top) == 5  # greedy: the sampled token is the top-1, counted once
        assert max(top, key=top.get) == token
        assert all(v <= 0 for v in top.values())
        assert list(only) == [token]
        assert only[token] == pytest.approx(top[token], abs=1e-5)


def test_logprobs_sampled_are_raw_model_logprobs(llm):
    """Sampled run (temperature 0.8): k or k+1 entries; the values are the raw model's, as a greedy
    run over the same context (prompt + the sampled tokens so far) reports them."""
    k = 3
    sampled = llm.generate(PROMPTS[3], seeded(7, max_tokens=12, logprobs=k))[0].outputs[0]
    assert len(sampled.logprobs) == 12
    for token, entry in zip(sampled.token_ids, sampled.logprobs):
        assert len(entry) in (k, k + 1) and token in entry
        if len(entry) == k + 1:  # the sampled token is outside the top k
            assert entry[token] <= min(v for t, v in entry.items() if t != token)
    prompt_ids = llm.engine.tokenizer.encode(PROMPTS[3])
    steps = [0, 1, 5, 11]
    forced = llm.generate([{"prompt_token_ids": prompt_ids + sampled.token_ids[:t]} for t in steps],
                          greedy(1, logprobs=20))
    for t, out in zip(steps, forced, strict=True):
        reference = out.outputs[0].logprobs[0]
        top_k = sorted(reference, key=reference.get, reverse=True)[:k]
        assert set(top_k) <= set(sampled.logprobs[t])
        for token_id, value in sampled.logprobs[t].items():
            if token_id in reference:
                assert value == pytest.approx(reference[token_id], abs=1e-4)


# ---- penalties --------------------------------------------------------------------------------


def _repeats(token_ids: list[int]) -> int:
    return len(token_ids) - len(set(token_ids))


@pytest.mark.parametrize("penalty", [dict(presence_penalty=1.5), dict(frequency_penalty=1.5)],
                         ids=["presence", "frequency"])
def test_penalties_reduce_repetition(llm, penalty):
    prompts = PROMPTS[:4]
    plain = tokens(llm.generate(prompts, greedy(128)))
    penalized = tokens(llm.generate(prompts, greedy(128, **penalty)))
    for a, b in zip(plain, penalized, strict=True):
        assert a[0] == b[0]  # nothing generated yet: nothing to penalise
        assert a != b
        assert _repeats(b) <= _repeats(a)
    assert sum(map(_repeats, penalized)) < sum(map(_repeats, plain))
    # a negative penalty rewards repetition
    negative = {name: -2.0 for name in penalty}
    rewarded = tokens(llm.generate(prompts, greedy(128, **negative)))
    assert sum(map(_repeats, rewarded)) > sum(map(_repeats, plain))


def test_bad_words_never_appear_as_their_tokens(llm, first_run):
    """vLLM's bad_words: the word's tokens (at a text's start and after a space) never end up in the output; the
    rest of the output may change, as the ban moves the sampling elsewhere."""
    from replicas.request_inputs import bad_words_ids

    tok = llm.engine.tokenizer
    word = next(w for w in first_run.text.split() if w.isalpha() and len(w) > 2)
    params = greedy(32, bad_words=[word, "the"])
    banned = bad_words_ids(tok, params)
    assert len(banned) >= 3 and (tuple(tok.encode(" " + word, add_special_tokens=False)) in banned)
    def holds(ids):
        return any(tuple(ids[i:i + len(w)]) == w for w in banned for i in range(len(ids)))

    assert holds(first_run.token_ids)  # the free run wrote one of them
    out = llm.generate(PROMPTS[0], params)[0].outputs[0]
    assert not holds(out.token_ids)
    assert out.token_ids != first_run.token_ids
    with pytest.raises(InvalidRequestError, match="bad_words"):
        greedy(4, bad_words=["ok", " "])


def test_chat_renders_each_conversation_with_the_models_template(llm, loras):
    """vLLM's LLM.chat: a conversation, or several, through the chat template; the same tokens as generate() on
    the rendered prompt; continue_final_message leaves the last message open."""
    from replicas.chat_template import render_chat

    tok = llm.engine.tokenizer
    one = [{"role": "user", "content": "Write a query"}]
    two = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    sql = loras[sorted(loras)[-1]]
    outs = llm.chat([one, two], greedy(6), lora_request=[sql, None])
    for conversation, out, lora in zip((one, two), outs, (sql, None), strict=True):
        ids = tok.encode(render_chat(conversation, tok.chat_template, tok.bos_token, tok.eos_token),
                         add_special_tokens=False)
        assert out.prompt_token_ids == ids and out.prompt_token_ids[0] == tok.bos_token_id
        alone = llm.generate({"prompt_token_ids": ids}, greedy(6), lora)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
    assert llm.chat(one, greedy(6), lora_request=sql)[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    prefilled = one + [{"role": "assistant", "content": "SELECT"}]
    carried = llm.chat(prefilled, greedy(2), add_generation_prompt=False, continue_final_message=True)[0]
    assert tok.decode(carried.prompt_token_ids).endswith("SELECT")
    with pytest.raises(ValueError, match="add_generation_prompt"):
        llm.chat(prefilled, greedy(2), continue_final_message=True)


def test_chat_template_kwargs_are_the_templates_variables(llm, monkeypatch):
    """vLLM's chat_template_kwargs (Qwen3's enable_thinking, say) reach the template; a name the call sets
    itself is refused."""
    tok = llm.engine.tokenizer
    monkeypatch.setattr(tok, "chat_template", "{% for m in messages %}{{ m['content'] }}{% endfor %}"
                                              "{% if enable_thinking is defined and not enable_thinking %}!{% endif %}")
    one = [{"role": "user", "content": "Write a query"}]
    thinking, quiet = (llm.chat(one, greedy(1), chat_template_kwargs=kw)[0]
                       for kw in (None, {"enable_thinking": False}))
    assert thinking.prompt_token_ids == tok.encode("Write a query", add_special_tokens=False)
    assert quiet.prompt_token_ids == tok.encode("Write a query!", add_special_tokens=False)
    with pytest.raises(InvalidRequestError, match="add_generation_prompt"):
        llm.chat(one, greedy(1), chat_template_kwargs={"add_generation_prompt": False})


def test_eos_that_ends_a_sequence_leaves_no_text_even_with_special_tokens_shown(llm):
    """As vLLM: with skip_special_tokens off, the EOS that stops a sequence is not part of its text (unless
    include_stop_str_in_output); an EOS that does not stop it (ignore_eos) is."""
    eos = llm.engine.tokenizer.eos_token_id
    forced = dict(logit_bias={eos: 100}, skip_special_tokens=False)
    ended, kept, ignored = (llm.generate(PROMPTS[0], greedy(3, **forced, **extra))[0].outputs[0] for extra in
                            ({}, {"include_stop_str_in_output": True}, {"ignore_eos": True}))
    eos_text = llm.engine.tokenizer.decode([eos], skip_special_tokens=False)
    assert ended.token_ids == [eos] and ended.finish_reason == "stop" and ended.text == ""
    assert kept.text == eos_text
    assert ignored.token_ids == [eos] * 3 and ignored.text == eos_text * 3
