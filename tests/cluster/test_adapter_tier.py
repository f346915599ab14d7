"""AdapterTier without Ray: one origin fetch per adapter, LRU by bytes, typed errors, a registry that persists.

Adapters are the demo's real PEFT directories, fetched through the real local
source (cluster.sources) wrapped to count and slow down fetches.
"""

from __future__ import annotations

import asyncio
import json
import pickle
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from cluster.adapter_tier import AdapterBlob, AdapterTier, materialize
from cluster.errors import AdapterNotFoundError, BadAdapterSourceError, SourceUnavailableError
from cluster.sources import SourceSettings, parse_adapter_uri
from lora_core.errors import CorruptAdapterError, MultipleAdapterProblems, UnsupportedAdapterError
from lora_core.lora_model import LoRAModel
from replicas.demo_checkpoint import ensure_demo_checkpoint


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Path]:
    """The four demo adapters, a byte-identical copy of demo-summarize, and two broken ones, under one root."""
    root = tmp_path_factory.mktemp("adapters")
    demo = ensure_demo_checkpoint(root / "demo").adapters
    out = dict(demo)
    out["summarize-2"] = Path(shutil.copytree(demo["demo-summarize"], root / "summarize-2"))
    corrupt = Path(shutil.copytree(demo["demo-sql"], root / "corrupt"))
    weights = corrupt / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated
    out["corrupt"] = corrupt
    dora = Path(shutil.copytree(demo["demo-sql"], root / "dora"))
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    out["dora"] = dora
    return out


@pytest.fixture(scope="module")
def root(adapters) -> Path:
    return adapters["corrupt"].parent


class CountingParse:
    """parse_adapter_uri over the allowed root, recording each origin fetch (and optionally slowing it)."""

    def __init__(self, root: Path, delay_s: float = 0.0) -> None:
        self.settings = SourceSettings(allowed_local_roots=[root])
        self.delay_s = delay_s
        self.fetched: list[str] = []

    def __call__(self, uri: str):
        source = parse_adapter_uri(uri, self.settings)
        fetch = source.fetch

        def counted_fetch(dest):
            self.fetched.append(uri)
            time.sleep(self.delay_s)
            return fetch(dest)

        source.fetch = counted_fetch
        return source


def _blob_size(path: Path) -> int:
    tier = AdapterTier(CountingParse(path.parent), capacity_bytes=1 << 30)
    tier.register("x", str(path))
    return asyncio.run(tier.get("x")).nbytes


def test_get_returns_validated_blob_and_caches_it(adapters, root):
    parse = CountingParse(root)
    tier = AdapterTier(parse, capacity_bytes=1 << 30)
    tier.register("sql", str(adapters["demo-sql"]))

    async def run():
        return await tier.get("sql"), await tier.get("sql")

    first, second = asyncio.run(run())
    assert first is second
    assert isinstance(first, AdapterBlob) and first.config["r"] == 8
    expected = load_file(str(adapters["demo-sql"] / "adapter_model.safetensors"))
    assert first.tensors.keys() == expected.keys()
    for key, t in expected.items():
        assert isinstance(first.tensors[key], np.ndarray)
        np.testing.assert_array_equal(first.tensors[key], t.numpy())
    assert first.nbytes >= sum(t.numel() * 4 for t in expected.values())
    m = tier.metrics
    assert (m.origin_fetches, m.misses, m.hits, m.bytes_cached) == (1, 1, 1, first.nbytes)
    assert len(m.fetch_latencies_s) == 1 and parse.fetched == [str(adapters["demo-sql"])]


def test_concurrent_misses_share_one_fetch(adapters, root):
    parse = CountingParse(root, delay_s=0.1)
    tier = AdapterTier(parse, capacity_bytes=1 << 30)
    names = ["demo-sql", "demo-chat", "demo-summarize", "demo-translate"]
    for name in names:
        tier.register(name, str(adapters[name]))

    async def run():
        return await asyncio.gather(*(tier.get(name) for _ in range(3) for name in names for _ in range(2)))

    blobs = asyncio.run(run())
    assert len(blobs) == 24 and {b.name for b in blobs} == set(names)
    assert sorted(parse.fetched) == sorted(str(adapters[n]) for n in names)
    assert tier.metrics.origin_fetches == 4
    asyncio.run(run())
    assert tier.metrics.origin_fetches == 4 and tier.metrics.hits == 24


