"""Bounded inputs at the HTTP ingress: the body's size (413 before it is read or parsed), a prompt's characters
(400 before it is tokenized), API keys on every route but /health (401 before the body is read), and strict
request types (400 naming the field), over an in-process LoRAServer."""

from __future__ import annotations

import json

import httpx
import pytest

from cluster.api import build_api
from cluster.server_config import ServerConfig
from tests.cluster.api_cases import open_stack
from tests.cluster.api_cases import _client as openai_client

KEY = "sk-limits"
BASE = "http://127.0.0.1"
MODEL = "lorafleet-demo"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    yield from open_stack(tmp_path_factory)


@pytest.fixture
def calls(stack, monkeypatch):
    """What reached the work: the tokenizer's encodes and the backend's generate calls, recorded."""
    server = stack[2]
    seen = {"encode": 0, "generate": 0}
    tok, encode, generate = server.tokenizer, server.tokenizer.encode, server.generate

    def counted_encode(*args, **kwargs):
        seen["encode"] += 1
        return encode(*args, **kwargs)

    def counted_generate(*args, **kwargs):
        seen["generate"] += 1
        return generate(*args, **kwargs)

    monkeypatch.setattr(tok, "encode", counted_encode)
    monkeypatch.setattr(server, "generate", counted_generate)
    return seen


class BodyReads:
    """The app, with the bytes it reads of each request body counted."""

    def __init__(self, app) -> None:
        self.app, self.read = app, 0

    async def __call__(self, scope, receive, send):
        async def counted():
            message = await receive()
            self.read += len(message.get("body", b""))
            return message

        await self.app(scope, counted, send)


def _app(stack, **kw):
    return BodyReads(build_api(stack[2], **kw))


def _post(stack, app, path, headers=None, **kw) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=BASE) as http:
            return await http.post(path, headers=headers, **kw)

    return stack[0].run_until_complete(go())


def _get(stack, app, path, headers=None) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=BASE) as http:
            return await http.get(path, headers=headers)

    return stack[0].run_until_complete(go())


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["object"] == "error" and body["error"]["code"] == status
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def _pieces(total: int, piece: bytes, pulled: list[int]):
    """An async body of total bytes in pieces (sent chunked: no Content-Length); pulled[0] counts those taken."""
    async def gen():
        sent = 0
        while sent < total:
            pulled[0] += 1
            sent += len(piece)
            yield piece

    return gen()


ROUTES = {"/v1/completions": {"model": MODEL, "prompt": "x"},
          "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
          "/v1/responses": {"model": MODEL, "input": "x"},
          "/tokenize": {"prompt": "x"},
          "/detokenize": {"tokens": [1]}}


def _padded(body: dict, size: int) -> bytes:
    """body's JSON, padded with an ignored field to size bytes: a valid request but for its size."""
    raw = json.dumps({**body, "pad": ""})
    return json.dumps({**body, "pad": "p" * (size - len(raw))}).encode()


# ---- the body's size ----------------------------------------------------------------------------------------


def test_body_over_the_limit_is_413_unread_on_every_route(stack, calls):
    app = _app(stack, max_request_body_bytes=64 << 10)
    for path, body in ROUTES.items():
        r = _post(stack, app, path, content=_padded(body, 100 << 10), headers={"content-type": "application/json"})
        err = _error(r, 413)
        assert err["type"] == "invalid_request_error" and "max_request_body_bytes" in err["message"], path
    assert app.read == 0  # refused from Content-Length: not a byte read, so nothing parsed
    assert calls == {"encode": 0, "generate": 0}


def test_chunked_body_is_counted_as_it_is_read(stack, calls):
    app = _app(stack, max_request_body_bytes=64 << 10)
    pulled = [0]
    r = _post(stack, app, "/tokenize", content=_pieces(4 << 20, b" " * (16 << 10), pulled),
              headers={"content-type": "application/json"})
    _error(r, 413)
    assert "content-length" not in r.request.headers
    assert pulled[0] <= 6 and app.read <= (64 + 16) << 10  # reading stopped at the limit, not at 4 MiB
    assert calls == {"encode": 0, "generate": 0}


