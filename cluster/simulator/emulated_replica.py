"""The Serve side of the emulated cluster (bench only): a replica whose server runs an EmulatedEngine, and an origin
whose fetches take the modeled time.

EmulatedReplica is cluster.deployments.LoRAReplica with EmulatedServer, which is LoRAServer with an EmulatedEngine
(cluster/simulator/emulated.py) in place of AsyncLLMEngine: everything above the engine is the app's (the ingress,
AdapterAffinityRouter reading record_routing_stats, LoRAServer's adapter loads through TierCatalog and the shared
tier actor). bench/emulated_cluster.py builds the app; bench/fidelity.py checks the simulator against it.

For Ray Serve's own routing side by side (the simulator's "ray-multiplex"), `multiplexed_replica` is the same
replica behind Serve's default router with model multiplexing: its requests' adapters go through
@serve.multiplexed, so each replica reports the adapters it holds, and `MultiplexedIngress` sets each call's
multiplexed_model_id, as a Ray Serve LLM app does. Its engines download each adapter from the origin on first use
(Emulation.per_replica_origin).

Unlike the rest of cluster/simulator/, these import Ray (through cluster.deployments); `import cluster.simulator`
does not import them.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ray import serve

from cluster.autoscaling import RecentAdapters
from cluster.deployments import Ingress, LoRAReplica, _replica_id, _tier
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


def multiplexed_replica(max_models: int) -> type:
    """EmulatedReplica whose requests' adapters go through @serve.multiplexed(max_num_models_per_replica=max_models):
    Serve's default router then prefers the replicas that report the adapter (its MultiplexMixin), and a replica
    drops its least recently used model id past max_models. Loading stays LoRAServer's (and the engine's LRUs)."""

    class MultiplexedEmulatedReplica(EmulatedReplica):
        @serve.multiplexed(max_num_models_per_replica=max_models)
        async def _model(self, model_id: str) -> str:
            return model_id

        async def generate(self, request):
            model_id = serve.get_multiplexed_model_id()
            if model_id:
                await self._model(model_id)
            async for item in super().generate(request):
                yield item

    return MultiplexedEmulatedReplica


class _MultiplexedCalls:
    """A replica deployment handle whose generate calls carry their adapter as multiplexed_model_id."""

    def __init__(self, handle: Any, base_model: str, options: dict | None = None) -> None:
        self._handle, self._base, self._options = handle, base_model, options or {}

    def options(self, **options: Any) -> "_MultiplexedCalls":
        return _MultiplexedCalls(self._handle, self._base, {**self._options, **options})

    @property
    def generate(self) -> Any:
        outer = self

        class _Method:
            @staticmethod
            def remote(request):
                model_id = "" if request.model == outer._base else request.model
                return outer._handle.options(**outer._options, multiplexed_model_id=model_id).generate.remote(request)

        return _Method()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle.options(**self._options) if self._options else self._handle, name)


class MultiplexedIngress(Ingress):
    """The app's Ingress, calling the replicas with each request's adapter as its multiplexed_model_id."""

    async def __init__(self, replicas, server: dict[str, Any], tier: dict[str, Any]) -> None:
        await super().__init__(replicas, server, tier)  # Serve's ingress wrapper makes the parent's async
        self.backend.replicas = _MultiplexedCalls(self.backend.replicas, self.backend.model_name)


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
