"""The gRPC ingress (cluster/proto/lorafleet.proto) on real Ray Serve, called with a real grpc client through
Serve's gRPC proxy on a free loopback port; plus the proto <-> request conversion and status mapping alone."""

from __future__ import annotations

import time

import grpc
import httpx
import pytest
import ray
from ray import serve

from cluster.app import GRPC_SERVICER_FUNCTIONS, build_app
from cluster.errors import AdapterNotFoundError, AuthenticationError, SourceUnavailableError
from cluster.grpc_ingress import check_api_key, grpc_status, request_from_proto
from cluster.proto import lorafleet_pb2 as pb
from cluster.proto import lorafleet_pb2_grpc as pb_grpc
from replicas.errors import EngineDeadError, InvalidRequestError, LoadWorkerLostError
from tests.cluster.conftest import free_ports

APP = "lorafleet-grpc"
META = (("application", APP),)
PROMPT = "The quick brown fox"
START_TIMEOUT_S = 180


class Cluster:
    def __init__(self, http: str, stub: pb_grpc.LoRAFleetStub) -> None:
        self.http, self.stub = http, stub


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    registry = tmp_path_factory.mktemp("registry")
    http_port, grpc_port = free_ports(2)
    env = {"LORAFLEET_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": env}, namespace="lorafleet-grpc-test")
    mp = pytest.MonkeyPatch()
    for k, v in env.items():
        mp.setenv(k, v)
    channel = None
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": http_port},
                    grpc_options={"port": grpc_port, "grpc_servicer_functions": GRPC_SERVICER_FUNCTIONS})
        args = {
            "server": {"model": "demo", "default_max_tokens": 8,
                       "engine": {"dtype": "float32", "max_loras": 2, "max_lora_rank": 32, "num_kv_blocks": 128}},
            "tier": {"capacity_bytes": 1 << 28, "registry_dir": str(registry)},
            "replica": {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0.25}, "routing_stats_period_s": 0.5},
            "ingress": {"ray_actor_options": {"num_cpus": 0.1}},
        }
        serve.run(build_app(args), name=APP, route_prefix="/", blocking=False)
        channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
        stub = pb_grpc.LoRAFleetStub(channel)
        deadline, last = time.monotonic() + START_TIMEOUT_S, None
        while True:  # up once ListAdapters answers through the proxy (the app deployed, the replica started)
            try:
                if any(a.name == "demo-sql" for a in stub.ListAdapters(pb.ListAdaptersRequest(), metadata=META,
                                                                         timeout=10).adapters):
                    break
            except grpc.RpcError as exc:
                last = exc
            if time.monotonic() > deadline:
                raise RuntimeError(f"the gRPC ingress did not come up in {START_TIMEOUT_S} s: {last}")
            time.sleep(0.5)
        yield Cluster(f"http://127.0.0.1:{http_port}", stub)
    finally:
        if channel is not None:
            channel.close()
        serve.shutdown()
        ray.shutdown()
        mp.undo()


def _stream(stub, **fields) -> list[pb.GenerateResponse]:
    return list(stub.Generate(pb.GenerateRequest(**fields), metadata=META, timeout=120))


def test_list_adapters(cluster):
    out = cluster.stub.ListAdapters(pb.ListAdaptersRequest(), metadata=META, timeout=30)
    assert out.base_model == "lorafleet-demo"
    assert out.adapters[0].name == "lorafleet-demo" and out.adapters[0].parent == ""
    by_name = {a.name: a for a in out.adapters}
    assert {"demo-sql", "demo-chat"} <= set(by_name)
    assert by_name["demo-sql"].parent == "lorafleet-demo" and by_name["demo-sql"].source


