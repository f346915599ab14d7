"""AdapterRegistry without Ray: persisted changes, generations, and watchers that settle an unload."""

from __future__ import annotations

import asyncio
import json

import pytest

from cluster import adapter_registry
from cluster.adapter_registry import REGISTRY_FILE, AdapterRegistry


def test_changes_persist_and_bump_the_generation(tmp_path):
    registry = AdapterRegistry(tmp_path)
    registry.set("a", "/x")
    registry.set("a", "/x")  # no change: no new generation
    registry.set("b", "/y")
    registry.set("a", None)
    assert registry.generation == 3 and registry.names() == {"b": "/y"}
    assert json.loads((tmp_path / REGISTRY_FILE).read_text()) == {"adapters": {"b": "/y"}}
    assert AdapterRegistry(tmp_path).names() == {"b": "/y"}


def test_a_failed_write_changes_nothing(tmp_path, monkeypatch):
    registry = AdapterRegistry(tmp_path)
    registry.set("a", "/x")

    def full_disk(*_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(adapter_registry.os, "replace", full_disk)
    with pytest.raises(OSError):
        registry.set("a", "/elsewhere")
    with pytest.raises(OSError):
        registry.set("b", "/y")
    assert registry.names() == {"a": "/x"} and registry.generation == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [REGISTRY_FILE]  # no temporary file left behind


def test_a_watcher_hears_of_a_change_at_once_and_settles_it():
    async def go():
        registry = AdapterRegistry()
        registry.set("a", "/x")
        applied: list[dict] = []

        async def follow():
            epoch, gen = None, -1
            while True:
                epoch, new, names = await registry.watch("replica-1", epoch, gen, timeout_s=5)
                applied.append(names)
                gen = new

        task = asyncio.ensure_future(follow())
        while not applied:
            await asyncio.sleep(0.01)
        registry.set("a", None)
        behind = await registry.settled(timeout_s=30)  # the watcher's acknowledgement ends the wait
        task.cancel()
        return behind, applied

    behind, applied = asyncio.run(go())
    assert behind == [] and applied[0] == {"a": "/x"} and applied[-1] == {}


def test_a_watcher_that_did_not_apply_is_named_after_the_timeout():
    async def go():
        registry = AdapterRegistry()
        epoch, gen, _ = await registry.watch("slow", None, -1, timeout_s=0)
        await registry.watch("slow", epoch, gen, timeout_s=0)  # applied the current generation
        registry.set("a", "/x")  # ... but never comes back for this one
        return await registry.settled(timeout_s=0.2)

    assert asyncio.run(go()) == ["slow"]


def test_a_gone_watcher_is_not_waited_for(monkeypatch):
    monkeypatch.setattr(adapter_registry, "WATCH_LEASE_GRACE_S", 0.05)

    async def go():
        registry = AdapterRegistry()
        epoch, gen, _ = await registry.watch("dead", None, -1, timeout_s=0)
        await registry.watch("dead", epoch, gen, timeout_s=0)
        registry.set("a", "/x")
        await asyncio.sleep(0.1)  # its lease (poll timeout 0 + grace) has run out
        return await registry.settled(timeout_s=5)

    assert asyncio.run(go()) == []


def test_a_watcher_of_another_epoch_is_answered_at_once():
    """A watcher of a tier that restarted (its generation counted from 0 again) must not wait on a number
    that happens to match: it gets the registry now."""
    async def go():
        registry = AdapterRegistry()
        return await asyncio.wait_for(registry.watch("w", "an-older-tier", registry.generation, timeout_s=30), 5)

    epoch, generation, names = asyncio.run(go())
    assert epoch != "an-older-tier" and generation == 0 and names == {}
