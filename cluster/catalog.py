"""LocalCatalog: an AdapterCatalog for one process (tests, and `LoRAServer` without Ray).

register fetches the adapter from its origin and validates it with lora_core
(against the served model too, given its AdapterFit) before it counts as
registered, so a broken adapter is refused at load time with its typed error
and a name it would re-point keeps its old weights. The Ray deployment uses
the shared adapter tier instead (cluster/tier_catalog.py), which fetches once
per cluster.
"""

from __future__ import annotations

import asyncio
import itertools
import shutil
import tempfile
from pathlib import Path

from cluster.adapter_tier import LLAMA_LORA_MODULES
from cluster.errors import AdapterNotFoundError
from cluster.sources import SourceSettings, parse_adapter_uri
from lora_core.adapter_fit import AdapterFit
from lora_core.errors import InvalidAdapterError
from lora_core.lora_model import LoRAModel


def validate_adapter_dir(path: Path, uri: str, fit: AdapterFit | None = None) -> None:
    """Parse and check the adapter as the engine will; raises lora_core's typed errors, naming uri."""
    try:
        if fit is not None:
            fit.check(path)
        else:
            LoRAModel.from_local_checkpoint(str(path), LLAMA_LORA_MODULES)
    except InvalidAdapterError as exc:
        raise exc.relocated(str(path), uri) from None


class LocalCatalog:
    def __init__(self, settings: SourceSettings, cache_dir: str | Path | None = None) -> None:
        self.settings = settings
        self.cache_dir = Path(cache_dir or tempfile.mkdtemp(prefix="lorafleet-adapters-"))
        self._uris: dict[str, str] = {}
        self._paths: dict[str, Path] = {}
        self._copies: dict[str, list[Path]] = {}  # every copy a name was fetched to, its current one included
        self._fetch_ids = itertools.count()  # a fresh directory per fetch: a re-point never writes over the old copy
        self.origin_fetches = 0

    async def register(self, name: str, uri: str, fit: AdapterFit | None = None) -> None:
        source = parse_adapter_uri(uri, self.settings)  # a bad uri fails here, before any I/O
        dest = self.cache_dir / f"{next(self._fetch_ids)}-{name.replace('/', '_')}"
        try:
            path = await asyncio.to_thread(source.fetch, dest)
            self.origin_fetches += 1
            await asyncio.to_thread(validate_adapter_dir, path, uri, fit)
        except BaseException:
            shutil.rmtree(dest, ignore_errors=True)
            raise
        self._uris[name] = uri
        self._paths[name] = path
        # A re-pointed name's old copy stays until unregister: an engine still serving the old weights may read
        # them again after its host cache dropped them.
        self._copies.setdefault(name, []).append(path)

    async def unregister(self, name: str) -> None:
        if name not in self._uris:
            raise AdapterNotFoundError(f"adapter {name!r} is not registered")
        del self._uris[name]
        del self._paths[name]
        for path in self._copies.pop(name, []):
            shutil.rmtree(path, ignore_errors=True)

    async def lookup(self, name: str) -> str | None:
        return self._uris.get(name)

    async def local_path(self, name: str) -> Path:
        if name not in self._paths:
            raise AdapterNotFoundError(f"adapter {name!r} is not registered")
        return self._paths[name]

    async def registered(self) -> dict[str, str]:
        return dict(self._uris)

    async def release(self, path: str) -> None:
        """Nothing to do: the copies here are the registrations' own (unregister deletes them)."""
