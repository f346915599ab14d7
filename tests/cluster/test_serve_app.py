"""The demo application end to end on real Ray Serve: the official openai client over HTTP on loopback,
an adapter loaded at run time from a real S3 server (SeaweedFS), the Python handle, and faults."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import httpx
import openai
import pytest
import ray
from ray import serve

from cluster.app import build_app
from tests.cluster.conftest import upload_dir
from tests.cluster.serve_cases import _free_port

APP = "lorafleet"
SERVE_READY_TIMEOUT_S = 180  # the app's /health answers 200 within this, or the module's tests fail: does not hang


def _wait_until_healthy(base: str) -> None:
    """Returns once GET {base}/health answers 200; fails the test after SERVE_READY_TIMEOUT_S."""
    deadline, last = time.monotonic() + SERVE_READY_TIMEOUT_S, None
    while time.monotonic() < deadline:
        try:
            r = httpx.get(f"{base}/health", timeout=2)
            if r.status_code == 200:
                return
            last = f"HTTP {r.status_code}: {r.text[:200]}"
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(1)
    app = serve.status().applications.get(APP)
    state = "not deployed" if app is None else f"{app.status} {app.message!r}, deployments: " + ", ".join(
        f"{name} {d.status} {d.message!r}" for name, d in app.deployments.items())
    pytest.fail(f"the Serve app {APP!r} was not ready: {base}/health did not answer 200 within "
                f"{SERVE_READY_TIMEOUT_S} s (last: {last}); app: {state}", pytrace=False)


@pytest.fixture(scope="module")
def serve_app(tmp_path_factory, s3_server):
    cache = tmp_path_factory.mktemp("cache")
    registry = tmp_path_factory.mktemp("registry")
    port = _free_port()
    env = {"LORAFLEET_CACHE": str(cache), "OMP_NUM_THREADS": "1", **s3_server.env}
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": env}, namespace="lorafleet-test")
    mp = pytest.MonkeyPatch()
    for k, v in env.items():
        mp.setenv(k, v)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        args = {
            "server": {"model": "demo", "default_max_tokens": 8,
                       "engine": {"dtype": "float32", "max_loras": 2, "max_lora_rank": 16, "num_kv_blocks": 128}},
            "tier": {"capacity_bytes": 1 << 28, "registry_dir": str(registry),
                     "sources": {"s3_endpoint_url": s3_server.endpoint_url}},
            "replica": {"num_replicas": 2, "ray_actor_options": {"num_cpus": 0.25}, "routing_stats_period_s": 0.5},
            "ingress": {"ray_actor_options": {"num_cpus": 0.1}},
        }
        serve.run(build_app(args), name=APP, route_prefix="/", blocking=False)
        base = f"http://127.0.0.1:{port}"
        _wait_until_healthy(base)
        yield base
    finally:
        serve.shutdown()
        ray.shutdown()
        mp.undo()


def test_an_app_that_never_turns_healthy_fails_the_fixture(monkeypatch):
    """The readiness wait ends in a failure naming the app, not in tests run against a server that is not up."""
    monkeypatch.setitem(globals(), "SERVE_READY_TIMEOUT_S", 0.5)
    monkeypatch.setitem(globals(), "serve", SimpleNamespace(status=lambda: SimpleNamespace(applications={})))
    with pytest.raises(pytest.fail.Exception, match=f"Serve app '{APP}' was not ready: .*/health .*not deployed"):
        _wait_until_healthy(f"http://127.0.0.1:{_free_port()}")

def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)


def test_models_completion_chat_streaming(serve_app):
    client = _client(serve_app)
    ids = {m.id for m in client.models.list().data}
    assert {"lorafleet-demo", "demo-sql", "demo-chat"} <= ids
    out = client.completions.create(model="demo-sql", prompt="The quick brown fox", max_tokens=6, temperature=0)
    assert out.usage.completion_tokens == 6
    chat = client.chat.completions.create(model="demo-chat", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=5, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 5
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="demo-sql", prompt="The quick brown fox", max_tokens=6, temperature=0, stream=True) if c.choices)
    assert streamed == out.choices[0].text
    # the Serve app's own tokenizer (the ingress loads it): /tokenize counts what the completion's usage counts
    tokens = httpx.post(f"{serve_app}/tokenize", json={"prompt": "The quick brown fox"}, timeout=60).json()
    assert tokens["count"] == out.usage.prompt_tokens
    two = client.completions.create(model="demo-sql", prompt=["The quick brown fox", "SELECT"], max_tokens=2)
    assert [c.index for c in two.choices] == [0, 1]  # a prompt list through the replicas' handles
    # a forced tool call: the tools and the grammar travel to the replica with the request
    clock = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
    called = client.chat.completions.create(model="demo-chat", messages=[{"role": "user", "content": "time?"}],
                                            max_tokens=96, tools=[clock], tool_choice="required",
                                            parallel_tool_calls=False)
    (call,) = called.choices[0].message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] in ("UTC", "CET")
    # the Responses API through the ingress: the chat's text, and a stored response continued by id
    first = client.responses.create(model="demo-chat", input="hi", max_output_tokens=5, temperature=0)
    assert first.output_text == chat.choices[0].message.content and first.usage.input_tokens == chat.usage.prompt_tokens
    then = client.responses.create(model="demo-chat", input="and?", previous_response_id=first.id,
                                   max_output_tokens=3, temperature=0)
    assert then.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert client.responses.retrieve(then.id).output_text == then.output_text


def test_adapter_loaded_from_s3_at_run_time(serve_app, s3_client, peft_adapter_dir):
    s3_client.create_bucket(Bucket="adapters")
    upload_dir(s3_client, "adapters", "team-a/sql", peft_adapter_dir)
    r = httpx.post(f"{serve_app}/v1/load_lora_adapter", timeout=120,
                   json={"lora_name": "sql-from-s3", "lora_path": "s3://adapters/team-a/sql"})
    assert r.status_code == 200, r.text
    client = _client(serve_app)
    assert "sql-from-s3" in {m.id for m in client.models.list().data}
    got = client.completions.create(model="sql-from-s3", prompt="SELECT", max_tokens=5, temperature=0)
    want = client.completions.create(model="demo-sql", prompt="SELECT", max_tokens=5, temperature=0)
    assert got.choices[0].text == want.choices[0].text  # the same adapter, fetched from S3
    bad = httpx.post(f"{serve_app}/v1/load_lora_adapter", timeout=60,
                     json={"lora_name": "nothing", "lora_path": "s3://adapters/no/such/prefix"})
    assert bad.status_code == 404, bad.text
    # rank 32 > this deployment's max_lora_rank of 16: refused at load time, not at first use
    upload_dir(s3_client, "adapters", "team-b/big", peft_adapter_dir.parent / "demo-translate")
    big = httpx.post(f"{serve_app}/v1/load_lora_adapter", timeout=120,
                     json={"lora_name": "too-big", "lora_path": "s3://adapters/team-b/big"})
    assert big.status_code == 400 and "max_lora_rank" in big.text, big.text
    assert "too-big" not in {m.id for m in client.models.list().data}
    # re-pointing a serving name to it is refused alike, and the name serves its old weights on
    repoint = httpx.post(f"{serve_app}/v1/load_lora_adapter", timeout=120,
                         json={"lora_name": "sql-from-s3", "lora_path": "s3://adapters/team-b/big"})
    assert repoint.status_code == 400 and "s3://adapters/team-b/big" in repoint.text, repoint.text
    again = client.completions.create(model="sql-from-s3", prompt="SELECT", max_tokens=5, temperature=0)
    assert again.choices[0].text == got.choices[0].text
    cards = {m.id: m for m in client.models.list().data}
    assert cards["sql-from-s3"].root == "s3://adapters/team-a/sql"


def test_after_an_unload_returns_no_replica_serves_the_adapter(serve_app, s3_client, peft_adapter_dir):
    """The adapter loaded and serving on a replica; the unload's answer means every replica refuses it now (the
    replicas' routing-stats sync alone came 0.2-1 s late)."""
    s3_client.create_bucket(Bucket="short-lived")
    upload_dir(s3_client, "short-lived", "sql", peft_adapter_dir)
    r = httpx.post(f"{serve_app}/v1/load_lora_adapter", timeout=120,
                   json={"lora_name": "brief", "lora_path": "s3://short-lived/sql"})
    assert r.status_code == 200, r.text
    client = _client(serve_app)
    for _ in range(3):
        client.completions.create(model="brief", prompt="SELECT", max_tokens=2)
    gone = httpx.post(f"{serve_app}/v1/unload_lora_adapter", json={"lora_name": "brief"}, timeout=60)
    assert gone.status_code == 200, gone.text
    codes = [httpx.post(f"{serve_app}/v1/completions", timeout=60,
                        json={"model": "brief", "prompt": "SELECT", "max_tokens": 2}).status_code for _ in range(8)]
    assert codes == [404] * 8


