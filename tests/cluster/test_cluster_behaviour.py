"""How the demo app behaves as a cluster, on real Ray Serve (num_cpus=2) over HTTP on loopback.

- origin fetches happen once per adapter for the whole cluster, and adapter
  requests land on the replica that holds the adapter;
- a hot adapter under concurrent load spreads to more than one replica;
- faults: a replica killed mid-stream (the client's stream ends, Serve replaces
  the replica, later requests succeed) and the adapter-tier actor killed (it
  restarts, forgets no registered adapter and refetches on demand);
- autoscaling: a second app scales from 1 to 2 replicas under load and back when idle.

Which replica holds which adapter is read from the replicas themselves: each
replica actor's record_routing_stats (what the router sees), which also counts
where the replica found the adapter of each request it served ("gpu"/"host":
resident there; "object_store": loaded there from the tier). Origin fetches are
the tier's counters on /metrics.
"""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import ray
from ray import serve
from ray._private import state as ray_state

from cluster.app import build_app
from tests.cluster.serve_cases import (HTTP_TIMEOUT_S, Cluster, _complete, _concurrently, _free_port, _register,
                                       _replica_actors, _retries, _running_replicas, _stream, _tier_actor,
                                       _tier_metrics, _wait_for)

APP = "behaviour"
AUTOSCALE_APP = "behaviour-autoscale"
BASE_MODEL = "lorafleet-demo"
STATS_PERIOD_S = 0.2
SETTLE_S = 1.0  # several routing-stats periods: fresh stats reach the router
NUM_REPLICAS = 3
K = 3  # distinct adapters in the fetch/affinity test
ROUNDS = 4
ROUTING_STATS_TIMEOUT_S = 10.0  # one replica's record_routing_stats: does not hang
ROUTING_STATS_ATTEMPTS = 3  # snapshots tried (Serve may be replacing a replica) before a failed call fails the test
ROUTING_STATS_RETRY_S = 1.0

ENGINE = {"dtype": "float32", "max_loras": 2, "max_lora_rank": 32, "num_kv_blocks": 128}


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """Ray with 2 CPUs and Serve's HTTP proxy on a free loopback port; the demo checkpoint prebuilt."""
    cache = tmp_path_factory.mktemp("cache")
    adapter_root = tmp_path_factory.mktemp("adapters")
    env = {"LORAFLEET_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    mp = pytest.MonkeyPatch()
    for key, value in env.items():
        mp.setenv(key, value)
    from replicas.demo_checkpoint import ensure_demo_checkpoint

    demo = ensure_demo_checkpoint()  # built once here rather than raced for by every replica
    port = _free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="lorafleet-behaviour",
             runtime_env={"env_vars": env})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield Cluster(f"http://127.0.0.1:{port}", adapter_root, demo.adapters["demo-sql"])
    finally:
        serve.shutdown()
        ray.shutdown()
        mp.undo()


def _app_args(registry: Path, adapter_root: Path, replica: dict) -> dict:
    return {
        "server": {"model": "demo", "default_max_tokens": 8, "engine": ENGINE},
        "tier": {"capacity_bytes": 1 << 28, "registry_dir": str(registry),
                 "sources": {"allowed_local_roots": [str(adapter_root)]}},
        # max_ongoing_requests 5: a replica busy at 3 in flight, so a few concurrent requests spread an adapter
        "replica": {"ray_actor_options": {"num_cpus": 0.25}, "routing_stats_period_s": STATS_PERIOD_S,
                    "max_ongoing_requests": 5,
                    "graceful_shutdown_timeout_s": 2, "graceful_shutdown_wait_loop_s": 0.5, **replica},
        "ingress": {"ray_actor_options": {"num_cpus": 0.1}},
    }