def test_body_under_the_limit_is_served(stack):
    app = _app(stack, max_request_body_bytes=64 << 10)
    r = _post(stack, app, "/tokenize", content=_padded(ROUTES["/tokenize"], 60 << 10),
              headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    r = _post(stack, app, "/tokenize", content=_pieces(60 << 10, b" " * (16 << 10), [0]))  # chunked, whitespace
    assert r.status_code == 400  # read whole and parsed: whitespace is no JSON body (not a 413)


# ---- a prompt's characters ----------------------------------------------------------------------------------


@pytest.mark.parametrize("path, body, field", [
    ("/v1/completions", {"model": MODEL, "prompt": "a" * 1001}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ["a" * 600, "b" * 600]}, "prompt"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "system", "content": "a" * 600},
                                                          {"role": "user", "content": [{"type": "text",
                                                                                        "text": "b" * 600}]}]},
     "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "tools": [{"type": "function", "function": {"name": "f", "description": "d" * 1001}}]},
     "messages"),
    ("/tokenize", {"prompt": "a" * 1001}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "a" * 1001}]}, "messages"),
    ("/v1/responses", {"model": MODEL, "input": "a" * 600, "instructions": "b" * 600}, "input"),
])
def test_long_prompt_is_refused_before_tokenizing(stack, calls, path, body, field):
    app = _app(stack, max_prompt_chars=1000)
    err = _error(_post(stack, app, path, json=body), 400)
    assert err["param"] == field and "max_prompt_chars" in err["message"] and "1000" in err["message"]
    assert calls == {"encode": 0, "generate": 0}


def test_prompt_at_the_limit_is_tokenized(stack, calls):
    app = _app(stack, max_prompt_chars=1000)
    r = _post(stack, app, "/tokenize", json={"prompt": "a" * 1000})
    assert r.status_code == 200 and r.json()["count"] > 0
    assert calls["encode"] == 1


# ---- API keys -----------------------------------------------------------------------------------------------


def test_keys_guard_every_route_but_health(stack, calls):
    app = _app(stack, api_keys=[KEY])
    for path, body in ROUTES.items():
        err = _error(_post(stack, app, path, json=body), 401)
        assert err["type"] == "authentication_error", path
    for path in ("/v1/models", "/docs", "/openapi.json"):
        _error(_get(stack, app, path), 401)
    assert calls == {"encode": 0, "generate": 0}
    assert _get(stack, app, "/health").json() == {"status": "ok"}
    assert _get(stack, app, "/metrics").status_code == 200  # metrics_public, the default
    auth = {"authorization": f"Bearer {KEY}"}
    r = _post(stack, app, "/tokenize", json={"prompt": "hello"}, headers=auth)
    assert r.status_code == 200 and r.json()["count"] > 0
    assert _post(stack, app, "/tokenize", json={"prompt": "hello"},
                 headers={"authorization": "Bearer sk-wrong"}).status_code == 401

    private = _app(stack, api_keys=[KEY], metrics_public=False)
    _error(_get(stack, private, "/metrics"), 401)
    assert _get(stack, private, "/metrics", headers=auth).status_code == 200
    assert _get(stack, private, "/health").status_code == 200


def test_unauthenticated_big_body_is_401_unread(stack, calls):
    app = _app(stack, api_keys=[KEY], max_request_body_bytes=1 << 20)
    big = b" " * (10 << 20)
    for path in ("/tokenize", "/v1/completions"):
        _error(_post(stack, app, path, content=big, headers={"content-type": "application/json"}), 401)
        pulled = [0]
        _error(_post(stack, app, path, content=_pieces(10 << 20, b" " * (1 << 20), pulled)), 401)  # chunked
        assert pulled[0] <= 1
    assert app.read == 0
    assert calls == {"encode": 0, "generate": 0}


# ---- strict types -------------------------------------------------------------------------------------------

_COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
_RESPONSE = {"model": MODEL, "input": "hi", "max_output_tokens": 1}


