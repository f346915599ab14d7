"""The OpenAI-compatible API over an in-process LoRAServer, driven by the official openai client."""

from __future__ import annotations

import asyncio
import contextlib
import shutil

import httpx
import openai
import pytest

from cluster.api import build_api
from cluster.catalog import LocalCatalog
from cluster.server import LoRAServer, ServerConfig
from cluster.sources import SourceSettings

ENGINE = dict(dtype="float32", device="cpu", max_loras=2, max_lora_rank=32, num_kv_blocks=128)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """(loop, app, server, adapters root): one server for the module, on its own event loop."""
    cache = tmp_path_factory.mktemp("cache")
    root = tmp_path_factory.mktemp("adapters")
    mp = pytest.MonkeyPatch()
    mp.setenv("LORAFLEET_CACHE", str(cache))
    loop = asyncio.new_event_loop()
    from replicas.demo_checkpoint import ensure_demo_checkpoint

    demo = ensure_demo_checkpoint()
    settings = SourceSettings(allowed_local_roots=[str(root), str(cache)])
    server = LoRAServer(ServerConfig(model="demo", engine=ENGINE, default_max_tokens=8), LocalCatalog(settings))
    loop.run_until_complete(server.start())
    shutil.copytree(demo.adapters["demo-sql"], root / "sql-copy")
    app = build_api(server, api_keys=None)
    yield loop, app, server, root
    loop.run_until_complete(server.shutdown())
    loop.close()
    mp.undo()


def _client(app, **kw) -> openai.AsyncOpenAI:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1")
    return openai.AsyncOpenAI(base_url="http://127.0.0.1/v1", api_key=kw.get("api_key", "none"), http_client=http,
                              max_retries=0)


def run(stack, coro_fn):
    loop, app = stack[0], stack[1]
    return loop.run_until_complete(coro_fn(_client(app)))


def test_models_lists_base_and_adapters(stack):
    models = run(stack, lambda c: c.models.list())
    ids = {m.id: m for m in models.data}
    assert "lorafleet-demo" in ids
    assert {"demo-sql", "demo-chat", "demo-summarize", "demo-translate"} <= set(ids)
    assert ids["demo-sql"].model_extra["parent"] == "lorafleet-demo"


def test_completion_base_and_adapter_and_streaming(stack):
    async def go(c):
        base = await c.completions.create(model="lorafleet-demo", prompt="The quick brown fox", max_tokens=8,
                                          temperature=0)
        sql = await c.completions.create(model="demo-sql", prompt="The quick brown fox", max_tokens=8,
                                         temperature=0)
        chunks = []
        async for chunk in await c.completions.create(model="demo-sql", prompt="The quick brown fox", max_tokens=8,
                                                      temperature=0, stream=True,
                                                      stream_options={"include_usage": True}):
            chunks.append(chunk)
        return base, sql, chunks

    base, sql, chunks = run(stack, go)
    assert base.usage.completion_tokens == 8 and base.choices[0].finish_reason == "length"
    assert base.choices[0].text != sql.choices[0].text  # the adapter changes the output
    streamed = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert streamed == sql.choices[0].text
    assert chunks[-1].usage.completion_tokens == 8


def test_chat_and_chat_streaming_agree(stack):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello"}]

    async def go(c):
        full = await c.chat.completions.create(model="demo-chat", messages=messages, max_tokens=6, temperature=0)
        parts = [ch.choices[0].delta.content or "" async for ch in await c.chat.completions.create(
            model="demo-chat", messages=messages, max_tokens=6, temperature=0, stream=True)]
        return full, parts

    full, parts = run(stack, go)
    assert full.choices[0].message.role == "assistant"
    assert "".join(parts) == full.choices[0].message.content
    assert full.usage.completion_tokens == 6


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

