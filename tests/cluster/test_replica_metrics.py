"""The operators' metrics as plain objects: histograms, the Prometheus text (read back by prometheus_client's own
parser), request timings, load-failure reasons and the board's expiry of gone replicas."""

from __future__ import annotations

import itertools

from prometheus_client.parser import text_string_to_metric_families

from cluster.errors import AdapterNotFoundError
from cluster.prometheus import Histogram
from cluster.replica_metrics import (LOAD_FAILURE_REASONS, REPORT_TTL_S, MetricsBoardState, ReplicaMetrics,
                                     RequestTiming, load_failure_reason, render)
from lora_core.errors import RankTooLargeError
from replicas.outputs import CompletionOutput, RequestOutput


def _parsed(text: str) -> dict[str, list]:
    """family name -> its samples, as prometheus_client reads the text (a malformed line raises)."""
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def test_a_histogram_counts_cumulatively_up_to_inf():
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 7.0):
        h.observe(v)
    samples = {(name, labels.get("le")): value for name, labels, value in h.samples("x_seconds")}
    assert samples[("x_seconds_bucket", "0.1")] == 2 and samples[("x_seconds_bucket", "1.0")] == 3
    assert samples[("x_seconds_bucket", "+Inf")] == 4 and samples[("x_seconds_count", None)] == 4
    assert samples[("x_seconds_sum", None)] == 7.65


def _snapshot(metrics: ReplicaMetrics) -> list:
    stats = {"gpu_adapters": ["a"], "free_slots": 3, "queue_len": 2, "merged_adapter": None, "lora_merges": 1,
             "load_worker_restarts": 0}
    return metrics.samples(stats, {"gpu_reserved": 400, "gpu_used": 100, "host": 50}, {"gpu": 5, "object_store": 1},
                           {"running": 2, "waiting": 0})


def test_replica_snapshots_render_as_prometheus_text_with_a_replica_label():
    metrics = ReplicaMetrics()
    metrics.load_seconds.observe(0.2)
    metrics.request_done(rank=16, ttft_s=0.05, tpot_s=0.01)
    metrics.request_done(rank=0, ttft_s=0.02, tpot_s=None)
    metrics.load_failed(RankTooLargeError("s3://b/x/adapter_config.json", "r", "too big"))
    families = _parsed(render({"r1": _snapshot(metrics), 'od"d': _snapshot(ReplicaMetrics())}))
    slots = {s.labels["replica"]: s.value for s in families["lorafleet_lora_slots_free"]}
    assert slots == {"r1": 3.0, 'od"d': 3.0}  # a quote in a label value is escaped, and read back
    ttft = families["lorafleet_replica_time_to_first_token_seconds"]
    assert {s.labels["rank"] for s in ttft if s.labels["replica"] == "r1"} == {"0", "16"}
    failures = {(s.labels["replica"], s.labels["reason"]): s.value for s in families["lorafleet_adapter_load_failures"]}
    assert failures[("r1", "invalid_adapter")] == 1 and failures[('od"d', "invalid_adapter")] == 0
    assert {r for _, r in failures} == set(LOAD_FAILURE_REASONS)  # every reason from the start
    memory = {s.labels["state"]: s.value for s in families["lorafleet_lora_gpu_memory_bytes"]
              if s.labels["replica"] == "r1"}
    assert memory == {"reserved": 400.0, "used": 100.0}


def test_load_failure_reasons():
    assert load_failure_reason(RankTooLargeError("p", "r", "x")) == "invalid_adapter"
    assert load_failure_reason(AdapterNotFoundError("gone")) == "not_found"
    assert load_failure_reason(KeyError("x")) == "other"


def _output(tokens: int) -> RequestOutput:
    return RequestOutput("id", "p", [1], [CompletionOutput(0, "x" * tokens, list(range(tokens)), None, None)], False)


def test_request_timing_measures_the_first_token_and_the_ones_after():
    clock = itertools.count(0.0, 0.5).__next__  # every reading half a second after the last
    metrics = ReplicaMetrics()
    timing = RequestTiming(metrics, rank=8, clock=clock)  # start: 0.0
    timing.output(_output(0))  # no token yet
    timing.output(_output(1))  # first token: 0.5
    timing.output(_output(5))
    timing.done()  # end: 1.0, so 0.5 s over the 4 tokens after the first
    assert metrics.ttft[8].total == 0.5 and metrics.tpot[8].total == 0.125


def test_the_board_forgets_a_replica_that_stopped_reporting():
    now = [0.0]
    board = MetricsBoardState(clock=lambda: now[0])
    board.report("a", [("x", {}, 1.0)])
    now[0] = REPORT_TTL_S / 2
    board.report("b", [("x", {}, 2.0)])
    now[0] = REPORT_TTL_S + 1
    assert list(board.live()) == ["b"]


def test_a_serving_replica_reports_its_snapshot(tmp_path_factory):
    """LoRAServer.metrics_samples over a real engine (the in-process stack): after an adapter request the
    snapshot renders, counts the request by tier and rank, and reads the manager's memory."""
    from tests.cluster.api_cases import open_stack, run

    stack_gen = open_stack(tmp_path_factory)
    stack = next(stack_gen)
    try:
        async def go(c):
            await c.completions.create(model="demo-sql", prompt="SELECT", max_tokens=3)

        run(stack, go)
        families = _parsed(render({"me": stack[2].metrics_samples()}))
    finally:
        next(stack_gen, None)  # its teardown: the server shuts its engine down
    requests = {s.labels["tier"]: s.value for s in families["lorafleet_adapter_requests"]}
    assert requests.get("object_store") == 1
    ranks = {s.labels["rank"] for s in families["lorafleet_replica_time_to_first_token_seconds"]}
    assert ranks == {"8"}  # demo-sql's rank
    assert {s.labels["state"] for s in families["lorafleet_engine_requests"]} == {"running", "waiting"}
    reserved = [s.value for s in families["lorafleet_lora_gpu_memory_bytes"] if s.labels["state"] == "reserved"]
    assert reserved and reserved[0] > 0


def test_router_decisions_reach_metrics_through_serves_by_value_copy_of_the_router(tmp_path):
    """Serve ships the router class pickled by value (with the values of the globals it names) into the
    ingress's process: the decisions of that copy must still be the ones /metrics adds up there."""
    import subprocess
    import sys

    from ray import cloudpickle

    import cluster.router

    cloudpickle.register_pickle_by_value(cluster.router)
    try:
        (tmp_path / "router.pkl").write_bytes(cloudpickle.dumps(cluster.router.AdapterAffinityRouter))
    finally:
        cloudpickle.unregister_pickle_by_value(cluster.router)
    script = f"""
from ray import cloudpickle
from cluster.router import decisions_text
cls = cloudpickle.loads(open({str(tmp_path / 'router.pkl')!r}, "rb").read())
router = cls.__new__(cls)
cls.initialize_state(router)
router.policy.decisions["cold"] += 2
print(decisions_text())
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert 'lorafleet_router_decisions_total{kind="cold"} 2' in out.stdout, out.stdout + out.stderr
