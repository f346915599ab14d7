"""The Serve side of the emulated cluster (bench only): a replica whose server runs an EmulatedEngine, and an origin
whose fetches take the modeled time.

EmulatedReplica is cluster.deployments.LoRAReplica with EmulatedServer, which is LoRAServer with an EmulatedEngine
(cluster/simulator/emulated.py) in place of AsyncLLMEngine: everything above the engine is the app's (the ingress,
AdapterAffinityRouter reading record_routing_stats, LoRAServer's adapter loads through TierCatalog and the shared
tier actor). bench/emulated_cluster.py builds the app; bench/fidelity.py checks the simulator against it.

Unlike the rest of cluster/simulator/, these import Ray (through cluster.deployments); `import cluster.simulator`
does not import them.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cluster.autoscaling import RecentAdapters
from cluster.deployments import LoRAReplica, _replica_id, _tier
from cluster.replica_metrics import get_or_create_metrics_board
from cluster.server import LoRAServer
from cluster.server_config import ServerConfig
from cluster.sources import SourceSettings, parse_adapter_uri
from cluster.tier_catalog import TierCatalog

from cluster.simulator.emulated import EmulatedEngine, Emulation


class EmulatedServer(LoRAServer):
    """LoRAServer over an EmulatedEngine; only the engine differs."""

    def __init__(self, config: ServerConfig, catalog: TierCatalog, emulation: Emulation) -> None:
        self._emulation = emulation
        super().__init__(config, catalog)

    def _make_engine(self, args):
        return EmulatedEngine(args, self._emulation, tokenizer=lambda: _tokenizer(self.model_dir))


def _tokenizer(model_dir: str):
    from replicas.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(model_dir)


class EmulatedReplica(LoRAReplica):
    """LoRAReplica with an EmulatedServer; `emulation` holds Emulation's fields."""

    def __init__(self, server: dict[str, Any], tier: dict[str, Any], emulation: dict[str, Any] | None = None) -> None:
        # LoRAReplica.__init__ with EmulatedServer for LoRAServer (the test checks the fields match).
        self.server = EmulatedServer(ServerConfig(**server), TierCatalog(_tier(tier, server)),
                                     Emulation.from_dict(emulation))
        self._started = asyncio.Lock()
        self._ready = False
        self._following: asyncio.Task | None = None
        self._board = get_or_create_metrics_board()
        self._replica_id = _replica_id()
        self._recent_adapters = RecentAdapters()

    async def record_routing_stats(self) -> dict[str, Any]:
        """LoRAReplica's, plus the emulated engine's counters under "emulated" (EmulatedEngine.counters: host and
        slot loads, steps, busy seconds, the clock's lag), which the router does not read and a bench does, by
        calling each replica actor's record_routing_stats."""
        stats = await super().record_routing_stats()
        stats["emulated"] = self.server.engine.counters()
        return stats


@dataclass
class ModeledOrigin:
    """parse_uri for the adapter tier (AdapterTierActor's `parse_uri`): the real source (S3 on SeaweedFS, say) whose
    fetch takes at least `min_s` wall seconds, the modeled origin time (Emulation.origin_wall_s); the real
    download counts toward it.

    The tier runs its fetches on a pool of its own (AdapterTier.fetch_concurrency threads, as the simulator's
    SharedTier does): a modeled fetch sleeps on one of them.
    """

    settings: SourceSettings = field(default_factory=SourceSettings)
    min_s: float = 0.0

    def __call__(self, uri: str) -> "_ModeledSource":
        return _ModeledSource(parse_adapter_uri(uri, settings=self.settings), self.min_s)


class _ModeledSource:
    def __init__(self, source: Any, min_s: float) -> None:
        self.source, self.min_s, self.uri = source, min_s, source.uri

    def describe(self) -> str:
        return self.source.describe()

    def fetch(self, dest: Path) -> Path:
        start = time.monotonic()
        path = self.source.fetch(dest)
        time.sleep(max(0.0, self.min_s - (time.monotonic() - start)))  # an executor thread of the tier's
        return path