def test_load_adapter_at_run_time_then_use_it(stack):
    root = stack[3]

    async def go(c):
        http = c._client
        r = await http.post("http://127.0.0.1/v1/load_lora_adapter",
                            json={"lora_name": "sql2", "lora_path": str(root / "sql-copy")})
        assert r.status_code == 200, r.text
        out = await c.completions.create(model="sql2", prompt="SELECT", max_tokens=4, temperature=0)
        ref = await c.completions.create(model="demo-sql", prompt="SELECT", max_tokens=4, temperature=0)
        r = await http.post("http://127.0.0.1/v1/unload_lora_adapter", json={"lora_name": "sql2"})
        assert r.status_code == 200
        return out, ref

    out, ref = run(stack, go)
    assert out.choices[0].text == ref.choices[0].text  # same weights, same greedy text


@pytest.mark.parametrize("body,status,needle", [
    ({"lora_name": "x", "lora_path": "/etc"}, 400, "allowed"),
    ({"lora_name": "x", "lora_path": "ROOT/../etc"}, 400, ".."),
    ({"lora_name": "x", "lora_path": "ROOT/missing"}, 404, "does not exist"),
    ({"lora_name": "", "lora_path": "ROOT/sql-copy"}, 400, "lora_name"),
])
def test_load_adapter_bad_input(stack, body, status, needle):
    body = {k: v.replace("ROOT", str(stack[3])) for k, v in body.items()}

    async def go(c):
        return await c._client.post("http://127.0.0.1/v1/load_lora_adapter", json=body)

    r = run(stack, go)
    assert r.status_code == status, r.text
    assert needle in r.text


def test_errors_map_to_status_codes(stack):
    async def go(c):
        with pytest.raises(openai.NotFoundError):
            await c.completions.create(model="no-such-adapter", prompt="hi", max_tokens=2)
        with pytest.raises(openai.BadRequestError, match="temperature"):
            await c.completions.create(model="lorafleet-demo", prompt="hi", max_tokens=2, temperature=-1)
        with pytest.raises(openai.BadRequestError, match="prompt"):
            await c.completions.create(model="lorafleet-demo", prompt="", max_tokens=2)
        r = await c._client.post("http://127.0.0.1/v1/completions", content=b"{not json",
                                 headers={"content-type": "application/json"})
        assert r.status_code == 400
        r = await c._client.post("http://127.0.0.1/v1/completions", json={"model": "lorafleet-demo"})
        assert r.status_code == 400 and "prompt" in r.text
        # and the server still serves
        ok = await c.completions.create(model="lorafleet-demo", prompt="hi", max_tokens=2)
        return ok

    assert run(stack, go).usage.completion_tokens == 2


def test_health_metrics_and_api_keys(stack):
    loop, _, server, _ = stack
    secured = build_api(server, api_keys=["sekret"])

    async def go():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=secured), base_url="http://127.0.0.1")
        assert (await http.get("/health")).status_code == 200
        assert (await http.get("/v1/models")).status_code == 401
        assert (await http.get("/v1/models", headers={"Authorization": "Bearer wrong"})).status_code == 401
        assert (await http.get("/v1/models", headers={"Authorization": "Bearer sekret"})).status_code == 200
        c = openai.AsyncOpenAI(base_url="http://127.0.0.1/v1", api_key="sekret", http_client=http, max_retries=0)
        await c.completions.create(model="lorafleet-demo", prompt="hi", max_tokens=3)
        return (await http.get("/metrics")).text

    text = loop.run_until_complete(go())
    assert 'lorafleet_requests_total{route="/v1/models",status="401"} 2.0' in text
    assert "lorafleet_time_to_first_token_seconds_count" in text
    assert 'lorafleet_generated_tokens_total{model="lorafleet-demo"} 3.0' in text


def test_adapter_requests_count_where_the_adapter_was(stack):
    server = stack[2]
    before = dict(server.adapter_events)

    async def go(c):
        for _ in range(2):
            await c.completions.create(model="demo-summarize", prompt="hi", max_tokens=2)

    run(stack, go)
    delta = {k: server.adapter_events[k] - before.get(k, 0) for k in ("gpu", "host", "object_store")}
    # first request: brought in from the catalog; second: found in a GPU slot
    assert delta == {"gpu": 1, "host": 0, "object_store": 1}


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