@pytest.fixture(scope="module")
def cluster(ray_cluster, tmp_path_factory) -> Cluster:
    """The demo app with 3 replicas (the first tests); torn down with Serve, or by the autoscaling test."""
    registry = tmp_path_factory.mktemp("registry")
    serve.run(build_app(_app_args(registry, ray_cluster.adapter_root, {"num_replicas": NUM_REPLICAS})),
              name=APP, route_prefix="/")
    _wait_for(lambda: httpx.get(f"{ray_cluster.base}/health", timeout=5).status_code == 200, 60, "/health")
    # The first /v1/models registers the demo adapters (fetched now, before any test counts fetches).
    assert httpx.get(f"{ray_cluster.base}/v1/models", timeout=HTTP_TIMEOUT_S).status_code == 200
    return ray_cluster


# ---- helpers -----------------------------------------------------------------------------------


def _routing_stats(app: str = APP) -> dict[str, dict]:
    """Every listed replica's record_routing_stats (what the router reads), by replica id.

    All of them or RuntimeError: a replica left out would pass "no other replica holds it" by omission.
    A snapshot with a failed call is retried (Serve may be replacing a replica), ROUTING_STATS_ATTEMPTS in all.
    """
    failed: dict[str, Exception] = {}
    for attempt in range(ROUTING_STATS_ATTEMPTS):
        if attempt:
            time.sleep(ROUTING_STATS_RETRY_S)
        refs = {rid: actor.record_routing_stats.remote() for rid, actor in _replica_actors(app).items()}
        if not refs:
            raise RuntimeError(f"no replica of {app!r} is listed: their routing stats would be vacuous")
        stats, failed = {}, {}
        for rid, ref in refs.items():
            try:
                stats[rid] = ray.get(ref, timeout=ROUTING_STATS_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - any failure: retried, then reported below
                failed[rid] = exc
        if not failed:
            return stats
    raise RuntimeError(f"record_routing_stats failed on replicas of {app!r} in {ROUTING_STATS_ATTEMPTS} "
                       f"attempts; the last attempt's errors: {failed!r}")


def _holders(adapter: str, app: str = APP) -> set[str]:
    """Replicas that report `adapter` resident (on GPU or in host memory)."""
    return {rid for rid, s in _routing_stats(app).items()
            if adapter in s["gpu_adapters"] or adapter in s["host_adapters"]}


def test_a_replica_whose_stats_call_fails_fails_the_caller(monkeypatch):
    """It cannot drop out of _holders ("no other replica holds it" by omission): retried, then RuntimeError."""
    no_answer = ray.exceptions.GetTimeoutError
    failing = {"silent": ROUTING_STATS_ATTEMPTS}  # calls left that fail, by replica

    def get(rid, timeout):  # the fake actors' refs are their ids
        if failing.get(rid):
            failing[rid] -= 1
            raise no_answer(f"{rid} did not answer")
        return {"gpu_adapters": ["x"] if rid == "holder" else [], "host_adapters": []}

    actors = {rid: SimpleNamespace(record_routing_stats=SimpleNamespace(remote=lambda rid=rid: rid))
              for rid in ("holder", "silent")}
    monkeypatch.setitem(globals(), "_replica_actors", lambda app: actors)
    monkeypatch.setitem(globals(), "ray", SimpleNamespace(get=get))
    monkeypatch.setitem(globals(), "ROUTING_STATS_RETRY_S", 0.0)
    with pytest.raises(RuntimeError, match="record_routing_stats failed .*'silent'"):
        _holders("x")
    assert failing["silent"] == 0  # tried ROUTING_STATS_ATTEMPTS times
    failing["silent"] = ROUTING_STATS_ATTEMPTS - 1  # answers on the last try: no failure
    assert _holders("x") == {"holder"}


def _tier_owner_replica() -> str | None:
    """The replica whose worker created the adapter-tier actor (its owner in Ray's terms), if a replica did."""
    owner = ray_state.actors(_tier_actor()._actor_id.hex())["OwnerAddress"]
    for rid, actor in _replica_actors(APP).items():
        address = ray_state.actors(actor._actor_id.hex())["Address"]
        if (address["IPAddress"], address["Port"]) == (owner["IPAddress"], owner["Port"]):
            return rid
    return None


# ---- routing and the shared tier ---------------------------------------------------------------


def _adapter_events() -> Counter:
    """Adapter requests summed over the replicas, by where the serving replica found the adapter:
    "gpu" / "host" (resident there), "object_store" (loaded there from the tier)."""
    total: Counter = Counter()
    for stats in _routing_stats().values():
        total.update(stats["adapter_events"])
    return total


def test_one_origin_fetch_per_adapter_and_requests_land_on_holders(cluster):
    adapters = [f"fresh-{i}" for i in range(K)]
    before = _tier_metrics(cluster.base)
    for name in adapters:
        _register(cluster, name)
    events_before = _adapter_events()
    # Round 1: a cold burst of two concurrent requests per adapter lands on one replica per adapter
    # rather than loading the adapter everywhere.
    _concurrently([lambda a=a: _complete(cluster.base, a) for a in adapters for _ in range(2)])
    time.sleep(SETTLE_S)
    first_holders = {a: _holders(a) for a in adapters}
    assert all(len(h) == 1 for h in first_holders.values()), first_holders
    # Later rounds: one request per adapter, all at once (no replica gets busy enough to spread an adapter).
    for _ in range(ROUNDS - 1):
        _concurrently([lambda a=a: _complete(cluster.base, a) for a in adapters])
    time.sleep(SETTLE_S)
    # Later rounds went to the holders only: no other replica loaded (and so reports) any of them ...
    assert {a: _holders(a) for a in adapters} == first_holders
    # ... and each adapter was loaded from the tier by one replica, once: every other request was served
    # by a replica that already held its adapter.
    events = _adapter_events() - events_before
    assert events["object_store"] == K, events
    assert events["gpu"] + events["host"] == 2 * K + (ROUNDS - 1) * K - K, events
    after = _tier_metrics(cluster.base)
    # Exactly K origin fetches for the whole cluster (at registration; replicas read the object store).
    assert after["origin_fetches"] - before["origin_fetches"] == K, (before, after)
    assert after["fetch_errors"] == before["fetch_errors"]


def test_hot_adapter_spreads_under_load(cluster):
    _register(cluster, "hot")
    _complete(cluster.base, "hot")
    time.sleep(SETTLE_S)
    assert len(_holders("hot")) == 1
    # 9 concurrent requests: a replica is busy at ceil(5 * 0.5) = 3 in flight (max_ongoing_requests 5).
    _concurrently([lambda: _complete(cluster.base, "hot", max_tokens=48, ignore_eos=True) for _ in range(9)])
    time.sleep(SETTLE_S)
    holders = _holders("hot")
    assert len(holders) >= 2, holders


# ---- faults ------------------------------------------------------------------------------------


def test_replica_killed_mid_stream(cluster):
    before = set(_replica_actors(APP))
    assert len(before) == NUM_REPLICAS
    events: list[str] = []
    broken: Exception | None = None
    body = {"model": BASE_MODEL, "prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True,
            "temperature": 0, "stream": True}
    # A read timeout well under the test's budget: a hung stream fails the test instead of blocking it.
    with httpx.stream("POST", f"{cluster.base}/v1/completions", json=body,
                      timeout=httpx.Timeout(HTTP_TIMEOUT_S, read=20.0)) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        while len(events) < 3:
            line = next(lines)
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
        busy = _wait_for(lambda: [rid for rid, s in _routing_stats().items() if s["queue_len"] > 0], 10,
                         "the replica serving the stream")
        assert len(busy) == 1, busy
        # The replica that created the adapter tier goes down too (when it is another replica): the tier is
        # the cluster's, and must not die with the replica that happened to start it.
        victims = {busy[0], _tier_owner_replica()} - {None}
        tier = _tier_actor()
        tier_restarts = ray_state.actors(tier._actor_id.hex())["NumRestarts"]
        actors = _replica_actors(APP)
        for rid in victims:
            ray.kill(actors[rid], no_restart=True)
        killed_at = time.monotonic()
        try:
            for line in lines:
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
        except httpx.ReadTimeout:
            pytest.fail("the stream hung after its replica was killed")
        except httpx.HTTPError as exc:  # the connection dropped: a truncated stream that ended
            broken = exc
    assert time.monotonic() - killed_at < 20
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    finished = [c for c in chunks if c.get("choices") and c["choices"][0].get("finish_reason")]
    assert not finished, "the stream claims to have finished although its replica died"
    errors = [c for c in chunks if c.get("object") == "error"]
    assert broken is not None or errors, events[-3:]
    if errors:  # a clean in-band error, then the end of the stream
        assert errors[0]["error"]["code"] >= 500 and events[-1] == "[DONE]", events[-3:]
    # Serve replaces the replica ...
    _wait_for(lambda: len(_replica_actors(APP)) == NUM_REPLICAS and _running_replicas(APP) == NUM_REPLICAS
              and not victims & set(_replica_actors(APP)), 90, "Serve to replace the killed replicas", 0.5)
    assert len(set(_replica_actors(APP)) - before) == len(victims)
    # ... the adapter tier lives on, untouched ...
    tier_state = ray_state.actors(tier._actor_id.hex())
    assert tier_state["State"] == "ALIVE" and tier_state["NumRestarts"] == tier_restarts, tier_state
    # ... and later requests succeed, base model and adapters alike.
    _concurrently([lambda m=m: _complete(cluster.base, m) for m in (BASE_MODEL, "fresh-0", "hot", BASE_MODEL)])


def test_adapter_tier_killed_restarts_and_refetches(cluster):
    _register(cluster, "late")  # fetched by the tier at registration; no replica has loaded it
    assert not _holders("late")
    registered = {m["id"] for m in httpx.get(f"{cluster.base}/v1/models", timeout=HTTP_TIMEOUT_S).json()["data"]}
    assert {"late", "hot", "demo-sql", *(f"fresh-{i}" for i in range(K))} <= registered
    tier = _tier_actor()
    restarts = ray_state.actors(tier._actor_id.hex())["NumRestarts"]
    ray.kill(tier, no_restart=False)
    _wait_for(lambda: ray_state.actors(tier._actor_id.hex())["NumRestarts"] > restarts
              and ray_state.actors(tier._actor_id.hex())["State"] == "ALIVE", 60, "the tier to restart")

    # No registered adapter is forgotten (the registry is reloaded from registry_dir).
    def models() -> set[str]:
        r = httpx.get(f"{cluster.base}/v1/models", timeout=HTTP_TIMEOUT_S)
        return r.status_code == 200 and {m["id"] for m in r.json()["data"]}

    assert _wait_for(models, 30, "/v1/models after the restart") == registered
    # The restarted tier caches nothing: a request for an adapter no replica holds refetches it from its origin.
    assert ray.get(_tier_actor().cached.remote(), timeout=30) == []
    _complete(cluster.base, "late")
    metrics = _tier_metrics(cluster.base)
    assert metrics["origin_fetches"] == 1 and metrics["fetch_errors"] == 0, metrics
    assert ray.get(_tier_actor().cached.remote(), timeout=30) == ["late"]
    # Adapters the replicas already hold keep serving.
    _complete(cluster.base, "fresh-1")


LOSS_APP = "behaviour-loss"


def test_a_replica_killed_under_load_fails_no_request_that_had_not_started(ray_cluster, tmp_path_factory):
    """Two replicas that each run 2 requests and hold 6 more waiting (max_num_seqs 2, max_ongoing_requests 8);
    one is killed. Every request that had produced nothing, and every non-streamed one, still succeeds (run
    again on the other replica); a stream already under way ends with an in-band OpenAI error, then [DONE];
    no answer carries Ray's internals."""
    serve.delete(APP)  # free the 2 cores for this app (no-op when run alone)
    args = _app_args(tmp_path_factory.mktemp("registry-loss"), ray_cluster.adapter_root,
                     {"num_replicas": 2, "max_ongoing_requests": 8})
    args["server"]["engine"] = {**ENGINE, "max_num_seqs": 2}
    serve.run(build_app(args), name=LOSS_APP, route_prefix="/loss")
    base = f"{ray_cluster.base}/loss"
    _complete(base, BASE_MODEL)
    retried_before = _retries(base)
    body = {"model": BASE_MODEL, "prompt": "Once upon a time", "max_tokens": 40, "ignore_eos": True,
            "temperature": 0}

    def plain() -> tuple[int, str]:
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=HTTP_TIMEOUT_S * 2)
        return r.status_code, r.text

    with ThreadPoolExecutor(max_workers=16) as pool:
        futures = [pool.submit(plain) for _ in range(8)] + [pool.submit(_stream, base, body) for _ in range(8)]
        loaded = _wait_for(lambda: [rid for rid, st in _routing_stats(LOSS_APP).items() if st["queue_len"] >= 6],
                           60, "a replica holding 6 requests or more")
        ray.kill(_replica_actors(LOSS_APP)[loaded[0]], no_restart=True)
        results = [f.result(timeout=HTTP_TIMEOUT_S * 4) for f in futures]

    plains, streams = results[:8], results[8:]
    assert [status for status, _ in plains] == [200] * 8, [t for status, t in plains if status != 200]
    assert all(json.loads(t)["usage"]["completion_tokens"] == 40 for _, t in plains)
    for status, events in streams:
        assert status == 200 and events[-1] == "[DONE]", (status, events[-3:])
        chunks = [json.loads(e) for e in events[:-1]]
        errors = [c for c in chunks if c.get("object") == "error"]
        text = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
        if errors:  # under way when its replica died: it had output, and it ends with one clean error
            assert text and chunks[-1] is errors[0] and errors[0]["error"]["code"] == 503, events[-3:]
            message = errors[0]["error"]["message"]
            assert not re.search(r"actor|pid|Traceback|ray", message, re.I), message
        else:
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert _retries(base) > retried_before  # the waiting requests did run again elsewhere
    serve.delete(LOSS_APP)


