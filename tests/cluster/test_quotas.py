"""Token-rate quotas (cluster/quotas.py): buckets refilled at the rate up to the burst, reservations settled with
what requests used, 429's retry-after, the config as the deployment's YAML gives it. The clock is injected."""

from __future__ import annotations

import pickle

import pytest
import yaml

from cluster.errors import ClusterError, QuotaExceededError
from cluster.quotas import QuotaConfig, TokenQuotas, TokenRate, request_cost


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def quotas(**raw) -> tuple[TokenQuotas, Clock]:
    clock = Clock()
    return TokenQuotas(QuotaConfig.from_dict(raw), clock), clock


def test_a_bucket_refills_at_its_rate_up_to_its_burst():
    q, clock = quotas(default={"tokens_per_s": 10, "burst": 100})
    q.reserve("k", 60)
    q.reserve("k", 40)
    with pytest.raises(QuotaExceededError) as err:
        q.reserve("k", 25)
    assert err.value.retry_after_s == pytest.approx(2.5) and "retry after 3 s" in str(err.value)
    assert isinstance(err.value, ClusterError) and "'k'" not in str(err.value)  # an API key is not echoed
    clock.now += 2.5
    q.reserve("k", 25)
    assert q.available("k") == 0
    clock.now += 3600
    assert q.available("k") == 100  # never past the burst


def test_tenants_have_their_own_buckets_and_limits():
    q, _ = quotas(default={"tokens_per_s": 1, "burst": 10},
                  tenants={"sk-big": {"tokens_per_s": 1000, "burst": 5000}, "sk-other": {"tokens_per_s": 1}})
    q.reserve("sk-a", 10)
    with pytest.raises(QuotaExceededError):
        q.reserve("sk-a", 1)
    q.reserve("sk-b", 10)  # another key: a bucket of its own
    q.reserve("sk-big", 5000)
    assert q.rate("sk-other").burst == 60  # a minute's tokens by default
    unlimited, _ = quotas(tenants={"sk-capped": {"tokens_per_s": 1, "burst": 1}})
    for _ in range(100):
        unlimited.reserve("sk-anyone", 10**9)  # no default: only the listed tenants are capped
    assert unlimited.available("sk-anyone") == float("inf")


def test_settling_gives_back_what_a_request_did_not_use_and_takes_what_it_did():
    q, clock = quotas(default={"tokens_per_s": 10, "burst": 100})
    r = q.reserve("k", request_cost(prompt_chars=40, max_tokens=80))  # 10 + 80
    assert r.tokens == 90 and q.available("k") == 10
    r.settle(used=30)
    r.settle(used=30)  # once only
    assert q.available("k") == 70
    q.reserve("k", 70).settle(used=170)  # the estimate missed 100 tokens: debt
    assert q.available("k") == -100
    with pytest.raises(QuotaExceededError) as err:
        q.reserve("k", 0)
    assert err.value.retry_after_s == pytest.approx(10)
    clock.now += 10
    q.reserve("k", 0).settle(0)


def test_a_request_larger_than_the_burst_waits_for_a_full_bucket_not_forever():
    q, clock = quotas(default={"tokens_per_s": 10, "burst": 100})
    q.reserve("k", 50)
    with pytest.raises(QuotaExceededError) as err:
        q.reserve("k", 400)
    assert err.value.retry_after_s == pytest.approx(5)
    clock.now += 5
    q.reserve("k", 400)
    assert q.available("k") == -300


def test_tenants_by_api_key_or_adapter():
    by_key, _ = quotas(by="api_key", default={"tokens_per_s": 1})
    assert by_key.tenant("sk-a", "demo-sql") == "sk-a" and by_key.tenant(None, "demo-sql") == ""
    by_adapter, _ = quotas(by="adapter", default={"tokens_per_s": 1, "burst": 5})
    assert by_adapter.tenant("sk-a", "demo-sql") == "demo-sql"
    by_adapter.reserve("demo-sql", 1)
    with pytest.raises(QuotaExceededError, match="adapter 'demo-sql'"):
        by_adapter.reserve("demo-sql", 5)
    by_adapter.reserve("demo-chat", 5)
    assert not QuotaConfig.from_dict(None).enabled and by_key.config.enabled


def test_idle_full_buckets_are_forgotten():
    q, clock = quotas(default={"tokens_per_s": 1, "burst": 2})
    for i in range(5000):
        q.reserve(f"sk-{i}", 1)
    assert len(q._buckets) == 5000  # none full yet: each still owes its refill
    clock.now += 10  # now all full: the next pass (at twice the 4096 the first one kept) drops them
    for i in range(3200):
        q.reserve(f"sk-new-{i}", 1)
    assert len(q._buckets) == 3200 and all(t.startswith("sk-new") for t in q._buckets)


def test_config_from_the_deployment_yaml():
    raw = yaml.safe_load("""
        by: adapter
        default: {tokens_per_s: 2000, burst: 100000}
        tenants:
          demo-sql: {tokens_per_s: 50.5}
    """)
    config = QuotaConfig.from_dict(raw)
    assert config.by == "adapter" and config.default == TokenRate(2000, 100000)
    assert config.tenants["demo-sql"] == TokenRate(50.5, 50.5 * 60)
    for bad, match in (({"by": "ip"}, "quotas.by"), ({"limit": 3}, "unknown"),
                       ({"default": {"tokens_per_s": 0}}, "quotas.default: tokens_per_s"),
                       ({"default": {"tokens_per_s": 1, "burst": -1}}, "burst"),
                       ({"default": {"rate": 1}}, "quotas.default must be"),
                       ({"default": 100}, "quotas.default must be"),
                       ({"tenants": {"sk": {"tokens_per_s": True}}}, "tokens_per_s"),
                       ({"tenants": ["sk"]}, "quotas.tenants")):
        with pytest.raises(ValueError, match=match):
            QuotaConfig.from_dict(bad)


def test_the_error_keeps_its_retry_after_across_pickling():
    err = pickle.loads(pickle.dumps(QuotaExceededError("over", 2.5)))
    assert str(err) == "over" and err.retry_after_s == 2.5