def test_full_replica_queues_answer_429():
    """Serve's back-pressure (every replica's max_queued_requests reached) becomes HTTP 429."""
    from ray.serve.exceptions import BackPressureError

    from cluster.deployments import _ReplicaBackend

    class FullReplicas:
        def options(self, **_):
            return self

        @property
        def generate(self):
            return self

        def remote(self, _request):
            async def refuse():
                raise BackPressureError(num_queued_requests=256, max_queued_requests=256)
                yield  # an async generator, like a streaming handle response

            return refuse()

    backend = _ReplicaBackend(FullReplicas(), catalog=None, model_name="base", default_max_tokens=4)
    app = build_api(backend)

    async def go():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1")
        return await http.post("/v1/completions", json={"model": "base", "prompt": "hi"})

    response = asyncio.run(go())
    assert response.status_code == 429 and "capacity" in response.text


def test_adapter_name_repointed_to_new_weights(stack):
    """Loading an existing name from another lora_path serves the new weights from then on."""
    root = stack[3]
    demo_chat = stack[2]._demo_adapters["demo-chat"]
    shutil.copytree(demo_chat, root / "chat-copy", dirs_exist_ok=True)

    async def go(c):
        http = c._client
        for path in ("sql-copy", "chat-copy"):
            r = await http.post("http://127.0.0.1/v1/load_lora_adapter",
                                json={"lora_name": "moving", "lora_path": str(root / path)})
            assert r.status_code == 200, r.text
        got = await c.completions.create(model="moving", prompt="SELECT", max_tokens=4, temperature=0)
        want = await c.completions.create(model="demo-chat", prompt="SELECT", max_tokens=4, temperature=0)
        return got, want

    got, want = run(stack, go)
    assert got.choices[0].text == want.choices[0].text


@contextlib.contextmanager
def _demo_stack(**engine):
    """A started server on the demo checkpoint with these engine settings, and its API: (server, stack)."""
    from replicas.demo_checkpoint import ensure_demo_checkpoint

    settings = SourceSettings(allowed_local_roots=[str(ensure_demo_checkpoint().adapters["demo-sql"].parent)])
    server = LoRAServer(ServerConfig(model="demo", engine=ENGINE | engine, default_max_tokens=8), LocalCatalog(settings))
    loop = asyncio.new_event_loop()
    loop.run_until_complete(server.start())
    try:
        yield server, (loop, build_api(server, api_keys=None))
    finally:
        loop.run_until_complete(server.shutdown())
        loop.close()


def test_routing_stats_name_the_adapter_running_merged():
    """A replica whose steps all use one adapter runs it merged (on CUDA by default; here asked for): its
    routing stats say which, and how many merges so far; the next base request unmerges it."""
    with _demo_stack(lora_merge_steps=2) as (server, stack):
        assert server.routing_stats()["merged_adapter"] is None and server.routing_stats()["lora_merges"] == 0
        run(stack, lambda c: c.completions.create(model="demo-sql", prompt="hi", max_tokens=6))
        stats = server.routing_stats()
        assert (stats["merged_adapter"], stats["lora_merges"]) == ("demo-sql", 1)
        assert server.merge_state() == ("demo-sql", 1)
        run(stack, lambda c: c.completions.create(model="lorafleet-demo", prompt="hi", max_tokens=2))
        assert (server.routing_stats()["merged_adapter"], server.merge_state()[1]) == (None, 1)


def test_routing_stats_count_load_workers_replaced_after_one_died():
    """A replica whose adapter load worker dies keeps loading adapters in fresh workers, and says so."""
    import multiprocessing
    import os
    import signal

    from replicas.spawn import WORKER_PREFIX

    def workers():
        return {p.pid: p for p in multiprocessing.active_children() if p.name.startswith(WORKER_PREFIX)}

    before = workers()  # any left by earlier tests' engines
    with _demo_stack(lora_load_processes=1) as (server, stack):
        assert server.routing_stats()["load_worker_restarts"] == 0
        (worker,) = [p for pid, p in workers().items() if pid not in before]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        out = run(stack, lambda c: c.completions.create(model="demo-sql", prompt="SELECT", max_tokens=4))
        assert out.usage.completion_tokens == 4
        assert server.routing_stats()["load_worker_restarts"] == server.load_worker_restarts() == 1
