"""AdapterAffinityRouter inside real Ray Serve: 3 fake replicas with no model, routing stats polled every 0.1 s.

Each fake replica "loads" the adapters it serves into its own small GPU LRU and
reports them from record_routing_stats, so which replica holds an adapter is
decided by the router itself (its first, cold request).
"""

import asyncio
import time
from collections import Counter, OrderedDict

import pytest
import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

STATS_PERIOD_S = 0.1
PENDING_TTL_S = 1.0
# Long enough for the router's memory of recent assignments to expire and for
# fresh routing stats (polled every 0.1 s) to reach it.
SETTLE_S = PENDING_TTL_S + 1.0
MAX_ONGOING = 6  # busy at ceil(6 * 0.5) = 3 queued requests
RESULT_TIMEOUT_S = 20


@serve.deployment(
    num_replicas=3,
    max_ongoing_requests=MAX_ONGOING,
    ray_actor_options={"num_cpus": 0},
    request_router_config=RequestRouterConfig(
        request_router_class="cluster.router.AdapterAffinityRouter",
        request_router_kwargs={"busy_fraction": 0.5, "pending_ttl_s": PENDING_TTL_S, "seed": 0},
        request_routing_stats_period_s=STATS_PERIOD_S,
    ),
)
class FakeLoRAReplica:
    """Serves no model: remembers adapters like a GPU slot LRU and says which replica answered."""

    def __init__(self, max_loras: int = 8) -> None:
        self.max_loras = max_loras
        self.gpu: OrderedDict[str, None] = OrderedDict()
        self.ongoing = 0
        self.replica_id = serve.get_replica_context().replica_id.unique_id

    async def __call__(self, prompt: str = "", adapter: str | None = None, delay_s: float = 0.0) -> dict:
        self.ongoing += 1
        try:
            resident = adapter in self.gpu
            if adapter is not None:
                self.gpu[adapter] = None
                self.gpu.move_to_end(adapter)
                while len(self.gpu) > self.max_loras:
                    self.gpu.popitem(last=False)
            await asyncio.sleep(delay_s)
            return {"replica": self.replica_id, "resident": resident}
        finally:
            self.ongoing -= 1

    def record_routing_stats(self) -> dict:
        return {"gpu_adapters": list(self.gpu), "host_adapters": [], "free_slots": self.max_loras - len(self.gpu),
                "queue_len": self.ongoing, "max_loras": self.max_loras}


@pytest.fixture(scope="module")
def handle():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(proxy_location="Disabled")
        yield serve.run(FakeLoRAReplica.bind(), name="router-test", route_prefix=None)
    finally:
        serve.shutdown()
        ray.shutdown()


def call(handle, adapter=None, delay_s=0.0) -> dict:
    return handle.remote(adapter=adapter, delay_s=delay_s).result(timeout_s=RESULT_TIMEOUT_S)


def concurrent(handle, n, adapter=None, delay_s=0.0) -> list[dict]:
    responses = [handle.remote(adapter=adapter, delay_s=delay_s) for _ in range(n)]
    return [r.result(timeout_s=RESULT_TIMEOUT_S) for r in responses]


def test_adapter_requests_land_on_their_holder(handle):
    holders = {}
    for name in ("a0", "a1", "a2"):
        first = call(handle, name)
        assert not first["resident"]
        holders[name] = first["replica"]
        # Before the stats show the adapter, the router remembers where it sent it.
        assert [call(handle, name)["replica"] for _ in range(3)] == [holders[name]] * 3
    time.sleep(SETTLE_S)
    # Now from the routing stats alone.
    for name, holder in holders.items():
        answers = [call(handle, name) for _ in range(4)]
        assert all(a["replica"] == holder and a["resident"] for a in answers), (name, holder, answers)


def test_cold_burst_lands_on_one_replica(handle):
    answers = concurrent(handle, 3, adapter="burst", delay_s=0.3)
    assert len({a["replica"] for a in answers}) == 1, answers


def test_hot_adapter_spreads_when_its_holder_is_busy(handle):
    holder = call(handle, "hot")["replica"]
    time.sleep(SETTLE_S)
    assert call(handle, "hot")["replica"] == holder
    answers = concurrent(handle, 9, adapter="hot", delay_s=1.5)
    per_replica = Counter(a["replica"] for a in answers)
    assert holder in per_replica
    assert len(per_replica) >= 2, per_replica


def test_base_requests_spread_over_all_replicas(handle):
    answers = concurrent(handle, 12, delay_s=1.0)
    assert len({a["replica"] for a in answers}) == 3, answers