def test_errors_and_python_handle(serve_app):
    client = _client(serve_app)
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="no-such-adapter", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="lorafleet-demo", prompt="hi", max_tokens=2, temperature=-3)
    # the replica's own message, not the Ray traceback that carried it to the ingress
    assert missing.value.body["message"].startswith("model 'no-such-adapter' does not exist"), missing.value.body
    assert "temperature" in bad.value.body["message"] and "Traceback" not in bad.value.body["message"]
    r = httpx.post(f"{serve_app}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/etc/../root"})
    assert r.status_code == 400

    handle = serve.get_app_handle(APP)
    result = handle.generate.remote(prompt="The quick brown fox", adapter="demo-sql", max_tokens=4,
                                    temperature=0, priority=0).result(timeout_s=120)
    assert result["finished"] and len(result["outputs"][0]["token_ids"]) == 4
    with pytest.raises(Exception, match="scheduling_policy"):  # priority travels apart from the sampling fields
        handle.generate.remote(prompt="hi", max_tokens=2, priority=2).result(timeout_s=120)
    with pytest.raises(Exception, match="output_kind"):  # the replica streams deltas of cumulative outputs itself
        handle.generate.remote(prompt="hi", max_tokens=2, output_kind=2).result(timeout_s=120)
    chunks = list(handle.options(stream=True).generate.remote(prompt="The quick brown fox", adapter="demo-sql",
                                                              max_tokens=4, temperature=0, stream=True))
    assert chunks[-1]["outputs"][0]["text"] == result["outputs"][0]["text"]
    assert len(chunks) >= 2