# ---- autoscaling -------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:The `metrics_interval_s` field:DeprecationWarning")  # still what Serve reads
def test_autoscaling_up_under_load_and_down_when_idle(ray_cluster, tmp_path_factory):
    serve.delete(APP)  # free the 2 cores for this app (no-op when run alone)
    autoscaling = {"min_replicas": 1, "initial_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1,
                   "upscale_delay_s": 0.5, "downscale_delay_s": 3, "look_back_period_s": 1,
                   "metrics_interval_s": 0.2}
    args = _app_args(tmp_path_factory.mktemp("registry-autoscale"), ray_cluster.adapter_root,
                     {"autoscaling_config": autoscaling})
    serve.run(build_app(args), name=AUTOSCALE_APP, route_prefix="/as")
    base = f"{ray_cluster.base}/as"
    _complete(base, BASE_MODEL)
    assert _running_replicas(AUTOSCALE_APP) == 1

    stop = False
    served = []

    def load() -> None:
        while not stop:
            served.append(_complete(base, BASE_MODEL, max_tokens=200, ignore_eos=True))

    with ThreadPoolExecutor(max_workers=4) as pool:
        workers = [pool.submit(load) for _ in range(4)]
        try:
            _wait_for(lambda: _running_replicas(AUTOSCALE_APP) == 2, 90, "a scale-up to 2 replicas", 0.5)
            assert len(_routing_stats(AUTOSCALE_APP)) == 2  # both replicas answer
        finally:
            stop = True
        for w in workers:
            w.result(timeout=HTTP_TIMEOUT_S)
    assert served
    # Idle: back to min_replicas.
    _wait_for(lambda: _running_replicas(AUTOSCALE_APP) == 1
              and serve.status().applications[AUTOSCALE_APP].deployments["LoRAReplica"].replica_states
              .get("STOPPING", 0) == 0, 60, "a scale-down to 1 replica", 0.5)
    _complete(base, BASE_MODEL)