def test_origin_fetches_run_fetch_concurrency_at_once(adapters, root):
    """Four distinct misses on a tier with fetch_concurrency 2: never more than two fetches in flight, and
    two at once (its own pool, not the event loop's default executor)."""
    parse = CountingParse(root, delay_s=0.2)
    tier = AdapterTier(parse, capacity_bytes=1 << 30, fetch_concurrency=2)
    names = ["demo-sql", "demo-chat", "demo-summarize", "demo-translate"]
    for name in names:
        tier.register(name, str(adapters[name]))
    inflight, peak = [0], [0]
    fetch = tier._fetch_blocking

    def counted(*args):
        inflight[0] += 1
        peak[0] = max(peak[0], inflight[0])
        try:
            return fetch(*args)
        finally:
            inflight[0] -= 1

    tier._fetch_blocking = counted

    async def run():
        return await asyncio.gather(*(tier.get(name) for name in names))

    assert {b.name for b in asyncio.run(run())} == set(names)
    assert peak[0] == 2 and tier.metrics.origin_fetches == 4
    with pytest.raises(ValueError):
        AdapterTier(parse, capacity_bytes=1 << 30, fetch_concurrency=0)


def test_lru_eviction_by_bytes(adapters, root):
    small = _blob_size(adapters["demo-sql"]) + _blob_size(adapters["demo-summarize"])
    parse = CountingParse(root)
    tier = AdapterTier(parse, capacity_bytes=small + 100)
    for name in ("demo-sql", "demo-summarize", "summarize-2", "demo-translate"):
        tier.register(name, str(adapters[name]))

    async def run():
        await tier.get("demo-sql")
        await tier.get("demo-summarize")
        await tier.get("demo-sql")  # now demo-summarize is the least recently used
        await tier.get("summarize-2")
        assert tier.cached() == ["demo-sql", "summarize-2"]
        assert tier.metrics.evictions == 1
        assert tier.metrics.bytes_cached <= tier.capacity_bytes
        big = await tier.get("demo-translate")  # larger than the whole tier: served, not cached
        assert big.nbytes > tier.capacity_bytes and big.tensors
        assert tier.cached() == ["demo-sql", "summarize-2"]
        await tier.get("demo-translate")

    asyncio.run(run())
    assert parse.fetched.count(str(adapters["demo-translate"])) == 2
    assert tier.metrics.origin_fetches == 5 and tier.metrics.evictions == 1


def test_registry_persists_atomically_and_reloads(adapters, root, tmp_path):
    parse = CountingParse(root)
    tier = AdapterTier(parse, capacity_bytes=1 << 30, registry_dir=tmp_path)
    tier.register("sql", str(adapters["demo-sql"]))
    tier.register("chat", str(adapters["demo-chat"]))
    tier.register("gone", str(adapters["demo-summarize"]))
    tier.unregister("gone")
    assert [p.name for p in tmp_path.iterdir()] == ["adapters.json"]  # no temp file left behind

    again = AdapterTier(parse, capacity_bytes=1 << 30, registry_dir=tmp_path)
    assert again.registered() == {"sql": str(adapters["demo-sql"]), "chat": str(adapters["demo-chat"])}
    assert asyncio.run(again.get("chat")).config["r"] == 16
    with pytest.raises(AdapterNotFoundError):
        asyncio.run(again.get("gone"))


def test_unknown_and_bad_uri_are_typed_errors(adapters, root, tmp_path):
    tier = AdapterTier(CountingParse(root), capacity_bytes=1 << 30, registry_dir=tmp_path)
    with pytest.raises(AdapterNotFoundError, match="nope"):
        asyncio.run(tier.get("nope"))
    with pytest.raises(AdapterNotFoundError):
        tier.unregister("nope")
    for uri in (str(tmp_path), str(root / ".." / "x"), "ftp://host/a", ""):
        with pytest.raises(BadAdapterSourceError):
            tier.register("bad", uri)
    assert tier.registered() == {} and not (tmp_path / "adapters.json").exists()
    tier.register("missing", str(root / "no-such-adapter"))
    with pytest.raises(AdapterNotFoundError):
        asyncio.run(tier.get("missing"))


@pytest.mark.parametrize("name, error", [("corrupt", CorruptAdapterError), ("dora", UnsupportedAdapterError)])
def test_broken_adapter_is_refused_alone_and_not_cached(adapters, root, name, error):
    parse = CountingParse(root, delay_s=0.05)
    tier = AdapterTier(parse, capacity_bytes=1 << 30)
    tier.register(name, str(adapters[name]))
    tier.register("sql", str(adapters["demo-sql"]))

    async def run():
        return await asyncio.gather(*(tier.get(n) for n in (name, "sql", name, name)), return_exceptions=True)

    results = asyncio.run(run())
    assert all(isinstance(r, error) for r in (results[0], results[2], results[3]))
    assert isinstance(results[1], AdapterBlob)
    assert parse.fetched.count(str(adapters[name])) == 1  # concurrent callers shared the failing fetch
    assert tier.cached() == ["sql"] and tier.metrics.fetch_errors == 1
    with pytest.raises(error):  # not cached: a later call tries the origin again
        asyncio.run(tier.get(name))
    assert parse.fetched.count(str(adapters[name])) == 2