@pytest.mark.parametrize("adapter", ["", "demo-sql"])
def test_generate_streams_the_same_text_as_http_and_the_handle(cluster, adapter):
    chunks = _stream(cluster.stub, prompt=PROMPT, adapter=adapter, max_tokens=6, temperature=0.0)
    assert len(chunks) >= 2  # streamed, not one final message
    text = "".join(c.text for c in chunks)
    token_ids = [t for c in chunks for t in c.token_ids]
    assert len(token_ids) == 6 and chunks[-1].completion_tokens == 6 and chunks[-1].prompt_tokens > 0
    assert chunks[-1].finish_reason == "length" and all(c.finish_reason == "" for c in chunks[:-1])

    handle = serve.get_app_handle(APP)
    want = handle.generate.remote(prompt=PROMPT, adapter=adapter or None, max_tokens=6,
                                  temperature=0).result(timeout_s=120)
    assert text == want["outputs"][0]["text"] and token_ids == want["outputs"][0]["token_ids"]
    r = httpx.post(f"{cluster.http}/v1/completions", timeout=120,
                   json={"model": adapter or "lorafleet-demo", "prompt": PROMPT, "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == text


def test_generate_chat_and_prompt_token_ids(cluster):
    chat = _stream(cluster.stub, messages=[pb.ChatMessage(role="user", content="hi")], adapter="demo-chat",
                   max_tokens=4, temperature=0.0)
    assert sum(len(c.token_ids) for c in chat) == 4 and chat[-1].finish_reason == "length"
    want = serve.get_app_handle(APP).generate.remote(prompt=PROMPT, max_tokens=3, temperature=0).result(timeout_s=120)
    by_ids = _stream(cluster.stub, prompt_token_ids=want["prompt_token_ids"], max_tokens=3, temperature=0.0)
    assert [t for c in by_ids for t in c.token_ids] == want["outputs"][0]["token_ids"]


def test_generate_n_completions_each_under_its_index(cluster):
    """n = 2, seeded: each index's responses add up to what n = 1 seeded seed + index streams; one last response
    (with its finish_reason) per index."""
    kw = dict(prompt=PROMPT, adapter="demo-sql", max_tokens=5, temperature=1.0)
    both = _stream(cluster.stub, n=2, seed=21, **kw)
    for index in (0, 1):
        mine = [c for c in both if c.index == index]
        alone = _stream(cluster.stub, seed=21 + index, **kw)
        assert [t for c in mine for t in c.token_ids] == [t for c in alone for t in c.token_ids]
        assert "".join(c.text for c in mine) == "".join(c.text for c in alone)
        assert [c.finish_reason for c in mine if c.finish_reason] == ["length"] and mine[-1].completion_tokens == 5
    assert {c.index for c in both} == {0, 1}


def test_generate_with_logit_bias_min_tokens_and_a_grammar(cluster):
    forced = _stream(cluster.stub, prompt=PROMPT, max_tokens=3, temperature=0.0, logit_bias={17: 100.0}, min_tokens=3)
    assert [t for c in forced for t in c.token_ids] == [17, 17, 17]
    allowed = _stream(cluster.stub, prompt=PROMPT, max_tokens=3, temperature=1.0, allowed_token_ids=[21],
                      truncate_prompt_tokens=2)
    assert [t for c in allowed for t in c.token_ids] == [21, 21, 21] and allowed[0].prompt_tokens == 2
    picked = _stream(cluster.stub, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=2,
                     structured_outputs=pb.StructuredOutputs(choice=["left", "right"]))
    assert "".join(c.text for c in picked) in ("left", "right") and picked[-1].finish_reason == "stop"
    with pytest.raises(grpc.RpcError) as err:
        _stream(cluster.stub, prompt=PROMPT, max_tokens=3, structured_outputs=pb.StructuredOutputs(regex="[a-"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "structured_outputs" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        _stream(cluster.stub, prompt=PROMPT, max_tokens=3, min_tokens=4)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "min_tokens" in err.value.details()


def test_generate_with_logprobs_and_prompt_logprobs(cluster):
    """A logprob per generated token (its own among its step's top k, most likely first), and the prompt's in
    each completion's first response (the first prompt token's unset)."""
    chunks = _stream(cluster.stub, prompt=PROMPT, max_tokens=4, temperature=0.0, logprobs=2, prompt_logprobs=1, n=2)
    for index in (0, 1):
        mine = [c for c in chunks if c.index == index]
        assert [len(c.logprobs) for c in mine] == [len(c.token_ids) for c in mine]
        for c in mine:
            for lp, token in zip(c.logprobs, c.token_ids):
                assert lp.token_id == token and lp.logprob <= 0 and len(lp.top) in (2, 3)
                assert [t.logprob for t in lp.top] == sorted((t.logprob for t in lp.top), reverse=True)
                assert lp.top[0].token_id == token  # greedy: the most likely
        prompt = mine[0].prompt_logprobs
        assert len(prompt) == mine[0].prompt_tokens and all(not c.prompt_logprobs for c in mine[1:])
        assert not prompt[0].HasField("logprob") and all(p.HasField("logprob") for p in prompt[1:])


def test_errors_become_status_codes(cluster):
    with pytest.raises(grpc.RpcError) as err:
        _stream(cluster.stub, prompt="hi", adapter="no-such-adapter", max_tokens=2)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "no-such-adapter" in err.value.details()
    assert "Traceback" not in err.value.details()  # the domain error's message, not a Ray task traceback
    with pytest.raises(grpc.RpcError) as err:
        _stream(cluster.stub, prompt="hi", max_tokens=2, temperature=-3.0)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        _stream(cluster.stub, max_tokens=2)  # no prompt at all
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt" in err.value.details()
    # the service keeps serving after the failures
    assert "".join(c.text for c in _stream(cluster.stub, prompt="hi", max_tokens=2, temperature=0.0))


# ---- without Ray ---------------------------------------------------------------------------------


def test_request_from_proto():
    req = request_from_proto(pb.GenerateRequest(prompt="hi", adapter="a", temperature=0.0, stop=["\n"], seed=3),
                             "base", 16)
    assert req.model == "a" and req.prompt == "hi" and req.messages is None
    assert req.sampling == {"max_tokens": 16, "temperature": 0.0, "seed": 3, "stop": ["\n"]}  # unset stays unset
    req = request_from_proto(pb.GenerateRequest(prompt_token_ids=[1, 2], max_tokens=4, request_id="r1"), "base", 16)
    assert req.model == "base" and req.prompt == {"prompt_token_ids": [1, 2]} and req.request_id == "r1"
    assert req.sampling == {"max_tokens": 4}
    assert request_from_proto(pb.GenerateRequest(prompt="hi", n=3), "base", 16).sampling == {"max_tokens": 16, "n": 3}
    req = request_from_proto(pb.GenerateRequest(prompt="hi", min_tokens=2, logit_bias={5: -100.0, 9: 2.5}), "b", 16)
    assert req.sampling == {"max_tokens": 16, "min_tokens": 2, "logit_bias": {5: -100.0, 9: 2.5}}
    req = request_from_proto(pb.GenerateRequest(prompt="hi", logprobs=0, prompt_logprobs=2), "b", 16)
    assert req.sampling == {"max_tokens": 16, "logprobs": 0, "prompt_logprobs": 2}
    msg = pb.GenerateRequest(prompt="hi", allowed_token_ids=[4, 9], truncate_prompt_tokens=3)
    req = request_from_proto(msg, "b", 16)
    assert req.sampling == {"max_tokens": 16, "allowed_token_ids": [4, 9], "truncate_prompt_tokens": 3}
    assert request_from_proto(pb.GenerateRequest(prompt="hi", priority=-2), "b", 16).priority == -2
    assert request_from_proto(pb.GenerateRequest(prompt="hi"), "b", 16).priority == 0
    so = pb.StructuredOutputs(json='{"type": "object"}', disable_any_whitespace=True)
    req = request_from_proto(pb.GenerateRequest(prompt="hi", structured_outputs=so), "b", 16)
    assert req.sampling == {"max_tokens": 16, "structured_outputs": {"json": '{"type": "object"}',
                                                                     "disable_any_whitespace": True}}
    req = request_from_proto(pb.GenerateRequest(prompt="hi", structured_outputs=pb.StructuredOutputs(choice=["a"])),
                             "b", 16)
    assert req.sampling["structured_outputs"] == {"choice": ["a"]}
    msg = pb.GenerateRequest(prompt="hi", bad_words=["x", "y z"], skip_special_tokens=False,
                             include_stop_str_in_output=True)
    assert request_from_proto(msg, "b", 16).sampling == {"max_tokens": 16, "bad_words": ["x", "y z"],
                                                         "skip_special_tokens": False, "include_stop_str_in_output": True}
    req = request_from_proto(pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="x")]), "base", 16)
    assert req.messages == [{"role": "user", "content": "x"}] and req.prompt is None
    assert req.chat_template_kwargs is None
    chat = [pb.ChatMessage(role="user", content="x")]
    msg = pb.GenerateRequest(messages=chat, chat_template_kwargs='{"enable_thinking": false}')
    assert request_from_proto(msg, "base", 16).chat_template_kwargs == {"enable_thinking": False}
    for bad, field in [(pb.GenerateRequest(), "prompt"), (pb.GenerateRequest(prompt="a", prompt_token_ids=[1]), "prompt"),
                       (pb.GenerateRequest(prompt="a", max_tokens=0), "max_tokens"),
                       (pb.GenerateRequest(messages=chat, chat_template_kwargs="{"), "chat_template_kwargs"),
                       (pb.GenerateRequest(prompt="a", chat_template_kwargs="{}"), "chat_template_kwargs"),
                       (pb.GenerateRequest(messages=[pb.ChatMessage(role="robot", content="x")]), "messages[0].role")]:
        with pytest.raises(InvalidRequestError) as err:
            request_from_proto(bad, "base", 16)
        assert field in err.value.fields


def test_status_mapping_and_api_keys():
    assert grpc_status(AdapterNotFoundError("x"))[0] == grpc.StatusCode.NOT_FOUND
    assert grpc_status(InvalidRequestError([("temperature", "bad")]))[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert grpc_status(SourceUnavailableError("s3 down"))[0] == grpc.StatusCode.UNAVAILABLE
    assert grpc_status(EngineDeadError("dead"))[0] == grpc.StatusCode.UNAVAILABLE
    assert grpc_status(AuthenticationError("no"))[0] == grpc.StatusCode.UNAUTHENTICATED
    assert grpc_status(RuntimeError("boom"))[0] == grpc.StatusCode.INTERNAL
    assert grpc_status(LoadWorkerLostError("a load's worker died twice"))[0] == grpc.StatusCode.INTERNAL

    class Context:
        def __init__(self, metadata):
            self.metadata = metadata

        def invocation_metadata(self):
            return self.metadata

    check_api_key(Context([]), None)  # keys off
    check_api_key(Context([("authorization", "Bearer k1")]), ["k0", "k1"])
    for metadata in ([], [("authorization", "Bearer nope")], [("authorization", "k1")]):
        with pytest.raises(AuthenticationError):
            check_api_key(Context(metadata), ["k1"])
