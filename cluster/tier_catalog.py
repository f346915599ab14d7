"""TierCatalog: the AdapterCatalog of a Serve replica or ingress, backed by the shared adapter-tier actor.

Registering asks the tier to fetch and validate the adapter once for the
whole cluster (against the served model too, given its AdapterFit); a
replica that needs it reads the tensors from the object store (zero-copy on
the same node) and writes them to a local directory for its engine.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import shutil
import tempfile
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from cluster.adapter_tier import materialize
from cluster.adapter_tier_actor import get_adapter
from cluster.prometheus import Histogram, text
from lora_core.adapter_fit import AdapterFit

logger = logging.getLogger(__name__)

WATCH_POLL_S = 10.0  # a follower's long poll; it renews the follower's lease at the tier
UNLOAD_SETTLE_S = 5.0  # how long an unload waits for every follower to confirm
FETCH_SECONDS = "lorafleet_adapter_tier_fetch_seconds"


class TierCatalog:
    def __init__(self, tier: Any, cache_dir: str | Path | None = None) -> None:
        self.tier = tier
        self.cache_dir = Path(cache_dir or tempfile.mkdtemp(prefix="lorafleet-replica-adapters-"))

    async def register(self, name: str, uri: str, fit: AdapterFit | None = None) -> None:
        await self.tier.load.remote(name, uri, fit)

    async def unregister(self, name: str) -> None:
        """Returns once every replica following the registry has dropped name (or UNLOAD_SETTLE_S passed)."""
        behind = await self.tier.unload.remote(name, UNLOAD_SETTLE_S)
        if behind:
            logger.warning("adapter %s unregistered; %d replica(s) did not confirm within %.0f s", name,
                           len(behind), UNLOAD_SETTLE_S)

    async def follow(self, apply: Callable[[dict[str, str]], Awaitable[None]]) -> None:
        """Apply every change of the cluster's registry as it happens (runs until cancelled): apply(names)
        has finished before the tier hears that this follower has the change (AdapterRegistry.settled)."""
        watcher, epoch, applied = uuid.uuid4().hex, None, -1
        while True:
            try:
                epoch, generation, names = await self.tier.watch.remote(watcher, epoch, applied, WATCH_POLL_S)
                await apply(names)
                applied = generation
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the tier restarting, say: follow on after a pause
                logger.warning("following the adapter registry failed; retrying", exc_info=True)
                await asyncio.sleep(1.0)

    async def lookup(self, name: str) -> str | None:
        return (await self.tier.registered.remote()).get(name)

    async def registered(self) -> dict[str, str]:
        return await self.tier.registered.remote()

    async def local_path(self, name: str) -> Path:
        """A directory of its own for each load: an engine serving the name's old weights may read its files
        again (after its host cache dropped them) while the new weights are written; release() deletes it."""
        blob = await get_adapter(self.tier, name)
        digest = hashlib.sha256(name.encode()).hexdigest()[:16]
        return materialize(blob, Path(tempfile.mkdtemp(prefix=f"{digest}-", dir=self.cache_dir)))

    async def release(self, path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)

    async def metrics_text(self) -> str:
        """The tier's counters, and its fetches' durations as a histogram, in Prometheus text format."""
        stats = await self.tier.metrics.remote()
        samples, families = [], {FETCH_SECONDS: ("histogram", "Seconds to fetch an adapter from its origin and "
                                                              "validate it")}
        for key, value in sorted(stats.items()):
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                samples.append((f"lorafleet_adapter_tier_{key}", {}, value))
                families[f"lorafleet_adapter_tier_{key}"] = ("gauge", f"the adapter tier's {key.replace('_', ' ')}")
        samples += Histogram(**stats["fetch_seconds"]).samples(FETCH_SECONDS)
        return text(samples, families)
