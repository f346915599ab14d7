"""The adapter-tier actor on a real local Ray: one origin fetch per adapter per cluster, object-store
eviction by bytes, a registry that survives the actor being killed, typed errors across the actor call.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import ray

from cluster.adapter_tier import load_blob
from cluster.adapter_tier_actor import get_adapter, get_or_create_adapter_tier
from cluster.errors import AdapterNotFoundError, BadAdapterSourceError
from cluster.sources import SourceSettings
from lora_core.errors import CorruptAdapterError, UnsupportedAdapterError
from replicas.demo_checkpoint import ADAPTERS, ensure_demo_checkpoint
from tests.cluster.conftest import upload_dir

NAMES = list(ADAPTERS)


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """An allowed root holding the demo adapters (under demo/v1/adapters/), a copy and two broken ones."""
    root = tmp_path_factory.mktemp("adapters")
    demo = ensure_demo_checkpoint(root / "demo").adapters
    shutil.copytree(demo["demo-summarize"], root / "summarize-2")
    corrupt = Path(shutil.copytree(demo["demo-sql"], root / "corrupt"))
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    dora = Path(shutil.copytree(demo["demo-sql"], root / "dora"))
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    return root


def demo_uri(root: Path, name: str) -> str:
    return str(root / "demo" / "v1" / "adapters" / name)


@pytest.fixture
def make_tier(ray_cluster, root, tmp_path):
    """Start a fresh, uniquely named tier actor over root: (handle, name); killed at the end of the test."""
    actors = []

    def make(**config):
        config = {"capacity_bytes": 1 << 30, "registry_dir": str(tmp_path / "registry"),
                  "source_settings": SourceSettings(allowed_local_roots=[root]), **config}
        name = f"tier-{uuid.uuid4().hex[:8]}"
        tier = get_or_create_adapter_tier(name, **config)
        actors.append(tier)
        return tier, name

    yield make
    for tier in actors:
        ray.kill(tier, no_restart=True)


@ray.remote(num_cpus=0)
def read_adapters(tier_name: str, names: list[str], rounds: int) -> dict[str, int]:
    """A stand-in replica: find the tier by name and read every adapter a few times."""
    tier = ray.get_actor(tier_name)
    seen = {}
    for _ in range(rounds):
        for name in names:
            blob = ray.get(ray.get(tier.get.remote(name)))
            # Read-only arrays: views straight into the object store, not copies.
            assert all(not t.flags.writeable for t in blob.tensors.values())
            seen[name] = blob.nbytes
    return seen


def test_k_adapters_fetched_once_for_many_concurrent_callers(make_tier, root):
    tier, name = make_tier()
    assert get_or_create_adapter_tier(name)._actor_id == tier._actor_id  # found by name, not started twice
    ray.get([tier.register.remote(n, demo_uri(root, n)) for n in NAMES])

    refs = ray.get([tier.get.remote(n) for n in NAMES for _ in range(5)])  # all in flight at once
    assert {ray.get(r).name for r in refs} == set(NAMES)
    sizes = ray.get([read_adapters.remote(name, NAMES[i:] + NAMES[:i], 3) for i in range(3)])
    assert all(s == sizes[0] for s in sizes) and set(sizes[0]) == set(NAMES)

    m = ray.get(tier.metrics.remote())
    assert m["origin_fetches"] == len(NAMES)
    assert m["misses"] > len(NAMES)  # callers that missed while a fetch was in flight joined it
    assert m["hits"] + m["misses"] == 5 * len(NAMES) + 3 * 3 * len(NAMES)
    assert m["bytes_cached"] == sum(sizes[0].values()) and len(m["fetch_latencies_s"]) == len(NAMES)


def test_eviction_by_bytes(make_tier, root):
    small = ["demo-sql", "demo-summarize"]
    capacity = sum(load_blob(n, "", demo_uri(root, n)).nbytes for n in small) + 100

    tier, _ = make_tier(capacity_bytes=capacity, registry_dir=None)
    for n in small + ["demo-translate"]:
        ray.get(tier.register.remote(n, demo_uri(root, n)))
    ray.get(tier.register.remote("summarize-2", str(root / "summarize-2")))
    for n in ["demo-sql", "demo-summarize", "demo-sql", "summarize-2"]:
        ray.get(ray.get(tier.get.remote(n)))
    assert ray.get(tier.cached.remote()) == ["demo-sql", "summarize-2"]
    big = ray.get(ray.get(tier.get.remote("demo-translate")))  # bigger than the tier: served, not cached
    assert big.nbytes > capacity and big.tensors
    assert ray.get(tier.cached.remote()) == ["demo-sql", "summarize-2"]
    m = ray.get(tier.metrics.remote())
    assert (m["evictions"], m["origin_fetches"], m["adapters_cached"]) == (1, 4, 2)
    assert m["bytes_cached"] <= capacity


def test_registry_survives_a_killed_actor(make_tier, root):
    tier, name = make_tier()
    ray.get([tier.register.remote(n, demo_uri(root, n)) for n in NAMES[:3]])
    ray.get(tier.load.remote("copy", str(root / "summarize-2")))
    ray.get(tier.unregister.remote(NAMES[0]))
    before = ray.get(tier.registered.remote())
    ray.get([tier.get.remote(n) for n in before])
    assert ray.get(tier.metrics.remote())["origin_fetches"] == len(before)

    pid = ray.get(tier.__ray_call__.remote(lambda actor: os.getpid()))
    ray.kill(tier, no_restart=False)
    deadline = time.monotonic() + 60
    while ray.get(tier.__ray_call__.remote(lambda actor: os.getpid()), timeout=60) == pid:
        assert time.monotonic() < deadline, "the tier actor did not restart"  # the old one may answer first
        time.sleep(0.1)
    assert ray.get(tier.registered.remote()) == before
    assert ray.get(tier.metrics.remote())["origin_fetches"] == 0  # a fresh process, an empty cache
    blob = asyncio.run(get_adapter(ray.get_actor(name), NAMES[1]))
    assert blob.name == NAMES[1] and isinstance(next(iter(blob.tensors.values())), np.ndarray)
    ray.get(ray.get(tier.get.remote("copy")))
    assert ray.get(tier.metrics.remote())["origin_fetches"] == 2


def test_broken_adapter_fails_alone_with_its_typed_error(make_tier, root):
    tier, _ = make_tier()
    ray.get(tier.register.remote("sql", demo_uri(root, "demo-sql")))
    ray.get(tier.register.remote("corrupt", str(root / "corrupt")))
    results = [tier.get.remote(n) for n in ("corrupt", "sql", "corrupt")]
    for ref in (results[0], results[2]):
        with pytest.raises(CorruptAdapterError, match="adapter_model.safetensors"):
            ray.get(ref)
    assert ray.get(ray.get(results[1])).name == "sql"

    with pytest.raises(UnsupportedAdapterError, match="use_dora"):
        ray.get(tier.load.remote("dora", str(root / "dora")))
    with pytest.raises(AdapterNotFoundError):
        ray.get(tier.get.remote("dora"))  # load() left it unregistered
    with pytest.raises(BadAdapterSourceError):
        ray.get(tier.register.remote("outside", "/etc"))
    assert set(ray.get(tier.registered.remote())) == {"sql", "corrupt"}
    m = ray.get(tier.metrics.remote())
    # every fetch failed but sql's: corrupt's once or twice (the second get shares the first's fetch only if it
    # arrives while that one runs; a failure is not cached: a fresh-clone CI run on a loaded machine saw two)
    # and dora's once
    assert m["fetch_errors"] == m["origin_fetches"] - 1 and 2 <= m["fetch_errors"] <= 3
    assert m["adapters_cached"] == 1


def test_adapter_from_s3_is_fetched_once(make_tier, root, s3_server, s3_client):
    s3_client.create_bucket(Bucket="tier-test")
    upload_dir(s3_client, "tier-test", "team/sql", Path(demo_uri(root, "demo-sql")))
    settings = SourceSettings(allowed_local_roots=[root], s3_endpoint_url=s3_server.endpoint_url, timeout_s=5)
    tier, name = make_tier(source_settings=settings, runtime_env={"env_vars": s3_server.env})
    ray.get(tier.load.remote("sql", "s3://tier-test/team/sql"))
    blobs = [ray.get(r) for r in ray.get([tier.get.remote("sql") for _ in range(6)])]
    blobs += [ray.get(ray.get(tier.get.remote("sql")))]
    local = load_blob("sql", "", demo_uri(root, "demo-sql"))
    for blob in blobs:
        assert blob.config == local.config and blob.tensors.keys() == local.tensors.keys()
        for key, t in local.tensors.items():
            np.testing.assert_array_equal(blob.tensors[key], t)
    assert ray.get(tier.metrics.remote())["origin_fetches"] == 1
