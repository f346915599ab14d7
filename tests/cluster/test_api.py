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
from cluster.server import LoRAServer
from cluster.server_config import ServerConfig
from cluster.sources import SourceSettings
from replicas.chat_template import render_chat
from replicas.errors import InvalidRequestError
from tests.cluster.api_cases import ENGINE, run, stack  # noqa: F401  (stack: a fixture)


def test_models_lists_base_and_adapters(stack):
    models = run(stack, lambda c: c.models.list())
    ids = {m.id: m for m in models.data}
    assert "lorafleet-demo" in ids
    assert {"demo-sql", "demo-chat", "demo-summarize", "demo-translate"} <= set(ids)
    assert ids["demo-sql"].model_extra["parent"] == "lorafleet-demo"
    lengths = {m.model_extra["max_model_len"] for m in models.data}
    assert lengths == {stack[2].engine.engine.max_model_len} and lengths.pop() > 0


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
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
        with pytest.raises(openai.BadRequestError, match="'image_url' content part is not supported"):
            await c.chat.completions.create(model="lorafleet-demo", max_tokens=2, messages=[
                {"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}])
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


def test_continue_final_message_carries_the_answer_on(stack):
    """vLLM's continue_final_message: the prompt stops after the last (assistant) message's content, without the
    template's end of turn (the demo template's ' </s>'), so the model continues that message."""
    messages = [{"role": "user", "content": "Write a query"}, {"role": "assistant", "content": "SELECT name"}]
    kw = dict(model="demo-sql", messages=messages, max_tokens=3, temperature=0, extra_body={})

    async def go(c):
        closed = await c.chat.completions.create(**dict(kw, extra_body={"add_generation_prompt": False}))
        carried = await c.chat.completions.create(**dict(kw, extra_body={"add_generation_prompt": False,
                                                                           "continue_final_message": True}))
        with pytest.raises(openai.BadRequestError) as both:
            await c.chat.completions.create(**dict(kw, extra_body={"continue_final_message": True}))
        return closed, carried, both.value.body

    closed, carried, both = run(stack, go)
    assert carried.usage.prompt_tokens < closed.usage.prompt_tokens
    assert "add_generation_prompt" in both["message"]


def test_render_chat_cuts_after_the_last_content():
    template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</turn>{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, the answer is "}]
    assert render_chat(messages, template, add_generation_prompt=False, continue_final_message=True) == \
        "<user>hi</turn><assistant>Sure, the answer is"
    with pytest.raises(InvalidRequestError) as err:  # a template that rewrites the content leaves no place to cut
        render_chat(messages, template.replace("m['content']", "m['content'] | upper"), add_generation_prompt=False,
                    continue_final_message=True)
    assert err.value.fields == ["continue_final_message"]


def _lost_after(outputs_per_run: list[list[tuple[str, list[int], bool]]]):
    """A replicas' generate that, on its i-th call, yields the i-th run's cumulative outputs (text, token ids,
    finished) and then, unless the last output finished, loses its replica (ActorDiedError)."""
    from ray.exceptions import ActorDiedError

    from replicas.outputs import CompletionOutput, RequestOutput

    runs = iter(outputs_per_run)

    async def call(_request):
        for text, ids, finished in next(runs):
            yield RequestOutput("r", "hi", [1], [CompletionOutput(0, text, ids, finish_reason="length" if finished
                                                                  else None)], finished=finished)
            if finished:
                return
        raise ActorDiedError()

    return call


def test_a_replica_lost_before_the_caller_saw_anything_runs_the_request_again():
    """A first token whose text the detokenizer holds back (empty text) is not output the caller saw: the replica
    lost then, the request runs again elsewhere and the caller sees only the second run. Lost after text went
    out, it is a ReplicaUnavailableError (503), with nothing run again."""
    from cluster.deployments import _ReplicaBackend
    from cluster.errors import ReplicaUnavailableError
    from cluster.server import GenerateRequest

    def backend(runs):
        b = _ReplicaBackend(None, catalog=None, model_name="base", default_max_tokens=4)
        b.call_generate = _lost_after(runs)
        return b

    async def collect(b, sampling=None, **fields):
        return [(o.outputs[0].text, o.outputs[0].token_ids) async for o in
                b.generate(GenerateRequest(model="base", sampling=sampling or {}, prompt="hi", **fields))]

    b = backend([[("", [7], False)], [("", [7], False), ("ab", [7, 8], False), ("abc", [7, 8, 9], True)]])
    assert asyncio.run(collect(b)) == [("ab", [7, 8]), ("abc", [7, 8, 9])]
    assert b.replica_loss_retries == 1

    b = backend([[("", [7], False), ("ab", [7, 8], False)], [("abc", [7, 8, 9], True)]])
    with pytest.raises(ReplicaUnavailableError, match="after it had started answering"):
        asyncio.run(collect(b))
    assert b.replica_loss_retries == 0

    # Asked for logprobs, a token is output the caller sees (its logprob goes out with empty text)
    b = backend([[("", [7], False)], [("abc", [7, 8, 9], True)]])
    with pytest.raises(ReplicaUnavailableError):
        asyncio.run(collect(b, {"logprobs": 1}))

    # A Python handle or gRPC caller sees token ids: each output streams as it comes, and one lost after a token
    # went out is not run again
    b = backend([[("", [7], False), ("", [7, 8], False)], [("abc", [7, 8, 9], True)]])
    seen = []

    async def collect_handle():
        async for o in b.generate(GenerateRequest(model="base", sampling={}, prompt="hi", shows_token_ids=True)):
            seen.append(o.outputs[0].token_ids)
    with pytest.raises(ReplicaUnavailableError, match="after it had started answering"):
        asyncio.run(collect_handle())
    assert seen == [[7], [7, 8]] and b.replica_loss_retries == 0