@pytest.mark.parametrize("path, raw, field", [
    ("/v1/completions", {**_COMPLETION, "max_tokens": True}, "max_tokens"),
    ("/v1/completions", {**_COMPLETION, "max_tokens": 2**70}, "max_tokens"),
    ("/v1/completions", {**_COMPLETION, "max_tokens": 4.0}, "max_tokens"),
    ("/v1/completions", '{"model": "lorafleet-demo", "prompt": "hi", "temperature": Infinity}', "temperature"),
    ("/v1/completions", '{"model": "lorafleet-demo", "prompt": "hi", "temperature": 1e999}', "temperature"),
    ("/v1/completions", '{"model": "lorafleet-demo", "prompt": "hi", "top_p": NaN}', "top_p"),
    ("/v1/completions", {**_COMPLETION, "temperature": True}, "temperature"),
    ("/v1/completions", {**_COMPLETION, "temperature": "0.5"}, "temperature"),
    ("/v1/completions", {**_COMPLETION, "n": True}, "n"),
    ("/v1/completions", {**_COMPLETION, "seed": 2**63}, "seed"),
    ("/v1/completions", {**_COMPLETION, "top_k": 2**40}, "top_k"),
    ("/v1/completions", {**_COMPLETION, "logprobs": True}, "logprobs"),
    ("/v1/completions", {**_COMPLETION, "min_tokens": -(2**40)}, "min_tokens"),
    ("/v1/completions", {**_COMPLETION, "priority": 2**40}, "priority"),
    ("/v1/completions", {**_COMPLETION, "truncate_prompt_tokens": 2**40}, "truncate_prompt_tokens"),
    ("/v1/completions", {**_COMPLETION, "stop_token_ids": [True]}, "stop_token_ids"),
    ("/v1/completions", {**_COMPLETION, "allowed_token_ids": [2**40]}, "allowed_token_ids"),
    ("/v1/completions", '{"model": "lorafleet-demo", "prompt": "hi", "logit_bias": {"5": NaN}}', "logit_bias"),
    ("/v1/completions", {**_COMPLETION, "presence_penalty": False}, "presence_penalty"),
    ("/v1/completions", {**_COMPLETION, "echo": 1}, "echo"),
    ("/v1/completions", {**_COMPLETION, "prompt": [True, False]}, "prompt"),
    ("/v1/chat/completions", {**_CHAT, "messages": [{"role": "user", "content": None}]}, "messages.0"),
    ("/v1/chat/completions", {**_CHAT, "messages": [{"role": "user"}]}, "messages.0"),
    ("/v1/chat/completions", {**_CHAT, "messages": [{"role": "assistant", "content": None}]}, "messages.0"),
    ("/v1/chat/completions", {**_CHAT, "max_completion_tokens": 2**70}, "max_completion_tokens"),
    ("/v1/chat/completions", {**_CHAT, "top_logprobs": True}, "top_logprobs"),
    ("/v1/chat/completions", {**_CHAT, "frequency_penalty": float("inf")}, "frequency_penalty"),
    ("/v1/responses", {**_RESPONSE, "max_output_tokens": True}, "max_output_tokens"),
    ("/v1/responses", '{"model": "lorafleet-demo", "input": "hi", "temperature": 1e999}', "temperature"),
    ("/v1/responses", {**_RESPONSE, "seed": 2**70}, "seed"),  # a vLLM extra, passed through to the chat request
    ("/v1/responses", {**_RESPONSE, "input": [{"type": "message", "role": "user", "content": None}]},
     "input[0].content"),
    ("/tokenize", {"prompt": "hi", "add_special_tokens": 1}, "add_special_tokens"),
    ("/tokenize", {"messages": [{"role": "user", "content": None}]}, "messages.0"),
    ("/detokenize", {"tokens": [True]}, "tokens"),
    ("/detokenize", {"tokens": [2**70]}, "tokens"),
])
def test_strict_types(stack, calls, path, raw, field):
    app = _app(stack)
    content = raw if isinstance(raw, str) else json.dumps(raw)  # json.dumps writes inf as Infinity, as a client may
    err = _error(_post(stack, app, path, content=content, headers={"content-type": "application/json"}), 400)
    assert err["type"] == "invalid_request_error"
    assert err["param"] is not None and (err["param"] == field or err["param"].startswith(field)), err
    assert field.split(".")[0].split("[")[0] in err["message"], err
    assert calls == {"encode": 0, "generate": 0}


def test_official_client_requests_still_pass(stack):
    """What the openai client sends (ints for floats, logprobs as a bool in chat, an assistant's tool_calls with
    content null) is served as before."""
    app = build_api(stack[2], max_request_body_bytes=1 << 20, max_prompt_chars=10_000)
    messages = [{"role": "user", "content": "What is 2+2?"},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "4"}]

    async def go(c):
        done = await c.completions.create(model=MODEL, prompt=["The quick", "brown fox"], max_tokens=2,
                                          temperature=0, top_p=1, seed=2**63 - 1, n=1, logprobs=1,
                                          frequency_penalty=0, presence_penalty=0, logit_bias={"5": 1},
                                          extra_body={"top_k": 5, "min_tokens": 1, "repetition_penalty": 1})
        chat = await c.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=2,
                                               temperature=0, top_p=1, logprobs=True, top_logprobs=2, seed=0)
        resp = await c.responses.create(model=MODEL, input="hi", max_output_tokens=2, temperature=0, top_p=1)
        return done, chat, resp

    done, chat, resp = stack[0].run_until_complete(go(openai_client(app)))
    assert len(done.choices) == 2 and done.usage.completion_tokens == 4
    assert chat.choices[0].logprobs.content and chat.usage.completion_tokens == 2
    assert resp.status in ("completed", "incomplete")


def test_server_config_limits():
    config = ServerConfig()
    limits = config.api_limits()
    assert not limits.pop("quotas").enabled  # none by default (tests/cluster/test_api_quotas.py)
    assert limits == {"max_request_body_bytes": 8 << 20, "max_prompt_chars": 1_000_000, "metrics_public": True}
    assert ServerConfig(max_prompt_chars=5, metrics_public=False).api_limits()["max_prompt_chars"] == 5
    for bad in (dict(max_request_body_bytes=0), dict(max_prompt_chars=True), dict(max_prompt_chars=1.5),
                dict(metrics_public="no")):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ServerConfig(**bad)
