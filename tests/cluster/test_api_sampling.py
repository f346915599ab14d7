"""The OpenAI-compatible API's sampling and scoring features over an in-process LoRAServer, driven by the
official openai client: n choices, logit_bias and min_tokens, echo with prompt logprobs, prompt lists,
/tokenize, chat logprobs, structured outputs."""

from __future__ import annotations

import asyncio
import json
import re

import openai
import pytest

from tests.cluster.api_cases import run, stack  # noqa: F401  (stack: a fixture)


def test_n_choices_full_and_streamed(stack):
    """n = 2: two choices (index 0 and 1) in a full response and in a stream, each with its finish_reason;
    usage counts both. Seeded, so the choices differ and each equals the n = 1 request seeded seed + index."""
    kw = dict(model="demo-sql", prompt="The quick brown fox", max_tokens=6, temperature=1.0)
    messages = [{"role": "user", "content": "Say hello"}]

    async def go(c):
        full = await c.completions.create(n=2, seed=11, **kw)
        singles = [await c.completions.create(seed=11 + i, **kw) for i in range(2)]
        chunks = [ch async for ch in await c.chat.completions.create(
            model="demo-chat", messages=messages, max_tokens=5, temperature=1.0, seed=3, n=2, stream=True,
            stream_options={"include_usage": True})]
        chat = await c.chat.completions.create(model="demo-chat", messages=messages, max_tokens=5, temperature=1.0,
                                               seed=3, n=2)
        return full, singles, chunks, chat

    full, singles, chunks, chat = run(stack, go)
    assert [ch.index for ch in full.choices] == [0, 1]
    assert [ch.text for ch in full.choices] == [s.choices[0].text for s in singles]
    assert full.choices[0].text != full.choices[1].text
    assert [ch.finish_reason for ch in full.choices] == ["length", "length"]
    assert full.usage.completion_tokens == 12
    streamed = {0: "", 1: ""}
    finishes = {0: [], 1: []}
    roles = {0: 0, 1: 0}
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
            roles[choice.index] += choice.delta.role == "assistant"
            if choice.finish_reason:
                finishes[choice.index].append(choice.finish_reason)
    assert streamed == {ch.index: ch.message.content for ch in chat.choices}
    assert finishes == {0: ["length"], 1: ["length"]} and roles == {0: 1, 1: 1}
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens == 10


def test_logit_bias_and_min_tokens(stack):
    """OpenAI's logit_bias (string ids) forces a token; vLLM's min_tokens (extra_body) reaches the engine (its
    semantics: tests/replicas/test_engine_features.py); bad values of either are a 400 naming the field."""
    from replicas.demo_checkpoint import ensure_demo_checkpoint
    from replicas.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(ensure_demo_checkpoint().model_dir)
    kw = dict(model="demo-sql", prompt="The quick brown fox", max_tokens=4, temperature=0)

    async def go(c):
        plain = await c.completions.create(**kw)
        forced = await c.completions.create(logit_bias={"17": 100}, **kw)
        held = await c.completions.create(extra_body={"min_tokens": 4}, **kw)
        errors = []
        for bad in (dict(logit_bias={"1000000": 1}), dict(extra_body={"min_tokens": 5})):
            with pytest.raises(openai.BadRequestError) as err:
                await c.completions.create(**kw, **bad)
            errors.append(str(err.value))
        return plain, forced, held, errors

    plain, forced, held, errors = run(stack, go)
    assert forced.choices[0].text == tok.decode([17] * 4) != plain.choices[0].text
    assert held.choices[0].text == plain.choices[0].text
    assert "logit_bias" in errors[0] and "min_tokens" in errors[1]


def test_echo_returns_the_prompt_with_its_logprobs(stack):
    """echo (OpenAI's legacy completions, as lm-evaluation-harness scores a text): the prompt leads the text, and
    with logprobs its tokens lead the logprobs, the first with none. Streamed, the first chunk carries it."""
    prompt = "The quick brown fox jumps over"
    kw = dict(model="demo-sql", prompt=prompt, max_tokens=2, temperature=0)

    async def go(c):
        plain = await c.completions.create(logprobs=1, **kw)
        echoed = await c.completions.create(logprobs=1, echo=True, **kw)
        chunks = [ch async for ch in await c.completions.create(echo=True, stream=True, **kw)]
        return plain, echoed, chunks

    plain, echoed, chunks = run(stack, go)
    text = plain.choices[0].text
    assert echoed.choices[0].text == prompt + text
    lp, mine = echoed.choices[0].logprobs, plain.choices[0].logprobs
    n = len(lp.tokens) - len(mine.tokens)
    assert n == echoed.usage.prompt_tokens and "".join(lp.tokens[:n]).endswith(prompt)  # after the BOS token's
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v < 0 for v in lp.token_logprobs[1:n]) and all(lp.tokens[i] in lp.top_logprobs[i] for i in range(1, n))
    assert lp.token_logprobs[n:] == pytest.approx(mine.token_logprobs, abs=1e-4)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == prompt + text
    assert chunks[0].choices[0].text.startswith(prompt)