def test_origin_failure_then_recovery(adapters, root):
    class Flaky(CountingParse):
        down = True

        def __call__(self, uri):
            source = super().__call__(uri)
            fetch = source.fetch

            def flaky_fetch(dest):
                if self.down:
                    raise SourceUnavailableError("origin is down")
                return fetch(dest)

            source.fetch = flaky_fetch
            return source

    parse = Flaky(root)
    tier = AdapterTier(parse, capacity_bytes=1 << 30)
    tier.register("sql", str(adapters["demo-sql"]))
    with pytest.raises(SourceUnavailableError):
        asyncio.run(tier.get("sql"))
    parse.down = False
    assert asyncio.run(tier.get("sql")).name == "sql"


def test_load_keeps_a_broken_adapter_unregistered(adapters, root, tmp_path):
    tier = AdapterTier(CountingParse(root), capacity_bytes=1 << 30, registry_dir=tmp_path)
    with pytest.raises(CorruptAdapterError):
        asyncio.run(tier.load("x", str(adapters["corrupt"])))
    assert tier.registered() == {}
    asyncio.run(tier.load("x", str(adapters["demo-sql"])))
    with pytest.raises(CorruptAdapterError):  # re-pointing to a broken one keeps the old source
        asyncio.run(tier.load("x", str(adapters["corrupt"])))
    assert tier.registered() == {"x": str(adapters["demo-sql"])}
    assert AdapterTier(CountingParse(root), capacity_bytes=1, registry_dir=tmp_path).registered() == tier.registered()


def test_reregister_drops_the_old_copy(adapters, root):
    tier = AdapterTier(CountingParse(root), capacity_bytes=1 << 30)
    tier.register("x", str(adapters["demo-sql"]))
    assert asyncio.run(tier.get("x")).config["r"] == 8
    tier.register("x", str(adapters["demo-chat"]))
    assert tier.cached() == [] and tier.metrics.bytes_cached == 0
    assert asyncio.run(tier.get("x")).config["r"] == 16
    tier.unregister("x")
    assert tier.cached() == [] and tier.metrics.bytes_cached == 0


def test_materialize_round_trips_through_lora_core(adapters, root, tmp_path):
    tier = AdapterTier(CountingParse(root), capacity_bytes=1 << 30)
    tier.register("chat", str(adapters["demo-chat"]))
    blob = asyncio.run(tier.get("chat"))
    for t in blob.tensors.values():
        t.flags.writeable = False  # as the object store hands them out
    out = materialize(blob, tmp_path / "chat")
    original = LoRAModel.from_local_checkpoint(adapters["demo-chat"], ["q_proj", "k_proj", "v_proj", "o_proj",
                                                                       "gate_proj", "up_proj", "down_proj"])
    again = LoRAModel.from_local_checkpoint(out, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                  "down_proj"])
    assert again.rank == original.rank and again.loras.keys() == original.loras.keys()
    for name, lora in original.loras.items():
        torch.testing.assert_close(again.loras[name].lora_a, lora.lora_a, rtol=0, atol=0)
        assert again.loras[name].scaling == lora.scaling


def test_bfloat16_adapter_round_trips(adapters, root):
    bf16 = root / "bf16"
    shutil.copytree(adapters["demo-sql"], bf16, dirs_exist_ok=True)
    tensors = load_file(str(bf16 / "adapter_model.safetensors"))
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, str(bf16 / "adapter_model.safetensors"))
    tier = AdapterTier(CountingParse(root), capacity_bytes=1 << 30)
    tier.register("bf16", str(bf16))
    blob = asyncio.run(tier.get("bf16"))
    assert set(blob.torch_dtypes.values()) == {"bfloat16"}
    out = materialize(blob, root / "bf16-out")
    back = load_file(str(out / "adapter_model.safetensors"))
    for key, t in tensors.items():
        assert back[key].dtype == torch.bfloat16
        torch.testing.assert_close(back[key], t.to(torch.bfloat16), rtol=0, atol=0)


def test_adapter_errors_survive_pickling():
    """What the actor raises must reach its caller with its type (Ray pickles the exception)."""
    inner = [CorruptAdapterError("/a/w.safetensors", "k", "bad"), UnsupportedAdapterError("/a/c.json", None, "no")]
    for exc in (inner[0], MultipleAdapterProblems("/a", inner)):
        back = pickle.loads(pickle.dumps(exc))
        assert type(back) is type(exc) and str(back) == str(exc)
        assert (back.path, back.field, back.reason) == (exc.path, exc.field, exc.reason)
    assert [str(p) for p in back.problems] == [str(p) for p in inner]