METRICS_TIMEOUT_S = 60  # replicas' snapshots reach /metrics within a few routing-stats periods: does not hang


def test_metrics_name_every_series_the_dashboard_queries(serve_app):
    """Scrape the app's /metrics after traffic: every series a panel of deploy/grafana-dashboard.json queries
    is there, with both replicas' own series, and the text is what Prometheus' own parser reads."""
    import re
    from pathlib import Path

    from prometheus_client.parser import text_string_to_metric_families

    client = _client(serve_app)
    for model in ("lorafleet-demo", "demo-sql", "demo-chat", "demo-sql"):
        client.completions.create(model=model, prompt="SELECT", max_tokens=3)
    rank_count = r'^lorafleet_replica_time_to_first_token_seconds_count\{[^}]*rank="(\d+)"'
    deadline, text, replicas = time.monotonic() + METRICS_TIMEOUT_S, "", set()
    while time.monotonic() < deadline:  # until the snapshots of both replicas hold this test's requests
        text = httpx.get(f"{serve_app}/metrics", timeout=30).text
        replicas = set(re.findall(r'^lorafleet_lora_slots_free\{replica="([^"]+)"', text, re.M))
        if len(replicas) == 2 and {"0", "8"} <= set(re.findall(rank_count, text, re.M)):
            break
        time.sleep(0.5)
    assert len(replicas) == 2, text[-2000:]
    samples = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    dashboard = json.loads((Path(__file__).parents[2] / "deploy" / "grafana-dashboard.json").read_text())
    queried = {name for panel in dashboard["panels"] for target in panel["targets"]
               for name in re.findall(r"\blorafleet_[a-z0-9_]+", target["expr"])}
    assert len(queried) >= 15, queried
    assert queried <= samples, sorted(queried - samples)
    ranks = set(re.findall(rank_count, text, re.M))
    assert {"0", "8"} <= ranks, ranks  # the base model and demo-sql (rank 8) apart


def _serve_log_tracebacks() -> int:
    """Tracebacks in this Ray session's Serve logs (replicas, ingress, proxy, controller) so far."""
    from pathlib import Path

    logs = Path(ray._private.worker._global_node.get_logs_dir_path()) / "serve"
    return sum(p.read_text(errors="replace").count("Traceback") for p in logs.glob("*.log"))


def test_client_errors_log_no_traceback(serve_app):
    """A request naming no adapter and one with a bad sampling value: their errors reach the client, and no
    process of the app writes a traceback for them (the replica sends the error as a stream item)."""
    client = _client(serve_app)
    client.completions.create(model="demo-sql", prompt="hi", max_tokens=2)
    time.sleep(1.0)  # Ray's loggers flush to the files
    before = _serve_log_tracebacks()
    for _ in range(3):
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="no-such-adapter-x", prompt="hi", max_tokens=2)
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="demo-chat", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=2, extra_body={"top_k": -7})
    time.sleep(1.0)
    assert _serve_log_tracebacks() == before
