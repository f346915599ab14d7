"""The adapter tier as a long-lived, named Ray actor: one per cluster, found by name by every replica.

The actor ray.puts each adapter it fetches and keeps only the ObjectRef while
the adapter is cached, so the tensors live once in the object store (never
in the actor's heap) and replicas on the same node read them zero-copy:

    blob = ray.get(await tier.get.remote(name))       # or: await get_adapter(tier, name)

Killed, it restarts (max_restarts=-1), reloads the registry from
registry_dir and refetches adapters on demand. Objects it had put die with
it; get_adapter() asks again when that happens.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import ObjectLostError, OwnerDiedError

from cluster.adapter_tier import DEFAULT_FETCH_CONCURRENCY, LLAMA_LORA_MODULES, AdapterBlob, AdapterTier
from lora_core.adapter_fit import AdapterFit

DEFAULT_NAME = "lorafleet-adapter-tier"


@ray.remote(num_cpus=0)
class AdapterTierActor:
    """Ray shell around AdapterTier; every method but get() and load() forwards as is.

    source_settings is a cluster.sources.SourceSettings; parse_uri, when
    given, replaces cluster.sources.parse_adapter_uri (custom origins).
    """

    def __init__(self, *, capacity_bytes: int, registry_dir: str | Path | None = None,
                 source_settings: Any = None, work_dir: str | Path | None = None,
                 expected_lora_modules: Iterable[str] = LLAMA_LORA_MODULES,
                 parse_uri: Callable[[str], Any] | None = None,
                 fetch_concurrency: int = DEFAULT_FETCH_CONCURRENCY) -> None:
        if parse_uri is None:
            from cluster.sources import SourceSettings, parse_adapter_uri
            settings = source_settings if source_settings is not None else SourceSettings()
            parse_uri = functools.partial(parse_adapter_uri, settings=settings)
        self._tier = AdapterTier(parse_uri, capacity_bytes=capacity_bytes, registry_dir=registry_dir,
                                 work_dir=work_dir, expected_lora_modules=expected_lora_modules, pack=ray.put,
                                 fetch_concurrency=fetch_concurrency)

    async def get(self, name: str) -> ray.ObjectRef:
        """An ObjectRef to the AdapterBlob; raises the tier's typed errors (see AdapterTier.get)."""
        return await self._tier.get(name)

    async def load(self, name: str, uri: str, fit: AdapterFit | None = None) -> None:
        """Fetch, check (against fit too) and register, or change nothing (AdapterTier.load)."""
        await self._tier.load(name, uri, fit)

    def register(self, name: str, uri: str) -> None:
        self._tier.register(name, uri)

    def unregister(self, name: str) -> None:
        self._tier.unregister(name)

    async def unload(self, name: str, timeout_s: float = 5.0) -> list[str]:
        """Unregister, then wait until every replica following the registry has the change: after this
        returns, no replica serves the adapter to a later request. The watchers still behind at timeout_s."""
        self._tier.unregister(name)
        return await self._tier.registry.settled(timeout_s=timeout_s)

    async def watch(self, watcher: str, epoch: str | None, applied: int,
                    timeout_s: float = 10.0) -> tuple[str, int, dict[str, str]]:
        """A replica's long poll of the registry (AdapterRegistry.watch)."""
        return await self._tier.registry.watch(watcher, epoch, applied, timeout_s)

    def registered(self) -> dict[str, str]:
        return self._tier.registered()

    def cached(self) -> list[str]:
        return self._tier.cached()

    def metrics(self) -> dict[str, Any]:
        return self._tier.metrics.as_dict()


def get_or_create_adapter_tier(name: str = DEFAULT_NAME, namespace: str | None = None, *,
                               detached: bool = False, max_task_retries: int = 3,
                               runtime_env: dict[str, Any] | None = None, **config: Any):
    """The cluster's adapter-tier actor, started with config (AdapterTierActor's arguments) if absent.

    An existing actor of that name is returned as is, whatever config says.
    detached keeps it alive after the job that started it ends; otherwise it
    lives as long as that job. Calls are retried across a restart
    (max_task_retries): every method is idempotent. runtime_env carries what
    the origins need, e.g. {"env_vars": {"AWS_ACCESS_KEY_ID": ...}}.
    """
    options: dict[str, Any] = dict(name=name, namespace=namespace, get_if_exists=True, max_restarts=-1,
                                   max_task_retries=max_task_retries)
    if detached:
        options["lifetime"] = "detached"
    if runtime_env is not None:
        options["runtime_env"] = runtime_env
    return AdapterTierActor.options(**options).remote(**config)


async def get_adapter(tier: Any, name: str, attempts: int = 2) -> AdapterBlob:
    """The AdapterBlob for name, asking the tier again if the object died with a restarted actor."""
    for _ in range(attempts - 1):
        try:
            return await (await tier.get.remote(name))
        except (OwnerDiedError, ObjectLostError):
            pass
    return await (await tier.get.remote(name))