def test_several_prompts_in_one_request(stack):
    """A prompt list (OpenAI's): choice i * n + j is completion j of prompt i, each what its prompt alone gives,
    echo and logprobs per prompt, usage summed; streamed, the same texts. A bad prompt among them fails the
    request whole and leaves nothing running."""
    prompts = ["The quick brown fox", "SELECT name FROM", "Hello"]
    kw = dict(model="demo-sql", max_tokens=3, temperature=1.0, seed=4, n=2)

    async def go(c):
        alone = [await c.completions.create(prompt=p, **kw) for p in prompts]
        many = await c.completions.create(prompt=prompts, **kw)
        echoed = await c.completions.create(prompt=prompts[:2], model="demo-sql", max_tokens=1, temperature=0,
                                            echo=True, logprobs=1)
        chunks = [ch async for ch in await c.completions.create(prompt=prompts, stream=True, **kw,
                                                                stream_options={"include_usage": True})]
        ids = await c.completions.create(prompt=[[5, 6, 7, 8], [9, 10]], **kw)
        with pytest.raises(openai.BadRequestError, match="at most 256 prompts"):
            await c.completions.create(prompt=["a"] * 257, **kw)
        with pytest.raises(openai.BadRequestError) as err:
            await c.completions.create(prompt=[[5, 6], [10 ** 6]], **kw)  # the second is outside the vocabulary
        engine = stack[2].engine.engine
        for _ in range(200):  # the first prompt's request, aborted, leaves within a few steps
            if not engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        return alone, many, echoed, chunks, ids, err.value

    alone, many, echoed, chunks, ids, err = run(stack, go)
    assert [ch.index for ch in ids.choices] == [0, 1, 2, 3] and ids.usage.prompt_tokens == 6
    assert [ch.index for ch in many.choices] == list(range(6))
    assert [ch.text for ch in many.choices] == [ch.text for a in alone for ch in a.choices]
    assert many.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert many.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    assert [ch.text.startswith(p) for ch, p in zip(echoed.choices, prompts)] == [True, True]
    assert [ch.logprobs.token_logprobs[0] for ch in echoed.choices] == [None, None]
    streamed: dict[int, str] = {}
    for chunk in chunks:
        for ch in chunk.choices:
            streamed[ch.index] = streamed.get(ch.index, "") + ch.text
    assert streamed == {ch.index: ch.text for ch in many.choices}
    assert chunks[-1].usage.completion_tokens == many.usage.completion_tokens
    assert "prompt_token_ids" in str(err) and not stack[2].engine.engine.has_unfinished_requests()


def test_tokenize_and_detokenize(stack):
    """vLLM's routes: a prompt's ids (with BOS, or without), a chat's rendered prompt, and back; bad input is a 400."""
    server = stack[2]
    tok = server.tokenizer

    async def go(c):
        http = c._client
        got = [await http.post("http://127.0.0.1/tokenize", json=body) for body in (
            {"model": "demo-sql", "prompt": "SELECT name FROM users"},
            {"prompt": "SELECT name FROM users", "add_special_tokens": False},
            {"messages": [{"role": "user", "content": "Say hello"}]},
            {"prompt": "x", "messages": [{"role": "user", "content": "y"}]})]
        back = await http.post("http://127.0.0.1/detokenize", json={"tokens": got[1].json()["tokens"]})
        bad = await http.post("http://127.0.0.1/detokenize", json={"tokens": [10 ** 7]})
        chat = await c.chat.completions.create(model="demo-chat", messages=[{"role": "user", "content": "Say hello"}],
                                               max_tokens=1)
        return got, back, bad, chat

    got, back, bad, chat = run(stack, go)
    with_bos, plain, rendered, both = got
    assert with_bos.json()["tokens"] == tok.encode("SELECT name FROM users")
    assert plain.json()["tokens"] == tok.encode("SELECT name FROM users", add_special_tokens=False)
    assert with_bos.json()["count"] == len(with_bos.json()["tokens"]) == plain.json()["count"] + 1
    assert with_bos.json()["max_model_len"] == server.max_model_len
    assert rendered.json()["count"] == chat.usage.prompt_tokens  # what the chat route feeds the model
    assert both.status_code == 400 and "prompt" in both.json()["error"]["message"]
    assert back.json()["prompt"] == "SELECT name FROM users"
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_chat_logprobs(stack):
    async def go(c):
        return await c.chat.completions.create(model="lorafleet-demo", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=3, temperature=0, logprobs=True, top_logprobs=2)

    out = run(stack, go)
    content = out.choices[0].logprobs.content
    assert len(content) == 3
    for item in content:
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob)  # greedy: the sampled token is the top one
        assert item.logprob <= 0


def test_structured_outputs_by_every_name(stack):
    """OpenAI's response_format (a JSON Schema, JSON mode) and vLLM's structured_outputs / guided_* reach the
    engine's grammar (its semantics: tests/replicas/test_structured_outputs.py); the demo model's random weights
    would not write any of these by chance. A schema that does not compile, two constraints at once, or a
    json_schema format without its schema is a 400 naming the field."""
    from replicas.demo_checkpoint import ensure_demo_checkpoint
    from replicas.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(ensure_demo_checkpoint().model_dir)
    schema = {"type": "object", "required": ["ok"], "additionalProperties": False,
              "properties": {"ok": {"type": "boolean"}}}
    kw = dict(model="demo-sql", max_tokens=24, temperature=0)
    # JSON may hold any whitespace between tokens, which random weights would write on: the JSON's own tokens
    # are pushed up, wherever the grammar lets them in
    push = {str(t): 40 for text in ('"', "}", ":", "true", "false") for t in tok.encode(text, add_special_tokens=False)}
    chat = dict(kw, messages=[{"role": "user", "content": "Answer in JSON"}], logit_bias=push)

    async def go(c):
        by_schema = await c.chat.completions.create(**chat, response_format={
            "type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}})
        streamed = [ch async for ch in await c.chat.completions.create(**chat, stream=True, response_format={
            "type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})]
        choice = await c.completions.create(prompt="Pick", **kw, extra_body={"structured_outputs": {
            "choice": ["red", "green"]}})
        regex = await c.completions.create(prompt="Code", **kw, extra_body={"guided_regex": r"[A-F]{2}\d"})
        text = await c.completions.create(prompt="Code", **kw, extra_body={"response_format": {"type": "text"}})
        errors = []
        for bad in ({"structured_outputs": {"regex": "(ab"}}, {"guided_regex": "a", "guided_choice": ["b"]},
                    {"response_format": {"type": "json_schema"}}, {"structured_outputs": {"pattern": "a"}}):
            with pytest.raises(openai.BadRequestError) as err:
                await c.completions.create(prompt="x", **kw, extra_body=bad)
            errors.append(err.value.body)
        return by_schema, streamed, choice, regex, text, errors

    by_schema, streamed, choice, regex, text, errors = run(stack, go)
    assert isinstance(json.loads(by_schema.choices[0].message.content)["ok"], bool)
    assert by_schema.choices[0].finish_reason == "stop"
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices) == \
        by_schema.choices[0].message.content
    assert choice.choices[0].text in ("red", "green") and re.fullmatch(r"[A-F]{2}\d", regex.choices[0].text)
    assert not re.fullmatch(r"[A-F]{2}\d", text.choices[0].text)  # "text": no constraint
    assert "cannot be compiled" in errors[0]["message"] and errors[0]["param"] == "structured_outputs"
    assert "at most one of" in errors[1]["message"] and "json_schema" in errors[2]["message"]
    assert "'pattern'" in errors[3]["message"]


def test_bad_words_special_tokens_and_stop_strings_in_the_text(stack):
    """vLLM's bad_words, skip_special_tokens and include_stop_str_in_output (extra_body) reach the engine."""
    kw = dict(model="demo-sql", prompt="The quick brown fox", max_tokens=6, temperature=0)

    async def go(c):
        plain = await c.completions.create(**kw)
        word = next(w for w in plain.choices[0].text.split() if w.isalpha())
        banned = await c.completions.create(**kw, extra_body={"bad_words": [word]})
        stop = plain.choices[0].text[3:6]
        cut = await c.completions.create(**kw, stop=[stop])
        kept = await c.completions.create(**kw, stop=[stop], extra_body={"include_stop_str_in_output": True})
        eos = dict(kw, max_tokens=2, logit_bias={"2": 100})  # EOS forced, and ignored
        hidden = await c.completions.create(**eos, extra_body={"ignore_eos": True})
        shown = await c.completions.create(**eos, extra_body={"ignore_eos": True, "skip_special_tokens": False})
        return plain, word, banned, stop, cut, kept, hidden, shown

    plain, word, banned, stop, cut, kept, hidden, shown = run(stack, go)
    assert f" {word}" in plain.choices[0].text and f" {word}" not in banned.choices[0].text
    assert kept.choices[0].text == cut.choices[0].text + stop and kept.choices[0].finish_reason == "stop"
    assert hidden.choices[0].text == "" and shown.choices[0].text == "</s></s>"


def test_priority_reaches_the_engine(stack):
    """vLLM's priority field: this server schedules first come, first served, so a priority other than 0 is a 400
    naming it (the policy itself: tests/replicas/test_priority_scheduling.py), and 0 is served."""
    kw = dict(model="demo-sql", prompt="The quick brown fox", max_tokens=2, temperature=0)

    async def go(c):
        with pytest.raises(openai.BadRequestError) as err:
            await c.completions.create(**kw, extra_body={"priority": 3})
        with pytest.raises(openai.BadRequestError) as chat_err:
            await c.chat.completions.create(model="demo-sql", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=2, extra_body={"priority": -1})
        return err.value.body, chat_err.value.body, await c.completions.create(**kw, extra_body={"priority": 0})

    refused, chat_refused, served = run(stack, go)
    assert refused["param"] == "priority" and "scheduling_policy" in refused["message"]
    assert chat_refused["param"] == "priority" and served.choices[0].finish_reason == "length"


def test_continuous_usage_stats_ride_on_every_chunk(stack):
    """vLLM's stream_options.continuous_usage_stats: each chunk carries the usage so far, growing to the final."""
    kw = dict(model="demo-sql", prompt="The quick brown fox", max_tokens=5, temperature=0, stream=True)

    async def go(c):
        return [ch async for ch in await c.completions.create(
            **kw, stream_options={"include_usage": True, "continuous_usage_stats": True})]

    chunks = run(stack, go)
    usages = [ch.usage for ch in chunks]
    assert all(u is not None for u in usages) and len(usages) >= 3
    generated = [u.completion_tokens for u in usages]
    assert generated == sorted(generated) and generated[-1] == 5 and generated[0] < 5
    assert len({u.prompt_tokens for u in usages}) == 1 and usages[0].prompt_tokens > 0


def test_streams_carry_each_tokens_logprobs_once(stack):
    """Streamed, each chunk carries the logprobs of the tokens it brings (chat: OpenAI's content entries;
    completions: the legacy lists, the echoed prompt's first): together, what the full response gives."""
    kw = dict(model="demo-sql", max_tokens=6, temperature=0)
    messages = [{"role": "user", "content": "Say hello"}]

    async def go(c):
        chat_full = await c.chat.completions.create(**kw, messages=messages, logprobs=True, top_logprobs=2)
        chat_chunks = [ch async for ch in await c.chat.completions.create(**kw, messages=messages, logprobs=True,
                                                                           top_logprobs=2, stream=True)]
        text_full = await c.completions.create(**kw, prompt="The quick brown fox", logprobs=2, echo=True)
        text_chunks = [ch async for ch in await c.completions.create(**kw, prompt="The quick brown fox", logprobs=2,
                                                                      echo=True, stream=True)]
        return chat_full, chat_chunks, text_full, text_chunks

    chat_full, chat_chunks, text_full, text_chunks = run(stack, go)
    streamed = [e for ch in chat_chunks if ch.choices and ch.choices[0].logprobs
                for e in ch.choices[0].logprobs.content]
    full = chat_full.choices[0].logprobs.content
    # two requests, batched apart: the same tokens, logprobs equal to float32's noise
    assert [(e.token, [t.token for t in e.top_logprobs]) for e in streamed] == \
        [(e.token, [t.token for t in e.top_logprobs]) for e in full] and len(full) == 6
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in full], abs=1e-4)
    tokens, token_logprobs = [], []
    for ch in text_chunks:
        if ch.choices and ch.choices[0].logprobs:
            tokens += ch.choices[0].logprobs.tokens
            token_logprobs += ch.choices[0].logprobs.token_logprobs
    assert tokens == text_full.choices[0].logprobs.tokens and token_logprobs[0] is None  # the prompt leads
    assert token_logprobs[1:] == pytest.approx(text_full.choices[0].logprobs.token_logprobs[1:], abs=1e-4)
